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

}  // namespace wb
