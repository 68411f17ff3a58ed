#include "daemon/delta/scan.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "daemon/delta/encode_parts.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace wb::delta::internal {
namespace {

#if defined(__x86_64__)
// 64 16-bit lanes of 0 / 0xFFFF (four vectors, in element order) -> one bit each. packs
// interleaves the 128-bit lanes ([0-7, 16-23, 8-15, 24-31]); the permute restores the order.
__attribute__((target("avx2"))) inline uint64_t Bits64Avx2(const __m256i* x) {
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi16(x[0], x[1]), 0xD8);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi16(x[2], x[3]), 0xD8);
  return static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(lo))) |
         static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(hi))) << 32;
}

// The 2-byte scan on AVX2, 64 elements (one mask word) per step: difference, zigzag, "changed" and
// "needs 2 bytes" as 16-bit compares packed to bytes and moved to bit masks. Same results as the
// portable loop (the codec test runs both through the encoder), about 4x as fast.
__attribute__((target("avx2"))) void ScanChunk16Avx2(const uint8_t* a, const uint8_t* b, uint64_t n, uint64_t* masks,
                                                     ChunkScan<uint16_t>* s) {
  const __m256i zero = _mm256_setzero_si256();
  uint64_t changed = 0, over1 = 0;
  uint64_t off = 0;
  for (; off + 64 <= n; off += 64) {
    __m256i same[4], fits[4];
    for (int q = 0; q < 4; ++q) {
      const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2 * (off + 16 * q)));
      const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * (off + 16 * q)));
      const __m256i d = _mm256_sub_epi16(vb, va);
      const __m256i z = _mm256_xor_si256(_mm256_slli_epi16(d, 1), _mm256_srai_epi16(d, 15));
      same[q] = _mm256_cmpeq_epi16(z, zero);
      fits[q] = _mm256_cmpeq_epi16(_mm256_srli_epi16(z, 8), zero);
    }
    const uint64_t m = ~Bits64Avx2(same);
    over1 += static_cast<uint64_t>(std::popcount(~Bits64Avx2(fits)));
    masks[off / 64] = m;
    changed += static_cast<uint64_t>(std::popcount(m));
  }
  s->changed += changed;
  s->over[1] += over1;
  if (off < n) ScanChunkPortable<uint16_t>(a + 2 * off, b + 2 * off, n - off, masks + off / 64, s);
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

bool HasAvx512Vbmi2() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2") &&
                          __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
  return has;
}

// The encoder's and the decoder's AVX-512 paths (HasAvx512Vbmi2 checks each feature).
#define WB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,bmi,bmi2,lzcnt,popcnt")))

