// Prints tests/common/weight_gen.h's delta versions (DeltaScheduleOf, DeltaChangeCount,
// DeltaChangedAt, DeltaLastChange, DeltaElementBits) over a grid of tensors, versions, indices and
// change shares, one line per (tensor, version, index, share):
//   tensor version index share(%a) period phase odd count changed last bits1 bits2 bits4 bits8
// (integers in decimal, bitsN = DeltaElementBits for N-byte elements). The Python mirror
// (client/python/weightbridge/weights.py) is checked against it by client/python/tests/weights_test.py.
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "tests/common/weight_gen.h"

int main() {
  // Shares: never (<= 0, NaN, too small to change within 2^62 versions), the update model's
  // (0.042 at lr 1e-6, 0.251 at 1e-5), periods mixing floor(1/f) and floor(1/f) + 1, every version.
  const std::vector<double> shares = {0.0, -1.0, std::nan(""), 1e-20, 0.042, 0.05, 0.251, 1.0 / 3.0, 0.5, 0.9, 1.0, 1.5};
  const std::vector<uint64_t> versions = {0, 1, 2, 3, 4, 7, 20, 1000, (uint64_t{1} << 40) + 3};
  std::vector<uint64_t> indices;
  for (uint64_t i = 0; i < 48; ++i) indices.push_back(i);
  indices.push_back(1000000007);
  indices.push_back((uint64_t{1} << 40) + 5);
  for (uint32_t t : {0u, 1u, 290u}) {
    for (uint64_t v : versions) {
      for (uint64_t i : indices) {
        for (double f : shares) {
          const wb::DeltaSchedule s = wb::DeltaScheduleOf(t, i, f);
          std::printf("%" PRIu32 " %" PRIu64 " %" PRIu64 " %a %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %d %" PRIu64, t, v, i, f,
                      s.period, s.phase, s.odd, wb::DeltaChangeCount(s, v), wb::DeltaChangedAt(s, v) ? 1 : 0,
                      wb::DeltaLastChange(s, v));
          for (int e : {1, 2, 4, 8}) std::printf(" %" PRIu64, wb::DeltaElementBits(t, v, i, e, f));
          std::printf("\n");
        }
      }
    }
  }
  return 0;
}
