// GpuImport of a build without CUDA: every GPU buffer is refused, naming it.

#include "absl/strings/str_cat.h"
#include "daemon/node/gpu_import.h"

namespace wb::daemon {
namespace {

class NoGpuImport final : public GpuImport {
 public:
  absl::StatusOr<std::shared_ptr<CudaImport>> Import(transport::Transport&, const std::string&, const pb::BufferSpec&, const std::string& what,
                                                     const VmmFdFn&) override {
    return absl::UnimplementedError(absl::StrCat(what, ": this weightbridged was built without CUDA"));
  }
};

}  // namespace

std::shared_ptr<GpuImport> NewGpuImport() { return std::make_shared<NoGpuImport>(); }

}  // namespace wb::daemon