// Per step of 32 elements (a cache line of base and of target): difference, zigzag, the nonzero
// lanes as a mask; the changed lanes' zigzag values compressed to the front and narrowed to bytes
// (their values); their lane numbers compressed the same way, each minus the one before it, minus
// 1 (their gaps inside the step, all < 32: one LEB128 byte each). Only the step's first gap, from
// the last change of an earlier step, may need more bytes: it is written by PutVarint over the one
// byte the vector store left for it (the store goes first, at the offset that lines its second
// gap up behind the first). A step without changes writes garbage that the next one overwrites.
WB_AVX512 void ScanAndWalk16Avx512(const uint8_t* a, const uint8_t* b, uint64_t n, uint64_t* masks, uint8_t* gaps,
                                        uint8_t* vals, std::vector<std::pair<uint32_t, uint64_t>>* excs, Walk16* out,
                                        ChunkPrefetch* pf) {
  const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12,
                                        11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // Lane j takes lane j - 1 (lane 0 itself): the previous change's lane number.
  const __m512i before = _mm512_set_epi16(30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11,
                                          10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0);
  const __m512i one = _mm512_set1_epi16(1);
  const __m512i byte_max = _mm512_set1_epi16(0xFF);
  uint8_t* g = gaps;
  uint8_t* v = vals;
  int64_t prev = -1;
  uint64_t changed = 0, over1 = 0;
  for (uint64_t off = 0; off < n; off += 32) {
    const uint64_t left = n - off;
    const __mmask32 live = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << left) - 1);
    if (pf != nullptr && (off & 63) == 0) pf->To((off + 64) * 2);
    const __m512i va = _mm512_maskz_loadu_epi16(live, a + 2 * off);
    const __m512i vb = _mm512_maskz_loadu_epi16(live, b + 2 * off);
    const __m512i d = _mm512_sub_epi16(vb, va);
    const __m512i z = _mm512_xor_si512(_mm512_slli_epi16(d, 1), _mm512_srai_epi16(d, 15));
    const __mmask32 k = _mm512_test_epi16_mask(z, z);
    if ((off & 63) == 0) {
      masks[off / 64] = k;
    } else {
      masks[off / 64] |= static_cast<uint64_t>(k) << 32;
    }
    const uint32_t kk = static_cast<uint32_t>(k);
    const int cnt = std::popcount(kk);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v), _mm512_cvtepi16_epi8(_mm512_maskz_compress_epi16(k, z)));
    const __m512i lanes = _mm512_maskz_compress_epi16(k, iota);
    const __m512i in_gaps = _mm512_sub_epi16(_mm512_sub_epi16(lanes, _mm512_permutexvar_epi16(before, lanes)), one);
    const int64_t first = static_cast<int64_t>(off) + std::countr_zero(kk);  // off + 32 without changes
    const uint64_t gap0 = static_cast<uint64_t>(first - prev - 1);
    const int len0 = VarintLen(gap0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(g + len0 - 1), _mm512_cvtepi16_epi8(in_gaps));
    uint8_t* g0 = g;
    PutVarint(g0, gap0);
    const __mmask32 big = _mm512_mask_cmpgt_epu16_mask(k, z, byte_max);
    if (big != 0) {  // rare: values that need their high byte (exceptions), in ordinal order
      alignas(64) uint16_t zs[32];
      _mm512_store_si512(zs, z);
      for (uint32_t m = static_cast<uint32_t>(big); m != 0; m &= m - 1) {
        const int lane = std::countr_zero(m);
        const uint32_t ordinal = static_cast<uint32_t>(changed) + std::popcount(kk & ((uint32_t{1} << lane) - 1));
        excs->emplace_back(ordinal, zs[lane]);
      }
      over1 += static_cast<uint64_t>(std::popcount(static_cast<uint32_t>(big)));
    }
    g += cnt != 0 ? len0 + cnt - 1 : 0;
    v += cnt;
    prev = cnt != 0 ? static_cast<int64_t>(off) + 31 - std::countl_zero(kk) : prev;
    changed += static_cast<uint64_t>(cnt);
  }
  out->changed = changed;
  out->over1 = over1;
  out->gap_bytes = static_cast<uint64_t>(g - gaps);
}

#endif

#if defined(__x86_64__)

struct Sparse16Scratch {
  std::vector<uint64_t> masks;
  std::vector<std::pair<uint32_t, uint8_t>> excs;  // (value ordinal, high byte)
};

// Phase 1 of DecodeSparse16: the checks and the change bitmap; returns where the values start, or
// null when anything is off. (Index chunks take decode_parts.h's path, which visits only the
// changed elements.)
const uint8_t* CheckSparse16(const uint8_t* payload, const uint8_t* end, uint64_t values, uint64_t excs, uint64_t n,
                             Sparse16Scratch* s) {
  const uint64_t words = (n + 63) / 64;
  s->masks.assign(words, 0);
  const uint64_t bitmap_bytes = (n + 7) / 8;
  if (static_cast<uint64_t>(end - payload) < bitmap_bytes) return nullptr;
  uint64_t set = 0;
  for (uint64_t w = 0; w < words; ++w) {
    uint64_t m = 0;
    std::memcpy(&m, payload + 8 * w, std::min<uint64_t>(8, bitmap_bytes - 8 * w));
    if (n - w * 64 < 64 && (m >> (n - w * 64)) != 0) return nullptr;
    s->masks[w] = m;
    set += static_cast<uint64_t>(std::popcount(m));
  }
  if (set != values) return nullptr;
  const uint8_t* vals = payload + bitmap_bytes;
  if (static_cast<uint64_t>(end - vals) < values) return nullptr;
  s->excs.clear();
  const uint8_t* e = vals + values;
  int64_t prev = -1;
  uint64_t zeros = 0;
  for (uint64_t j = 0; j < excs; ++j) {
    uint64_t gap;
    if (!GetVarint(e, end, &gap) || e >= end) return nullptr;
    const uint64_t ordinal = static_cast<uint64_t>(prev + 1) + gap;
    if (ordinal >= values) return nullptr;
    const uint8_t high = *e++;
    if (high == 0 && vals[ordinal] == 0) return nullptr;  // a zero difference
    if (vals[ordinal] == 0) ++zeros;                         // a zero low byte that is fine
    s->excs.emplace_back(static_cast<uint32_t>(ordinal), high);
    prev = static_cast<int64_t>(ordinal);
  }
  if (e != end) return nullptr;
  uint64_t zero_lows = 0;
  for (uint64_t k = 0; k < values; ++k) zero_lows += vals[k] == 0;
  if (zero_lows != zeros) return nullptr;  // a changed element with a zero difference
  return vals;
}

