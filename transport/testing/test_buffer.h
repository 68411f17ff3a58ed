#pragma once
// TEST ONLY. Memory the conformance suite and its peer process register with a transport: host
// memory in a fresh POSIX shm segment, or CUDA device memory. Read/Write go through the host
// (cudaMemcpy for device memory) so tests can fill and check bytes the same way for every kind.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace wb::transport {

class TestBuffer {
 public:
  virtual ~TestBuffer() = default;
  virtual MemorySpec spec() const = 0;
  virtual absl::Status Write(int64_t offset, const void* data, int64_t n) = 0;
  virtual absl::Status Read(int64_t offset, void* out, int64_t n) const = 0;
  int64_t size() const { return spec().size_bytes; }

  // Fills the whole buffer with the deterministic pattern of `seed` (see PatternByte).
  absl::Status Fill(uint64_t seed);
  absl::StatusOr<std::vector<uint8_t>> ReadAll() const;
};

// Byte i of the pattern for `seed`.
inline uint8_t PatternByte(uint64_t seed, int64_t i) {
  uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 31;
  return static_cast<uint8_t>(x ^ (x >> 17));
}

absl::StatusOr<std::unique_ptr<TestBuffer>> MakeHostTestBuffer(int64_t size, const std::string& label);
// UNIMPLEMENTED when built without CUDA, FAILED_PRECONDITION without a visible GPU.
absl::StatusOr<std::unique_ptr<TestBuffer>> MakeCudaTestBuffer(int64_t size, int device, const std::string& label);
absl::StatusOr<std::unique_ptr<TestBuffer>> MakeTestBuffer(MemoryKind kind, int64_t size, int device,
                                                           const std::string& label);
// Number of CUDA devices visible (0 without CUDA).
int VisibleCudaDevices();

}  // namespace wb::transport
