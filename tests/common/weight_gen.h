#pragma once
// Deterministic synthetic weights: the value of every canonical element is a function of
// (tensor index, version, flat element index), so any process can check any byte it received
// without a reference copy. Used by test workers, the demo, benches and end-to-end tests.

#include <cstdint>
#include <cstring>

namespace wb {

// 64 pseudo-random bits for one element (splitmix64 over the three inputs).
inline uint64_t WeightBits(uint32_t tensor, uint64_t version, uint64_t flat_index) {
  uint64_t x = flat_index * 0x9E3779B97F4A7C15ull ^ (uint64_t{tensor} << 40) ^ (version * 0xD1B54A32D192ED03ull);
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// The element's bits for an element of `elem_size` bytes: WeightBits, except that float-sized
// elements (2 and 4 bytes: bfloat16, float16, float32) have the top exponent bit cleared, so every
// value is a finite number with |x| < 2 and quantising them (fp8 targets) is meaningful (random
// bits would put a NaN or Inf in nearly every 128x128 block). client/python/weightbridge/weights.py
// computes the same.
inline uint64_t ElementBits(uint32_t tensor, uint64_t version, uint64_t flat_index, int elem_size) {
  uint64_t bits = WeightBits(tensor, version, flat_index);
  if (elem_size == 2) bits &= ~(uint64_t{1} << 14);
  if (elem_size == 4) bits &= ~(uint64_t{1} << 30);
  return bits;
}

// Writes the element's `elem_size` (1, 2, 4 or 8) little-endian bytes to `dst`.
inline void WriteWeight(uint32_t tensor, uint64_t version, uint64_t flat_index, int elem_size,
                        void* dst) {
  uint64_t bits = ElementBits(tensor, version, flat_index, elem_size);
  std::memcpy(dst, &bits, static_cast<size_t>(elem_size));
}

inline bool CheckWeight(uint32_t tensor, uint64_t version, uint64_t flat_index, int elem_size,
                        const void* src) {
  uint64_t bits = ElementBits(tensor, version, flat_index, elem_size);
  return std::memcmp(src, &bits, static_cast<size_t>(elem_size)) == 0;
}

// ---- Versions that change a given share of elements (lossless deltas, docs/daemon.md "Deltas") ----
//
// DeltaElementBits(t, v, i, elem_size, f) is version v of a model in which a share f of the
// elements changes from one version to the next (f from the update model of daemon/delta/
// update_model.h for a learning rate, e.g. ~0.04 at lr 1e-6), still a pure function of
// (tensor, version, index), so any process verifies any element of any version in O(1) without a
// reference copy - as with ElementBits, which these functions leave unchanged.
//
// Schedule: element (t, i) changes every P versions, at the versions u with (u + phase) % P == 0;
// P and phase are hashes of (t, i). Its change count by version v is k = (v + phase) / P - one
// division, no look-back - and it differs between v - 1 and v iff that count moved. P is
// floor(1/f) or floor(1/f) + 1, mixed per element so that the mean of 1/P is exactly f: each
// version changes an expected share f of the elements (each element with probability 1/P, its
// phase uniform), a different subset every version. f <= 0 (or NaN): nothing ever changes;
// f >= 1: every element changes every version.
// Value: ElementBits(t, 0, i) with its low b mantissa bits XOR ((k * odd) mod 2^b), `odd` a hashed
// odd number, so consecutive counts always give different values (they differ by odd, which is not
// 0 mod 2^b), values stay finite (only mantissa bits move), and a change is a few units in the
// last place, like an optimiser step (b = 7 for 2-byte elements - bf16's whole stored mantissa,
// |difference| < 128 ulps -, 3 for 1-byte, 12 for 4-byte, 20 for 8-byte elements). The bit
// patterns of consecutive values thus differ the way real bf16 updates do, which is what a delta
// codec's byte count depends on. Versions must stay below 2^63.
// client/python/weightbridge/weights.py mirrors these functions (delta_schedule, ...,
// delta_element_bits); //client/python:weights_test checks it against delta_bits_dump.cc.

// period == 0: the element never changes.
struct DeltaSchedule {
  uint64_t period = 0;
  uint64_t phase = 0;
  uint64_t odd = 1;
};

namespace weight_gen_internal {
inline uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}
// A "version" no real version reaches: keeps the schedule's hashes apart from ElementBits'.
constexpr uint64_t kDeltaSalt = 0xD17A5EED00000000ull;
inline int DeltaPatternBits(int elem_size) {
  return elem_size == 1 ? 3 : elem_size == 2 ? 7 : elem_size == 4 ? 12 : 20;
}
}  // namespace weight_gen_internal

inline DeltaSchedule DeltaScheduleOf(uint32_t tensor, uint64_t flat_index, double change_fraction) {
  using weight_gen_internal::Mix;
  DeltaSchedule s;
  const uint64_t h = WeightBits(tensor, weight_gen_internal::kDeltaSalt, flat_index);
  s.odd = Mix(h ^ 0x6A09E667F3BCC909ull) | 1u;
  if (!(change_fraction > 0.0)) return s;  // never (also NaN)
  if (change_fraction >= 1.0) {
    s.period = 1;
    return s;
  }
  const double q = 1.0 / change_fraction;
  if (q >= 0x1.0p62) return s;  // changes less than once in 2^62 versions: never
  const double a = static_cast<double>(static_cast<uint64_t>(q));  // floor(q) >= 1
  // Share of elements with period a + 1 so that mean(1/P) = f: (1 - w)/a + w/(a+1) = f.
  const double w = (1.0 / a - change_fraction) * a * (a + 1.0);
  const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // uniform in [0, 1)
  s.period = static_cast<uint64_t>(a) + (u < w ? 1u : 0u);
  s.phase = Mix(h ^ 0xBB67AE8584CAA73Bull) % s.period;
  return s;
}

// How many times element (t, i) changed in versions 1..v (0 for version 0).
inline uint64_t DeltaChangeCount(const DeltaSchedule& s, uint64_t version) {
  return s.period == 0 ? 0 : (version + s.phase) / s.period;  // phase < period: 0 at version 0
}

// Whether element (t, i) of version v differs from version v - 1 (v >= 1).
inline bool DeltaChangedAt(const DeltaSchedule& s, uint64_t version) {
  return version >= 1 && s.period != 0 && (version + s.phase) % s.period == 0;
}

// The last version u <= v at which the element changed (0 if it never did): version v holds the
// value version u got.
inline uint64_t DeltaLastChange(const DeltaSchedule& s, uint64_t version) {
  if (DeltaChangeCount(s, version) == 0) return 0;
  return version - (version + s.phase) % s.period;
}

inline uint64_t DeltaElementBits(uint32_t tensor, uint64_t version, uint64_t flat_index, int elem_size,
                                 double change_fraction) {
  const DeltaSchedule s = DeltaScheduleOf(tensor, flat_index, change_fraction);
  const uint64_t mask = (uint64_t{1} << weight_gen_internal::DeltaPatternBits(elem_size)) - 1;
  return ElementBits(tensor, 0, flat_index, elem_size) ^ ((DeltaChangeCount(s, version) * s.odd) & mask);
}

inline void WriteDeltaWeight(uint32_t tensor, uint64_t version, uint64_t flat_index, int elem_size,
                             double change_fraction, void* dst) {
  const uint64_t bits = DeltaElementBits(tensor, version, flat_index, elem_size, change_fraction);
  std::memcpy(dst, &bits, static_cast<size_t>(elem_size));
}

inline bool CheckDeltaWeight(uint32_t tensor, uint64_t version, uint64_t flat_index, int elem_size,
                             double change_fraction, const void* src) {
  const uint64_t bits = DeltaElementBits(tensor, version, flat_index, elem_size, change_fraction);
  return std::memcmp(src, &bits, static_cast<size_t>(elem_size)) == 0;
}

}  // namespace wb
