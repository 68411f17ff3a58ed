#pragma once
// The delta encoder's per-chunk scan (internal to daemon/delta/codec.cc): for each element the
// zigzag-coded difference target - base, a bit mask of the changed elements and how many values
// need more than k bytes. The 2-byte case (bf16 / fp16, nearly every weight) has an AVX2 version
// (scan.cc, runtime dispatch) giving the same results as the portable loop; it and the single walk
// over changed elements are most of the sender's CPU per version (issue 17.2 update time).

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "daemon/delta/codec_parts.h"

namespace wb::delta::internal {

// Element i of an array of T at p (any alignment; compiles to a plain load).
template <typename T>
T Load(const uint8_t* p, uint64_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof v);
  return v;
}

template <typename T>
T ZigZag(T d) {
  using S = std::make_signed_t<T>;
  return static_cast<T>(static_cast<T>(d << 1) ^ static_cast<T>(static_cast<S>(d) >> (sizeof(T) * 8 - 1)));
}

template <typename T>
T UnZigZag(T z) {
  return static_cast<T>(static_cast<T>(z >> 1) ^ static_cast<T>(0 - (z & 1)));
}

template <typename T>
struct ChunkScan {
  uint64_t changed = 0;
  uint64_t over[sizeof(T)] = {};  // over[k]: changed elements whose value needs more than k bytes
};

// One pass over the chunk: the changed-element bitmap and how many values need more than k bytes.
// (The portable loop; bf16 / fp16 chunks take the AVX2 one, scan.cc, where the CPU has it.)
template <typename T>
void ScanChunkPortable(const uint8_t* a, const uint8_t* b, uint64_t n, uint64_t* masks, ChunkScan<T>* s) {
  constexpr int kEs = sizeof(T);
  uint64_t over[kEs] = {};
  for (uint64_t off = 0; off < n; off += 64) {
    const uint64_t len = std::min<uint64_t>(64, n - off);
    alignas(8) uint8_t nz[64] = {};
    for (uint64_t j = 0; j < len; ++j) {
      const T z = ZigZag(static_cast<T>(Load<T>(b, off + j) - Load<T>(a, off + j)));
      nz[j] = z != 0;
      for (int k = 1; k < kEs; ++k) over[k] += (z >> (8 * k)) != 0;
    }
    // Eight 0/1 bytes -> eight bits (bit i = byte i): the products land on distinct bits.
    uint64_t m = 0;
    for (int w = 0; w < 8; ++w) {
      const uint64_t x = Load<uint64_t>(nz + 8 * w, 0);
      m |= ((x * 0x0102040810204080ull) >> 56) << (8 * w);
    }
    masks[off / 64] = m;
    s->changed += static_cast<uint64_t>(std::popcount(m));
  }
  for (int k = 1; k < kEs; ++k) s->over[k] += over[k];
}

// The 2-byte scan on AVX2 (scan.cc); false, having done nothing, where the CPU lacks AVX2.
bool ScanChunk16Vector(const uint8_t* a, const uint8_t* b, uint64_t n, uint64_t* masks, ChunkScan<uint16_t>* s);

// What the fused 2-byte pass (ScanAndWalk16) found in a chunk.
struct Walk16 {
  uint64_t changed = 0;    // elements whose bits differ (= values written, one byte each)
  uint64_t over1 = 0;      // changed elements whose zigzag value needs 2 bytes (the exceptions)
  uint64_t gap_bytes = 0;  // LEB128 index gaps written
};

// The 2-byte scan fused with the walk over the changed elements, on AVX-512 (VBMI2 compress), 32
// elements per step from registers: one pass that gives what ScanChunk and then a walk with 1-byte
// values give - the change bitmap (`masks`), the changed elements' LEB128 index gaps in order
// (`gaps`), the low byte of each one's zigzag difference (`vals`) and (ordinal, zigzag value) of
// each one that needs 2 bytes (`excs`, appended in ordinal order). Branch-free per step except for
// the rare exception: a chunk's changed elements cost no per-element loop (at a few percent
// changed that loop was most of the encoder's time). Writes up to 36 bytes past the gaps and 32
// past the values it reports (the caller's slack; at most n + 3 * ceil(n / 32) gap bytes). `pf`
// (optional) is advanced as the pass goes. False, having done nothing, where the CPU lacks
// AVX-512 BW / VBMI2.
bool ScanAndWalk16(const uint8_t* a, const uint8_t* b, uint64_t n, uint64_t* masks, uint8_t* gaps, uint8_t* vals,
                   std::vector<std::pair<uint32_t, uint64_t>>* excs, Walk16* out, ChunkPrefetch* pf);

// The decoder's counterpart for a bitmap chunk of 2-byte elements with 1-byte values (AVX-512
// VBMI2 expand; index chunks take decode_parts.h's path): first checks everything the portable loop
// checks (the bitmap's bits and count, the values inside the payload, the exception list, no zero
// difference), writing nothing; then, 32 elements per step, expands the next values into the
// changed lanes, un-zigzags and adds them to the base (`out` may be `base`: in place, only changed
// lanes are stored; else every element is) and finally adds the high bytes of the exceptions.
// False, having written nothing, where the CPU lacks it or any check fails: the caller's portable
// loop then finds and names what is wrong.
bool DecodeSparse16(const uint8_t* payload, const uint8_t* end, uint64_t values, uint64_t excs,
                    const uint8_t* base, uint8_t* out, uint64_t n);

// The vector scan where there is one (unless `portable`: tests compare both), else the portable loop.
template <typename T>
void ScanChunk(const uint8_t* a, const uint8_t* b, uint64_t n, uint64_t* masks, ChunkScan<T>* s, bool portable) {
  if constexpr (sizeof(T) == 2) {
    if (!portable && ScanChunk16Vector(a, b, n, masks, s)) return;
  }
  ScanChunkPortable<T>(a, b, n, masks, s);
}

}  // namespace wb::delta::internal
