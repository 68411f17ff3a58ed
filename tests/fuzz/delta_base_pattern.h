#pragma once
// The base every fuzz_delta_decode seed is encoded against and the harness decodes against
// (tests/fuzz/delta_seed_gen.cc, tests/fuzz/fuzz_delta_decode.cc): byte i = i * 131 + 7.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace wb::fuzz {

inline std::vector<uint8_t> DeltaBasePattern(size_t n) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 131 + 7);
  return b;
}

}  // namespace wb::fuzz
