"""Deterministic synthetic weights, bit-identical to tests/common/weight_gen.h (numpy, vectorized).

The value of canonical element `flat` of tensor index `tensor` at `version` is the low
`elem_size` bytes (little-endian) of a splitmix64 mix of the three; any process can check any byte
it received without a reference copy.
"""

import numpy as np

_M0 = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xD1B54A32D192ED03)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def weight_bits(tensor, version, flat):
    """uint64 array of WeightBits(tensor, version, flat); `tensor` may be a scalar or an array."""
    with np.errstate(over="ignore"):
        x = np.asarray(flat, dtype=np.uint64) * _M0
        x ^= np.asarray(tensor, dtype=np.uint64) << np.uint64(40)
        x ^= np.uint64(version) * _M1
        x ^= x >> np.uint64(30)
        x *= _M2
        x ^= x >> np.uint64(27)
        x *= _M3
        x ^= x >> np.uint64(31)
    return x


def weight_values(tensor, version, flat, elem_size):
    """The element values (as unsigned ints of `elem_size` bytes) for canonical indices `flat`."""
    mask = (1 << (8 * elem_size)) - 1
    # Float-sized elements: top exponent bit cleared, so values are finite (tests/common/weight_gen.h ElementBits).
    if elem_size == 2:
        mask &= ~(1 << 14)
    elif elem_size == 4:
        mask &= ~(1 << 30)
    return (weight_bits(tensor, version, flat) & np.uint64(mask)).astype(_UINT[elem_size])


def canonical_tensor(tensor, version, shape, elem_size):
    """The whole canonical tensor `tensor` of `shape` at `version`, as unsigned ints."""
    n = int(np.prod(shape)) if len(shape) else 1
    return weight_values(tensor, version, np.arange(n, dtype=np.uint64), elem_size).reshape(shape)


def values_for_indices(bases, version, canonical_index, elem_size):
    """Expected values for an array of canonical indices (tensor = the base range it falls in)."""
    idx = np.asarray(canonical_index, dtype=np.int64)
    t = np.searchsorted(bases, idx, side="right") - 1
    return weight_values(t.astype(np.uint64), version, (idx - np.asarray(bases)[t]).astype(np.uint64), elem_size)
