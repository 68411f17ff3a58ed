#pragma once
// Internal parts of the delta encoder (codec.cc): the LEB128 writer, the per-chunk scratch, the
// value width choice and the writers of values, index gaps and exceptions (the portable walks over
// changed elements; 2-byte chunks on AVX-512 take scan.cc's fused pass instead). Not an API:
// codec.h is.

#include <bit>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "daemon/delta/codec_parts.h"
#include "daemon/delta/scan.h"

namespace wb::delta::internal {

inline int VarintLen(uint64_t v) { return v < (1u << 7) ? 1 : v < (1u << 14) ? 2 : v < (1u << 21) ? 3 : 4; }

inline void PutVarint(uint8_t*& p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
}

struct EncodeScratch {
  std::vector<uint64_t> masks;                       // one bit per element of the chunk
  std::vector<std::pair<uint32_t, uint64_t>> excs;  // (value ordinal, zigzag value) needing > width bytes
  std::vector<uint8_t> vals;                         // a chunk's values before they go after its gaps
};

// Cheapest value width for `values` values of which over[w] need more than w bytes; returns
// {width, upper bound of the bytes of values + exceptions}.
template <typename T>
std::pair<int, uint64_t> BestWidth(const ChunkScan<T>& s, uint64_t values) {
  constexpr int kEs = sizeof(T);
  std::pair<int, uint64_t> best{kEs, values * kEs};
  for (int w = 1; w < kEs; ++w) {
    const uint64_t cost = values * w + s.over[w] * (kMaxVarint + kEs - w);
    if (cost < best.second) best = {w, cost};
  }
  return best;
}

// Writes the values (low `width` bytes of each zigzag difference) of the elements the masks
// select - or of every element (dense) - and collects the exceptions. `p` may be written up to
// sizeof(T) - width bytes past the last value (slack the callers provide).
template <typename T>
void PutValues(const uint8_t* a, const uint8_t* b, uint64_t n, const uint64_t* masks, bool dense, int width, uint8_t*& p,
               EncodeScratch* scratch, ChunkPrefetch* pf) {
  scratch->excs.clear();
  const uint64_t limit = width >= static_cast<int>(sizeof(T)) ? ~uint64_t{0} : (uint64_t{1} << (8 * width)) - 1;
  uint32_t ordinal = 0;
  auto put = [&](uint64_t i) {
    const T z = ZigZag(static_cast<T>(Load<T>(b, i) - Load<T>(a, i)));
    std::memcpy(p, &z, sizeof(T));
    p += width;
    if (static_cast<uint64_t>(z) > limit) scratch->excs.emplace_back(ordinal, static_cast<uint64_t>(z));
    ++ordinal;
  };
  if (dense) {
    for (uint64_t i = 0; i < n; ++i) {
      if (i % 64 == 0) pf->To((i + 64) * sizeof(T));
      put(i);
    }
  } else {
    for (uint64_t w = 0; w * 64 < n; ++w) {
      pf->To((w + 1) * 64 * sizeof(T));
      for (uint64_t m = masks[w]; m != 0; m &= m - 1) put(w * 64 + std::countr_zero(m));
    }
  }
}

// One walk over the changed elements: their LEB128 index gaps to `gaps`, their values (as
// PutValues, `vals` with sizeof(T) bytes of slack) to `vals`, the exceptions to scratch. Returns the
// gap bytes.
template <typename T>
uint64_t PutGapsAndValues(const uint8_t* a, const uint8_t* b, uint64_t n, const uint64_t* masks, int width, uint8_t* gaps,
                          uint8_t* vals, EncodeScratch* scratch, ChunkPrefetch* pf) {
  scratch->excs.clear();
  const uint64_t limit = width >= static_cast<int>(sizeof(T)) ? ~uint64_t{0} : (uint64_t{1} << (8 * width)) - 1;
  uint8_t* g = gaps;
  uint32_t ordinal = 0;
  int64_t prev = -1;
  for (uint64_t w = 0; w * 64 < n; ++w) {
    pf->To((w + 1) * 64 * sizeof(T));
    for (uint64_t m = masks[w]; m != 0; m &= m - 1) {
      const int64_t idx = static_cast<int64_t>(w * 64 + std::countr_zero(m));
      PutVarint(g, static_cast<uint64_t>(idx - prev - 1));
      prev = idx;
      const T z = ZigZag(static_cast<T>(Load<T>(b, idx) - Load<T>(a, idx)));
      std::memcpy(vals, &z, sizeof(T));
      vals += width;
      if (static_cast<uint64_t>(z) > limit) scratch->excs.emplace_back(ordinal, static_cast<uint64_t>(z));
      ++ordinal;
    }
  }
  return static_cast<uint64_t>(g - gaps);
}

template <typename T>
void PutExceptions(int width, const EncodeScratch& scratch, uint8_t*& p) {
  int64_t prev = -1;
  for (const auto& [ordinal, z] : scratch.excs) {
    PutVarint(p, static_cast<uint64_t>(ordinal - prev - 1));
    prev = ordinal;
    std::memcpy(p, reinterpret_cast<const uint8_t*>(&z) + width, sizeof(T) - width);
    p += sizeof(T) - width;
  }
}

}  // namespace wb::delta::internal
