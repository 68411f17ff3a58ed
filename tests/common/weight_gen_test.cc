#include "tests/common/weight_gen.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace wb {
namespace {

// Share of elements of tensor 3 (n of them) that differ between versions v - 1 and v, counted from
// the values themselves (not from the schedule).
double ChangedShare(double f, uint64_t v, int n) {
  int changed = 0;
  for (int i = 0; i < n; ++i) {
    changed += DeltaElementBits(3, v, i, 2, f) != DeltaElementBits(3, v - 1, i, 2, f);
  }
  return static_cast<double>(changed) / n;
}

TEST(DeltaWeights, EachVersionChangesTheRequestedShare) {
  constexpr int kN = 200000;
  for (double f : {0.042, 0.25, 0.3333, 0.5, 0.75, 0.9}) {
    const double sigma = std::sqrt(f * (1 - f) / kN);
    for (uint64_t v : {1, 2, 7, 1000}) {
      EXPECT_NEAR(ChangedShare(f, v, kN), f, 5 * sigma + 1e-4) << "f " << f << " version " << v;
    }
  }
  EXPECT_EQ(ChangedShare(1.0, 5, 1000), 1.0);
  EXPECT_EQ(ChangedShare(0.0, 5, 1000), 0.0);
  EXPECT_EQ(ChangedShare(NAN, 5, 1000), 0.0);
  EXPECT_EQ(ChangedShare(1e-30, 5, 1000), 0.0);
}

TEST(DeltaWeights, ChangedSubsetsDifferFromVersionToVersion) {
  int both = 0, first = 0;
  for (int i = 0; i < 100000; ++i) {
    const DeltaSchedule s = DeltaScheduleOf(1, i, 0.25);
    first += DeltaChangedAt(s, 5);
    both += DeltaChangedAt(s, 5) && DeltaChangedAt(s, 6);
  }
  EXPECT_GT(first, 20000);
  // Periods of 4 (exactly 1/f): an element that changed at 5 next changes at 9, never at 6.
  EXPECT_EQ(both, 0);
}

// The O(1) formulas against a version-by-version walk of the schedule: the value changes exactly
// at the versions the schedule selects, and version v holds what its last change version got.
TEST(DeltaWeights, ClosedFormMatchesAVersionByVersionWalk) {
  for (double f : {0.1, 0.37, 0.6}) {
    for (uint32_t i = 0; i < 2000; ++i) {
      const DeltaSchedule s = DeltaScheduleOf(2, i, f);
      ASSERT_GE(s.period, 1u);
      ASSERT_LT(s.phase, s.period);
      uint64_t count = 0, last = 0;
      uint64_t prev = DeltaElementBits(2, 0, i, 2, f);
      EXPECT_EQ(prev, ElementBits(2, 0, i, 2));  // version 0 is ElementBits' version 0
      for (uint64_t v = 1; v <= 40; ++v) {
        const uint64_t cur = DeltaElementBits(2, v, i, 2, f);
        const bool walk_changes = (v + s.phase) % s.period == 0;
        if (walk_changes) {
          ++count;
          last = v;
        }
        ASSERT_EQ(DeltaChangedAt(s, v), walk_changes) << "f " << f << " element " << i << " version " << v;
        ASSERT_EQ(cur != prev, walk_changes) << "f " << f << " element " << i << " version " << v;
        ASSERT_EQ(DeltaChangeCount(s, v), count);
        ASSERT_EQ(DeltaLastChange(s, v), last);
        ASSERT_EQ(cur, DeltaElementBits(2, last, i, 2, f));
        prev = cur;
      }
    }
  }
}

TEST(DeltaWeights, ChangesAreSmallAndValuesFinite) {
  for (uint64_t v = 1; v < 20; ++v) {
    for (uint32_t i = 0; i < 5000; ++i) {
      const uint16_t a = static_cast<uint16_t>(DeltaElementBits(4, v - 1, i, 2, 0.5));
      const uint16_t b = static_cast<uint16_t>(DeltaElementBits(4, v, i, 2, 0.5));
      ASSERT_EQ(a & 0xFF80, b & 0xFF80) << "sign and exponent never move";
      ASSERT_LT(std::abs(int{a} - int{b}), 128);
      ASSERT_NE(b & 0x7F80, 0x7F80) << "bf16 Inf/NaN at element " << i;
      const uint32_t x = static_cast<uint32_t>(DeltaElementBits(4, v, i, 4, 0.5));
      float fx;
      std::memcpy(&fx, &x, 4);
      ASSERT_TRUE(std::isfinite(fx));
    }
  }
}

TEST(DeltaWeights, WriteThenCheck) {
  for (int es : {1, 2, 4, 8}) {
    std::vector<uint8_t> buf(es);
    for (uint64_t i = 0; i < 3000; ++i) {
      WriteDeltaWeight(5, 9, i, es, 0.3, buf.data());
      ASSERT_TRUE(CheckDeltaWeight(5, 9, i, es, 0.3, buf.data()));
      const DeltaSchedule s = DeltaScheduleOf(5, i, 0.3);
      // Version 8 holds other bytes exactly where version 9 changed the element.
      ASSERT_EQ(CheckDeltaWeight(5, 8, i, es, 0.3, buf.data()), !DeltaChangedAt(s, 9)) << "elem size " << es;
    }
  }
  // The original generator is untouched: ElementBits of version 9 is not the delta family's.
  std::vector<uint8_t> buf(2);
  WriteWeight(5, 9, 0, 2, buf.data());
  EXPECT_TRUE(CheckWeight(5, 9, 0, 2, buf.data()));
}

}  // namespace
}  // namespace wb
