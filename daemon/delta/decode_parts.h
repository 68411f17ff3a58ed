#pragma once
// Internal to the delta decoder (codec.cc): the fast path for `index` chunks (a few percent of the
// elements changed: the chunk kind nearly every bf16 chunk takes at lr 1e-6). Not an API: codec.h
// is.
//
// Why: the general loop (codec.cc DecodeChunk) and the AVX-512 one (scan.cc DecodeSparse16) both
// turn the index gaps into a change bitmap first, one read-modify-write of a bitmap word per
// changed element (a chain through memory: every update of a word waits for the one before), and
// then visit every element of the chunk (the vector loop 32 at a time, also where nothing changed).
// Here the gaps become positions (plain stores, no chain), and only the changed elements are
// visited: the work follows the stream, not the chunk. Same checks as the general loop, all made
// before anything is written; on anything off it returns false having written nothing, and the
// general loop then finds and names the problem (so hostile streams get the same errors).

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "daemon/delta/codec_parts.h"
#include "daemon/delta/scan.h"

namespace wb::delta::internal {

struct IndexScratch {
  std::vector<uint32_t> pos;                          // element index of each value (< 2^24)
  std::vector<std::pair<uint32_t, uint64_t>> excs;   // (value ordinal, high bytes << 8 * width)
};

// The low `width` bytes of value k (little-endian), without reading past `stream_end`.
template <typename T>
T LowValue(const uint8_t* vals, uint64_t k, int width, T low_mask, const uint8_t* stream_end) {
  const uint8_t* v = vals + k * static_cast<uint64_t>(width);
  T z = 0;
  if (stream_end - v >= static_cast<std::ptrdiff_t>(sizeof(T))) {
    std::memcpy(&z, v, sizeof(T));
    return static_cast<T>(z & low_mask);
  }
  std::memcpy(&z, v, static_cast<size_t>(width));
  return z;
}

// Decodes an index chunk of `n` elements of T with `values` values of `width` bytes and `excs`
// exceptions, payload [payload, end), into `out` (== base: in place, only changed elements are
// written; else the base is copied first). `pf` is advanced as the elements are written.
template <typename T>
bool DecodeIndexChunk(const uint8_t* payload, const uint8_t* end, const uint8_t* stream_end, uint64_t values,
                      uint64_t excs, int width, const uint8_t* base, uint8_t* out, uint64_t n, ChunkPrefetch* pf) {
  constexpr int kEs = sizeof(T);
  thread_local IndexScratch s;
  if (s.pos.size() < values) s.pos.resize(values);
  uint32_t* pos = s.pos.data();
  // 1. Positions: every gap readable (<= 4 LEB128 bytes) and inside the chunk.
  const uint8_t* q = payload;
  uint64_t next = 0;  // previous index + 1
  for (uint64_t k = 0; k < values; ++k) {
    uint64_t gap;
    if (q < end && *q < 0x80) {
      gap = *q++;
    } else if (!GetVarint(q, end, &gap)) {
      return false;
    }
    const uint64_t idx = next + gap;
    if (idx >= n) return false;
    pos[k] = static_cast<uint32_t>(idx);
    next = idx + 1;
  }
  const uint8_t* vals = q;
  if (static_cast<uint64_t>(end - vals) < values * static_cast<uint64_t>(width)) return false;
  const T low_mask = width >= kEs ? static_cast<T>(~T{0}) : static_cast<T>((uint64_t{1} << (8 * width)) - 1);
  // 2. The exceptions: ordinals rising and below `values`, their high bytes inside the payload,
  // nothing after them; and no changed element with a zero difference (a zero low value needs an
  // exception with a nonzero high part).
  s.excs.clear();
  const uint8_t* e = vals + values * static_cast<uint64_t>(width);
  const int high_bytes = kEs - width;
  int64_t prev = -1;
  uint64_t fixed_zeros = 0;
  for (uint64_t j = 0; j < excs; ++j) {
    uint64_t gap;
    if (!GetVarint(e, end, &gap) || end - e < high_bytes) return false;
    const uint64_t ordinal = static_cast<uint64_t>(prev + 1) + gap;
    if (ordinal >= values) return false;
    uint64_t high = 0;
    std::memcpy(&high, e, static_cast<size_t>(high_bytes));
    e += high_bytes;
    const bool low_zero = LowValue<T>(vals, ordinal, width, low_mask, stream_end) == 0;
    if (low_zero && high == 0) return false;
    fixed_zeros += low_zero;
    s.excs.emplace_back(static_cast<uint32_t>(ordinal), high << (8 * width));
    prev = static_cast<int64_t>(ordinal);
  }
  if (e != end) return false;
  uint64_t zero_lows = 0;
  if (width == 1) {
    for (uint64_t k = 0; k < values; ++k) zero_lows += vals[k] == 0;  // vectorises
  } else {
    for (uint64_t k = 0; k < values; ++k) zero_lows += LowValue<T>(vals, k, width, low_mask, stream_end) == 0;
  }
  if (zero_lows != fixed_zeros) return false;
  // 3. Apply: base + difference at each position (in place: only those elements are written).
  if (out != base) std::memcpy(out, base, n * kEs);
  // Values whose T-wide load stays inside the stream (all but the last few at its very end).
  const uint64_t room = static_cast<uint64_t>(stream_end - vals);
  uint64_t fast = values;
  if (room < values * width + (kEs - width)) fast = room >= static_cast<uint64_t>(kEs) ? (room - kEs) / width + 1 : 0;
  fast = std::min(fast, values);
  for (uint64_t k = 0; k < values; ++k) {
    const uint64_t idx = pos[k];
    if ((k & 15) == 0) pf->To((idx + 1) * kEs);  // the next chunk as far as this one has come
    T z;
    if (k < fast) {
      std::memcpy(&z, vals + k * width, sizeof(T));
      z = static_cast<T>(z & low_mask);
    } else {
      z = LowValue<T>(vals, k, width, low_mask, stream_end);
    }
    T v;
    std::memcpy(&v, out + idx * kEs, kEs);
    v = static_cast<T>(v + UnZigZag(z));
    std::memcpy(out + idx * kEs, &v, kEs);
  }
  // 4. The exceptions' high bytes: the element got base + the low value's difference.
  for (const auto& [ordinal, high] : s.excs) {
    const uint64_t idx = pos[ordinal];
    const T low = LowValue<T>(vals, ordinal, width, low_mask, stream_end);
    const T full = static_cast<T>(low | static_cast<T>(high));
    T v;
    std::memcpy(&v, out + idx * kEs, kEs);
    v = static_cast<T>(v - UnZigZag(low) + UnZigZag(full));
    std::memcpy(out + idx * kEs, &v, kEs);
  }
  return true;
}

}  // namespace wb::delta::internal
