"""weightbridge.weights' delta versions against the C++ they mirror (tests/common/weight_gen.h).

tests/common/delta_bits_dump prints DeltaScheduleOf / DeltaChangeCount / DeltaChangedAt /
DeltaLastChange / DeltaElementBits over a grid of tensors, versions, indices and change shares
(never, the update model's shares, mixed periods, every version); every value must match the
Python mirror. Also the mirror's own properties: the share of elements changing per version, and
delta_values as the low bytes of delta_element_bits.
"""

import os
import subprocess
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from weightbridge import weights  # noqa: E402

# Under Bazel (run_tests.sh) the working directory is the runfiles root; elsewhere set WB_DELTA_BITS_DUMP.
DUMP = os.environ.get("WB_DELTA_BITS_DUMP", "tests/common/delta_bits_dump")


class DeltaBitsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(DUMP):
            raise AssertionError(f"{DUMP} not found: build //tests/common:delta_bits_dump and set WB_DELTA_BITS_DUMP")
        out = subprocess.run([DUMP], check=True, capture_output=True, text=True, timeout=120).stdout
        cls.rows = [line.split() for line in out.splitlines() if line]

    def test_every_value_matches_the_cpp(self):
        self.assertGreater(len(self.rows), 10000)
        # Grouped by (tensor, version, share): one vectorised call per group, as callers use it.
        groups = {}
        for r in self.rows:
            groups.setdefault((int(r[0]), int(r[1]), r[3]), []).append(r)
        checked = 0
        for (t, v, share), rows in groups.items():
            f = float.fromhex(share)
            flat = np.array([int(r[2]) for r in rows], dtype=np.uint64)
            want = np.array([[int(x) for x in r[4:]] for r in rows], dtype=np.uint64)
            period, phase, odd = weights.delta_schedule(t, flat, f)
            where = f"tensor {t} version {v} share {f}"
            np.testing.assert_array_equal(period, want[:, 0], where + ": period")
            np.testing.assert_array_equal(phase, want[:, 1], where + ": phase")
            np.testing.assert_array_equal(odd, want[:, 2], where + ": odd")
            np.testing.assert_array_equal(weights.delta_change_count(period, phase, v), want[:, 3], where + ": count")
            np.testing.assert_array_equal(weights.delta_changed_at(period, phase, v).astype(np.uint64), want[:, 4],
                                          where + ": changed")
            np.testing.assert_array_equal(weights.delta_last_change(period, phase, v), want[:, 5], where + ": last")
            for col, e in enumerate((1, 2, 4, 8)):
                np.testing.assert_array_equal(weights.delta_element_bits(t, v, flat, e, f), want[:, 6 + col],
                                              f"{where}: bits of {e}-byte elements")
                checked += len(rows)
        self.assertEqual(checked, 4 * len(self.rows))

    def test_the_grid_holds_changes(self):
        # The comparison above means something only if the grid has elements that change, both periods.
        changed = sum(int(r[8]) for r in self.rows)
        self.assertGreater(changed, 1000)
        periods = {int(r[4]) for r in self.rows if r[3] == (0.042).hex()}
        self.assertEqual(periods, {23, 24})


class DeltaMirrorTest(unittest.TestCase):
    def test_share_of_changed_elements(self):
        flat = np.arange(200000, dtype=np.uint64)
        for f in (0.042, 0.251):
            period, phase, _ = weights.delta_schedule(5, flat, f)
            share = float(np.mean(weights.delta_changed_at(period, phase, 9)))
            self.assertAlmostEqual(share, f, delta=0.01 * f + 0.002, msg=f"share {f}")
            before = weights.delta_values(5, 8, flat, 2, f)
            after = weights.delta_values(5, 9, flat, 2, f)
            np.testing.assert_array_equal(after != before, weights.delta_changed_at(period, phase, 9))

    def test_values_are_low_bytes_and_version_zero_is_element_bits(self):
        flat = np.arange(4096, dtype=np.uint64)
        for e in (1, 2, 4, 8):
            np.testing.assert_array_equal(weights.delta_values(2, 0, flat, e, 0.05), weights.weight_values(2, 0, flat, e))
            bits = weights.delta_element_bits(2, 6, flat, e, 0.05)
            np.testing.assert_array_equal(weights.delta_values(2, 6, flat, e, 0.05),
                                          (bits & np.uint64((1 << (8 * e)) - 1)).astype(weights._UINT[e]))
        t = weights.delta_canonical_tensor(3, 4, (64, 64), 2, 0.05)
        self.assertEqual(t.shape, (64, 64))
        np.testing.assert_array_equal(t.reshape(-1), weights.delta_values(3, 4, np.arange(4096, dtype=np.uint64), 2, 0.05))


if __name__ == "__main__":
    unittest.main()
