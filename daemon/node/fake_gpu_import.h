#pragma once
// Hand-written GpuImport for tests: answers every Import with the scripted status (OK: a
// CudaImport of the buffer's size on the buffer's gpu, region handle = the call's index) and
// records each call's (worker, buffer id). Thread-safe.

#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/node/gpu_import.h"

namespace wb::daemon {

class FakeGpuImport final : public GpuImport {
 public:
  void SetAnswer(absl::Status s) {
    absl::MutexLock l(&mu_);
    answer_ = std::move(s);
  }
  std::vector<std::pair<std::string, uint32_t>> calls() {
    absl::MutexLock l(&mu_);
    return calls_;
  }
  absl::StatusOr<std::shared_ptr<CudaImport>> Import(transport::Transport& t, const std::string& worker, const pb::BufferSpec& b,
                                                     const std::string& what, const VmmFdFn&) override {
    absl::MutexLock l(&mu_);
    calls_.push_back({worker, b.buffer_id()});
    if (!answer_.ok()) return absl::Status(answer_.code(), what + ": " + std::string(answer_.message()));
    auto imp = std::make_shared<CudaImport>();
    imp->t = &t;
    imp->h.id = calls_.size();
    imp->size = static_cast<int64_t>(b.size_bytes());
    imp->device = b.gpu();
    return imp;
  }

 private:
  absl::Mutex mu_;
  absl::Status answer_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, uint32_t>> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon
