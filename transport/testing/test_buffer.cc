#include "transport/testing/test_buffer.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/shm_segment.h"

namespace wb::transport {
namespace {

class HostTestBuffer : public TestBuffer {
 public:
  HostTestBuffer(ShmSegment seg, std::string label) : seg_(std::move(seg)), label_(std::move(label)) {}
  MemorySpec spec() const override {
    MemorySpec s;
    s.kind = MemoryKind::kHost;
    s.base = seg_.data();
    s.size_bytes = seg_.size();
    s.shared_name = seg_.name();
    s.label = label_;
    return s;
  }
  absl::Status Write(int64_t offset, const void* data, int64_t n) override {
    if (offset < 0 || n < 0 || offset + n > seg_.size()) return absl::OutOfRangeError("TestBuffer::Write out of range");
    if (n > 0) std::memcpy(static_cast<char*>(seg_.data()) + offset, data, n);
    return absl::OkStatus();
  }
  absl::Status Read(int64_t offset, void* out, int64_t n) const override {
    if (offset < 0 || n < 0 || offset + n > seg_.size()) return absl::OutOfRangeError("TestBuffer::Read out of range");
    if (n > 0) std::memcpy(out, static_cast<const char*>(seg_.data()) + offset, n);
    return absl::OkStatus();
  }

 private:
  ShmSegment seg_;
  std::string label_;
};

}  // namespace

absl::Status TestBuffer::Fill(uint64_t seed) {
  const int64_t n = size();
  std::vector<uint8_t> bytes(n);
  for (int64_t i = 0; i < n; ++i) bytes[i] = PatternByte(seed, i);
  return Write(0, bytes.data(), n);
}

absl::StatusOr<std::vector<uint8_t>> TestBuffer::ReadAll() const {
  std::vector<uint8_t> out(size());
  absl::Status s = Read(0, out.data(), size());
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<std::unique_ptr<TestBuffer>> MakeHostTestBuffer(int64_t size, const std::string& label) {
  auto seg = ShmSegment::Create(ShmSegment::UniqueName("tb"), size);
  if (!seg.ok()) return seg.status();
  return std::unique_ptr<TestBuffer>(new HostTestBuffer(std::move(*seg), label));
}

absl::StatusOr<std::unique_ptr<TestBuffer>> MakeTestBuffer(MemoryKind kind, int64_t size, int device,
                                                           const std::string& label) {
  if (kind == MemoryKind::kCuda) return MakeCudaTestBuffer(size, device, label);
  return MakeHostTestBuffer(size, label);
}

}  // namespace wb::transport
