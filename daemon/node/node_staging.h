#pragma once
// The node's staging memory: host buffers recycled through a StagingPool, every byte charged to
// the node's one StagingBudget (--staging_budget_bytes), GPU staging under the per-GPU budget of
// DeviceStaging, and copies of a worker's live buffers into staging (Publish snapshots).
//
// Thread-safe: the pool, the budget and DeviceStaging have leaf locks of their own; NodeStaging
// has no state of its own beyond them, so callers may hold any lock around these calls (ReadLive
// runs copies: call it without locks held).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "daemon/device_staging.h"
#include "daemon/metrics.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/staging_budget.h"
#include "daemon/staging_pool.h"
#include "transport/device_allocator.h"
#include "base/shm_segment.h"

namespace wb::daemon::node {

class NodeStaging {
 public:
  using Bytes = StagedBytes;  // one entry per buffer, layout order
  struct Options {
    std::string node_id;
    int64_t budget_bytes = int64_t{64} << 30;  // the node's host staging budget
    Clock* clock = Clock::Real();              // the pool's idle timer
    // GPU staging (null or a zero budget: host staging only).
    std::shared_ptr<DeviceStaging> device_staging;
    DaemonMetrics* metrics = nullptr;  // required; must outlive this
    LiveCopier* copier = nullptr;      // required (ReadLive's host copies); must outlive this
  };
  explicit NodeStaging(Options options);

  // `n` empty buffers whose host memory goes back to the pool when the last reference drops
  // (fill them with TakeHost): every host staging of a version is made this way.
  // `charges` (daemon/node/staging_budget.h) are held until the memory is gone.
  std::shared_ptr<Bytes> NewBytes(size_t n = 0, std::vector<std::shared_ptr<StagingBudget::Charge>> charges = {});
  // `bytes`, also holding `charge` until the memory is gone.
  static std::shared_ptr<Bytes> KeepWith(std::shared_ptr<Bytes> bytes, std::shared_ptr<StagingBudget::Charge> charge);
  // Host staging of `size` bytes from the pool (recycled when one of that size is idle). With
  // `tag`, the buffer given back with that tag first (*tag_matched: it came back).
  std::vector<uint8_t> TakeHost(int64_t size, const std::string& tag = "", bool* tag_matched = nullptr);
  // `staging`'s tagged buffers (StagedBuffer::pool_tag) come back to the pool when its last
  // reference drops: until then TakeBase finds `staging` itself by those tags.
  void Lend(const std::shared_ptr<Bytes>& staging) const;
  // Incoming staging of `size` bytes for a rollout whose base is in the buffer tagged `tag`:
  // that buffer when it is back in the pool (`matched`: decode in place), else a recycled or new
  // one, and `held`: the staging that still holds the tagged buffer (an Apply reporting to the
  // coordinator, a running version's base), which is then the base, out of place. Waits (at most
  // until `deadline`) only for a holder between its last reference and giving the buffer back.
  struct Base {
    std::vector<uint8_t> host;
    bool matched = false;
    std::shared_ptr<Bytes> held;
  };
  Base TakeBase(int64_t size, const std::string& tag, absl::Time deadline);
  // The pool's counters (tests, diagnostics).
  StagingPool::Stats pool_stats() const { return pool_->stats(); }
  // The pool tag of a sync rollout's committed staging buffer: buffer `buffer` of `worker` of
  // `model` holds `version` (StagedBuffer::pool_tag).
  static std::string BaseTag(const std::string& model, const std::string& worker, size_t buffer, uint64_t version);
  // An idle host staging buffer of `size` bytes in the pool ahead of the first version that needs
  // it (StagingPool::Prewarm), within what the node's staging budget leaves.
  void PrewarmStaging(int64_t size);
  // GPU staging of `size` bytes on `device`, or nullptr (host staging) when off / over budget.
  absl::StatusOr<std::shared_ptr<transport::DeviceMemory>> TryDeviceStaging(int device, int64_t size, const std::string& label);
  // Copies a worker's live buffers (host or CUDA) into `out` (one entry per buffer). With
  // `on_gpu`, a CUDA buffer is copied device to device into GPU staging when the budget allows
  // (else, and for host buffers, into host memory).
  absl::Status ReadLive(const std::vector<std::shared_ptr<transport::ShmSegment>>& buffers,
                        const std::vector<std::shared_ptr<CudaImport>>& cuda, Bytes& out, const std::string& label, absl::Time deadline,
                        bool on_gpu = false);
  // Once per heartbeat period: idle pooled memory older than the pool's timeout goes back.
  void Tick();

  StagingBudget& budget() { return *budget_; }
  bool gpu_staging() const { return options_.device_staging != nullptr && options_.device_staging->enabled(); }

 private:
  Options options_;
  std::shared_ptr<StagingPool> pool_;  // buffers come back from NewBytes' deleter (weak reference)
  std::shared_ptr<StagingBudget> budget_;
};

}  // namespace wb::daemon::node
