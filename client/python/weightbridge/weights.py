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
    return _mix_in_place(x)


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


# ---- Versions that change a given share of elements (lossless deltas) ----
# Mirror of tests/common/weight_gen.h DeltaScheduleOf / DeltaChangeCount / DeltaChangedAt /
# DeltaLastChange / DeltaElementBits (docs/daemon.md "Deltas (design and status)", "Synthetic
# versions"): element (t, i) changes every P versions, at the versions u with (u + phase) % P == 0;
# P is floor(1/f) or floor(1/f) + 1, mixed per element so that mean(1/P) = f; its value at version
# v is its version-0 ElementBits with the low mantissa bits (7 for 2-byte elements, 3 / 12 / 20 for
# 1 / 4 / 8-byte) XOR (k * odd) mod 2^b, k = (v + phase) // P. Bit-identical to the C++
# (client/python/tests/weights_test.py checks it against tests/common/delta_bits_dump).

_DELTA_SALT = 0xD17A5EED00000000  # a "version" no real version reaches (C++ kDeltaSalt)
_ODD_SALT = np.uint64(0x6A09E667F3BCC909)
_PHASE_SALT = np.uint64(0xBB67AE8584CAA73B)
_DELTA_PATTERN_BITS = {1: 3, 2: 7, 4: 12, 8: 20}


def _mix_in_place(x):
    """The 64-bit finaliser (splitmix64's) of the C++ hashes, applied to uint64 array `x` in place."""
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _M2
        x ^= x >> np.uint64(27)
        x *= _M3
        x ^= x >> np.uint64(31)
    return x


def _mix(x):
    return _mix_in_place(np.array(x, dtype=np.uint64, copy=True))


def delta_schedule(tensor, flat, change_fraction):
    """(period, phase, odd) uint64 arrays of DeltaScheduleOf(tensor, flat, f); period 0 = never changes."""
    h = weight_bits(tensor, _DELTA_SALT, flat)
    odd = _mix(h ^ _ODD_SALT) | np.uint64(1)
    period = np.zeros(h.shape, dtype=np.uint64)
    phase = np.zeros(h.shape, dtype=np.uint64)
    f = float(change_fraction)
    if not f > 0.0:  # never (also NaN)
        return period, phase, odd
    if f >= 1.0:
        period[...] = 1
        return period, phase, odd
    q = 1.0 / f
    if q >= 2.0 ** 62:  # changes less than once in 2^62 versions: never
        return period, phase, odd
    a = float(int(q))  # floor(q) >= 1
    # Share of elements with period a + 1 so that mean(1/P) = f: (1 - w)/a + w/(a+1) = f. The same
    # float64 operations in the same order as the C++.
    w = (1.0 / a - f) * a * (a + 1.0)
    u = (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53  # uniform in [0, 1)
    period = np.uint64(int(a)) + (u < w).astype(np.uint64)
    phase = _mix(h ^ _PHASE_SALT) % period
    return period, phase, odd


def delta_change_count(period, phase, version):
    """How many times each element changed in versions 1..version (DeltaChangeCount)."""
    period = np.asarray(period, dtype=np.uint64)
    safe = np.where(period == 0, np.uint64(1), period)
    k = (np.uint64(version) + np.asarray(phase, dtype=np.uint64)) // safe
    return np.where(period == 0, np.uint64(0), k).astype(np.uint64)


def delta_changed_at(period, phase, version):
    """Whether each element of `version` differs from version - 1 (DeltaChangedAt; version >= 1)."""
    period = np.asarray(period, dtype=np.uint64)
    safe = np.where(period == 0, np.uint64(1), period)
    hit = (np.uint64(version) + np.asarray(phase, dtype=np.uint64)) % safe == 0
    return (version >= 1) & (period != 0) & hit


def delta_last_change(period, phase, version):
    """The last version u <= version at which each element changed, 0 if never (DeltaLastChange)."""
    period = np.asarray(period, dtype=np.uint64)
    safe = np.where(period == 0, np.uint64(1), period)
    last = np.uint64(version) - (np.uint64(version) + np.asarray(phase, dtype=np.uint64)) % safe
    return np.where(delta_change_count(period, phase, version) == 0, np.uint64(0), last).astype(np.uint64)


def delta_element_bits(tensor, version, flat, elem_size, change_fraction):
    """uint64 array of DeltaElementBits(tensor, version, flat, elem_size, f) (all 64 bits, as the C++)."""
    period, phase, odd = delta_schedule(tensor, flat, change_fraction)
    mask = np.uint64((1 << _DELTA_PATTERN_BITS[elem_size]) - 1)
    base = weight_bits(tensor, 0, flat)
    if elem_size == 2:
        base &= np.uint64(~(1 << 14) & 0xFFFFFFFFFFFFFFFF)
    elif elem_size == 4:
        base &= np.uint64(~(1 << 30) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        return base ^ ((delta_change_count(period, phase, version) * odd) & mask)


def delta_values(tensor, version, flat, elem_size, change_fraction):
    """The element values (unsigned ints of `elem_size` bytes) of delta version `version` (WriteDeltaWeight)."""
    bits = delta_element_bits(tensor, version, flat, elem_size, change_fraction)
    return (bits & np.uint64((1 << (8 * elem_size)) - 1)).astype(_UINT[elem_size])


def delta_canonical_tensor(tensor, version, shape, elem_size, change_fraction):
    """The whole canonical tensor `tensor` of `shape` at delta version `version`, as unsigned ints."""
    n = int(np.prod(shape)) if len(shape) else 1
    return delta_values(tensor, version, np.arange(n, dtype=np.uint64), elem_size, change_fraction).reshape(shape)
