#pragma once
// The node's side of lossless deltas (issue 17.2; docs/daemon.md "Deltas (design and status)"):
// per model the sender's DeltaCache (copies of what destinations committed, --delta_cache_bytes
// per model) and the reusable delta-region buffers; per version the executor's DeltaOptions
// (which ops have a base, the receiver's committed copies as bases). node::Versions owns one and
// calls Commit / Drop from CommitVersion / AbortVersion / a failed executor. Thread-safe (one
// leaf lock; LocalWorkers' own lock is taken inside a base lookup, never the other way round).

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "daemon/node/delta_cache.h"
#include "daemon/node/delta_exchange.h"
#include "daemon/node/local_workers.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon::node {

// Encode / decode threads per version for --delta_threads `requested` on a machine with `cpus`
// hardware threads: `requested` when > 0; 0 = auto: half the CPUs (the transports, the digests and
// the other side's work want the rest), at least 2, at most 16. A delta version's time is the
// codec's CPU time (about 0.3-0.45 s per GB per thread on a 2-core VM, docs/daemon.md "Deltas"),
// so a fixed 2 threads would leave a 64-core host's deltas slower than its full versions.
int ResolveDeltaThreads(int requested, unsigned cpus);

class NodeDeltas {
 public:
  // `cache_bytes`: --delta_cache_bytes (per model; 0 = this node sends no deltas; it still
  // decodes the deltas others send it).
  // `apply_delay` (--delta_apply_delay_ms): how long after a commit the background applier waits
  // before it applies the committed streams to the cached copies (see Commit), on `clock`.
  NodeDeltas(uint64_t cache_bytes, int threads, Clock* clock = Clock::Real(), absl::Duration apply_delay = absl::ZeroDuration())
      : cache_bytes_(cache_bytes), threads_(threads), clock_(clock), apply_delay_(apply_delay) {}

  uint64_t cache_bytes() const { return cache_bytes_; }

  // The executor's delta options for `version` of `model` on node `me`: base versions by slice
  // worker (from ExecuteVersionRequest.base_versions, by worker id), the model's cache and
  // buffers, and the receiver's bases: a local rollout's committed staging (host) when it holds
  // one - also when Apply copied it into live weights and let it go after the version started
  // (the options keep the staging the rollout held then: live weights lack the canonical shadows
  // of receiver-quantised pieces) -, else its live host buffers when they hold an applied version
  // whole (not being copied, not TORN). Layouts are those of its staging (the slicer sends deltas only to unquantised
  // rollouts, whose staging and live layouts are the same). The digests of boxes it decodes are
  // recorded per model for the next version's base check (DeltaOptions::recorded).
  // `staging_holds` (Exec::staging_holds) names incoming staging buffers (of `incoming`) that
  // still hold a committed version: those are the base first, and the decode runs in place.
  // `bases_without_shadows` (ExecuteVersionRequest.bases_without_shadows, by worker id): rollouts
  // whose base holds no canonical shadows (DeltaOptions::without_shadows).
  // `bases_held` (Exec::bases_held, by worker id): staging the version's choice of staging found
  // holding a rollout's committed version - its committed staging then, or its applied staging
  // not yet back in the pool -, a base as the committed staging held at the start is.
  DeltaOptions For(const std::string& me, const std::string& model, const pb::PlanSlice& slice,
                   const std::map<std::string, uint64_t>& base_versions, const LocalWorkers& local,
                   const std::map<std::pair<std::string, size_t>, uint64_t>& staging_holds = {},
                   const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming = {},
                   const std::set<std::string>& bases_without_shadows = {},
                   const std::map<std::string, std::pair<uint64_t, std::shared_ptr<StagedBytes>>>& bases_held = {});

  // CommitVersion(version) of `model` here: its pending copies become the committed ones.
  void Commit(const std::string& model, uint64_t version);
  // AbortVersion(version) or a failed executor: its pending copies go.
  void Drop(const std::string& model, uint64_t version);
  // Host memory of every model's cache (the wb_delta_cache_bytes gauge).
  uint64_t bytes() const;

 private:
  struct Model {
    // Stops and joins a background ApplyQueued / WarmSpares first (they read `cache`).
    ~Model();
    Clock* clock = nullptr;
    std::unique_ptr<DeltaCache> cache;
    DeltaBuffers buffers;
    // After a commit, one background thread at a time applies the committed streams to the cached
    // copies (DeltaCache::ApplyQueued) and faults in the cache's spare buffers (WarmSpares), so the
    // next version's packs do not pay the first touch.
    std::atomic<bool> warming{false};
    absl::Mutex warm_mu;
    std::thread warmer ABSL_GUARDED_BY(warm_mu);
    // Ends the applier's wait after a commit (NodeDeltas' apply_delay) when the model goes.
    absl::Mutex delay_mu;
    bool stopping ABSL_GUARDED_BY(delay_mu) = false;
    // Receiver: per destination box (rollout worker id, buffer, offset, tensor, box, element size,
    // variant) the version and digest it decoded last (DeltaOptions::recorded / record).
    absl::Mutex digests_mu;
    std::map<std::string, std::pair<uint64_t, delta::Digest>> digests ABSL_GUARDED_BY(digests_mu);
  };
  std::shared_ptr<Model> ModelFor(const std::string& model);

  const uint64_t cache_bytes_;
  const int threads_;
  Clock* const clock_;
  const absl::Duration apply_delay_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Model>> models_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon::node
