// DeviceAllocator of a build without CUDA: every Allocate is UNIMPLEMENTED.
#include "absl/strings/str_cat.h"
#include "transport/device_allocator.h"

namespace wb::transport {
namespace {

class NoDeviceAllocator : public DeviceAllocator {
 public:
  absl::StatusOr<std::unique_ptr<DeviceMemory>> Allocate(int device, int64_t size_bytes, absl::string_view label) override {
    return absl::UnimplementedError(absl::StrCat(label, ": cannot allocate ", size_bytes, " bytes on GPU ", device,
                                                 ": this binary was built without CUDA"));
  }
};

}  // namespace

std::unique_ptr<DeviceAllocator> NewDeviceAllocator() { return std::make_unique<NoDeviceAllocator>(); }

}  // namespace wb::transport
