#pragma once
// Host staging buffers reused across versions.
//
// Every version used to allocate its host staging (rollout incoming copies, trainer snapshots, the
// rank-0 gather) afresh and free it after the commit. For a model-sized buffer that is the single
// largest cost of a version on a small machine: the kernel faults in and zeroes every page again
// (bench/e2e, Qwen2.5-0.5B: ~2 GB per version on the rollout node, about half of the node
// daemons' CPU time; docs/operations.md "bench:e2e"). Layouts rarely change, so the next version
// asks for exactly the sizes the previous one gave back: the pool hands those buffers out again.
//
// A recycled buffer holds whatever its last user left in it. That is safe for staging because
// nothing reads staging bytes that this version did not write: transfers write every byte of every
// rollout piece (plans are complete), commit / Apply copy pieces only (never the gaps between them),
// snapshots copy whole buffers, and gather ops write what later ops read.
//
// Bounded: at most `max_idle_bytes` are kept idle (a buffer given back beyond that is freed at once),
// and a buffer nobody took for `max_idle_time` is freed by Trim (the node daemon calls it from its
// control loop), so a daemon whose model went away or changed its layout returns the memory.
// Thread-safe.

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"

namespace wb::daemon {

class StagingPool {
 public:
  struct Options {
    int64_t max_idle_bytes = int64_t{64} << 30;
    absl::Duration max_idle_time = absl::Minutes(5);
    Clock* clock = Clock::Real();
  };
  struct Stats {
    uint64_t reused = 0;     // Take answered with a recycled buffer
    uint64_t allocated = 0;  // Take had to allocate
    // Diagnostics of delta bases (docs/soak.md "NVFP4 deltas"): tagged buffers handed to a Take
    // that asked for another tag or none (their base is gone), and tagged buffers freed idle.
    uint64_t tagged_given_away = 0;
    uint64_t tagged_freed = 0;
    int64_t idle_bytes = 0;  // held for reuse right now
    size_t idle_buffers = 0;
  };

  explicit StagingPool(Options options) : options_(options) {}
  ~StagingPool();

  // A host buffer of exactly `size` bytes: an idle one of that size when there is one (its bytes
  // are stale: see above; *reused = true), else a new, zero-filled one. With `tag`, the idle buffer
  // given back with that tag is taken first (*tag_matched = true: its bytes are what its last user
  // said they were when it gave it back); untagged ones before another tag's.
  std::vector<uint8_t> Take(int64_t size, bool* reused = nullptr, const std::string& tag = "", bool* tag_matched = nullptr);
  // Gives a buffer back for reuse. Empty buffers are ignored; a buffer that would push the idle
  // bytes past max_idle_bytes is freed here instead (oldest idle buffers go first to make room when
  // this one alone fits). `tag` (optional) names what the bytes hold, for a Take that wants exactly
  // those bytes again (a sync rollout's committed staging: the next version decodes its deltas in
  // place, docs/daemon.md "Deltas"); a tag is only a hint of who wants the buffer back, never a
  // promise: the taker checks the bytes (a delta's base digest).
  void Give(std::vector<uint8_t> buffer, std::string tag = "");
  // What TakeTagged found for a tag.
  struct Tagged {
    std::vector<uint8_t> buffer;         // the buffer given back with the tag (empty: not idle here)
    std::shared_ptr<void> holder;        // else, who Lend named as still holding it, when alive
  };
  // Only the idle buffer given back with `tag` (never another), else the holder Lend named for the
  // tag while that holder is alive. A holder that has just let go (its last reference dropped,
  // its buffers not given back yet: the deleter is between the two) is waited for, until
  // `deadline` (at most a second) on the pool's clock: the buffer comes back within microseconds. Why: a rollout's
  // committed staging goes back to the pool when its last reference drops, which races the next
  // version's choice of staging (an Apply that still holds it while it reports to the
  // coordinator); a miss there made the next version's deltas into receiver-quantised shadows
  // refused and resent in full (docs/soak.md "NVFP4 deltas").
  Tagged TakeTagged(int64_t size, const std::string& tag, absl::Time deadline);
  // `holder` holds the buffer that will be given back with `tag` (Give), until its last reference
  // drops. Replaces an earlier holder of the same tag.
  void Lend(const std::string& tag, std::weak_ptr<void> holder);
  // Allocates (and so faults in) an idle buffer of `size` bytes ahead of the version that will
  // Take it, unless an untagged one of that size is idle already (a tagged one is kept for its
  // tag's next version) or idle bytes would exceed `room`. The node
  // calls it when a rollout registers host buffers, so a node's first version (or a late
  // rollout's catch-up) does not fault in its staging on the critical path. The buffer is
  // written once from user code and once from the kernel (read of /dev/zero): a VM shadowing page
  // tables per CPU mode traps the first access per page from each (staging_pool.cc). True if
  // allocated.
  bool Prewarm(int64_t size, int64_t room);
  // Frees buffers idle for longer than max_idle_time.
  void Trim();
  // Frees every idle buffer.
  void Clear();
  // Frees the oldest idle buffers until at most `max_idle_bytes` stay idle (the node keeps in-use
  // plus idle staging within its budget).
  void TrimTo(int64_t max_idle_bytes);
  Stats stats() const;

 private:
  struct Idle {
    std::vector<uint8_t> buffer;
    absl::Time since;
    std::string tag;
  };
  const Options options_;
  mutable absl::Mutex mu_;
  std::list<Idle> idle_ ABSL_GUARDED_BY(mu_);  // oldest first
  int64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tagged_given_away_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tagged_freed_ ABSL_GUARDED_BY(mu_) = 0;
  // Lend: tag -> who holds the buffer that comes back with that tag (erased when it comes back).
  std::map<std::string, std::weak_ptr<void>> lent_ ABSL_GUARDED_BY(mu_);
  // Frees `freed` (outside the lock), counting the tagged ones.
  void CountFreed(const std::list<Idle>& freed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace wb::daemon
