// Built without CUDA: there is no device memory to test with.
#include "transport/testing/test_buffer.h"

namespace wb::transport {

absl::StatusOr<std::unique_ptr<TestBuffer>> MakeCudaTestBuffer(int64_t, int, const std::string&) {
  return absl::UnimplementedError("built without CUDA");
}
int VisibleCudaDevices() { return 0; }

}  // namespace wb::transport