// Phase 2: the values into the changed lanes, 32 elements per step.
WB_AVX512 void ApplySparse16(const uint64_t* masks, const uint8_t* vals, const uint8_t* base, uint8_t* out, uint64_t n,
                                    bool in_place) {
  const __m512i one = _mm512_set1_epi16(1);
  const __m512i zero = _mm512_setzero_si512();
  const uint8_t* vp = vals;
  for (uint64_t off = 0; off < n; off += 32) {
    const uint64_t left = n - off;
    const __mmask32 live = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << left) - 1);
    const uint32_t k = static_cast<uint32_t>(masks[off / 64] >> (off & 32));
    const int cnt = std::popcount(k);
    const __mmask32 take = cnt == 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << cnt) - 1);
    const __m512i z = _mm512_maskz_expand_epi16(k, _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(take, vp)));
    const __m512i d = _mm512_xor_si512(_mm512_srli_epi16(z, 1), _mm512_sub_epi16(zero, _mm512_and_si512(z, one)));
    const __m512i r = _mm512_add_epi16(_mm512_maskz_loadu_epi16(live, base + 2 * off), d);
    _mm512_mask_storeu_epi16(out + 2 * off, in_place ? static_cast<__mmask32>(k) : live, r);
    vp += cnt;
  }
}

// Phase 3: each exception's high byte (the element got base + its low byte's difference).
WB_AVX512 void PatchExceptions16(const Sparse16Scratch& s, const uint8_t* vals, uint8_t* out) {
  uint64_t w = 0, before = 0;  // the word the next ordinal is in, set bits before it
  for (const auto& [ordinal, high] : s.excs) {
    while (before + static_cast<uint64_t>(std::popcount(s.masks[w])) <= ordinal) before += std::popcount(s.masks[w++]);
    const uint64_t idx = 64 * w + std::countr_zero(_pdep_u64(uint64_t{1} << (ordinal - before), s.masks[w]));
    const uint16_t low = vals[ordinal];
    const uint16_t full = static_cast<uint16_t>(low | (uint16_t{high} << 8));
    uint16_t v;
    std::memcpy(&v, out + 2 * idx, 2);
    v = static_cast<uint16_t>(v - UnZigZag<uint16_t>(low) + UnZigZag<uint16_t>(full));
    std::memcpy(out + 2 * idx, &v, 2);
  }
}
#endif

}  // namespace

bool DecodeSparse16(const uint8_t* payload, const uint8_t* end, uint64_t values, uint64_t excs,
                    const uint8_t* base, uint8_t* out, uint64_t n) {
#if defined(__x86_64__)
  if (!HasAvx512Vbmi2()) return false;
  thread_local Sparse16Scratch scratch;
  const uint8_t* vals = CheckSparse16(payload, end, values, excs, n, &scratch);
  if (vals == nullptr) return false;
  ApplySparse16(scratch.masks.data(), vals, base, out, n, out == base);
  PatchExceptions16(scratch, vals, out);
  return true;
#else
  return false;
#endif
}

bool ScanAndWalk16(const uint8_t* a, const uint8_t* b, uint64_t n, uint64_t* masks, uint8_t* gaps, uint8_t* vals,
                   std::vector<std::pair<uint32_t, uint64_t>>* excs, Walk16* out, ChunkPrefetch* pf) {
#if defined(__x86_64__)
  if (HasAvx512Vbmi2()) {
    ScanAndWalk16Avx512(a, b, n, masks, gaps, vals, excs, out, pf);
    return true;
  }
#endif
  return false;
}

bool ScanChunk16Vector(const uint8_t* a, const uint8_t* b, uint64_t n, uint64_t* masks, ChunkScan<uint16_t>* s) {
#if defined(__x86_64__)
  if (HasAvx2()) {
    ScanChunk16Avx2(a, b, n, masks, s);
    return true;
  }
#endif
  return false;
}

}  // namespace wb::delta::internal
