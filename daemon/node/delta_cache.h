#pragma once
// The sending node's copy of what its destinations committed, for lossless deltas (issue 17.2;
// docs/daemon.md "Deltas (design and status)"). Per model, keyed by (tensor, canonical box,
// element size): the packed bytes of that box (row-major over the box) of one version.
//
// Life of an entry: the executor packs the box it sends in version V and files it as PENDING for
// V (AddPending) - or, for a box it encoded straight from the source against the committed entry,
// files the stream it sent (AddPendingStream: the cache then holds 1x the bytes); when the node's
// CommitVersion(V) arrives, V's pending entries become the COMMITTED ones (replacing older
// versions of the same key; a stream is queued on the entry it was made against and applied to it
// in place by ApplyQueued or the next Committed()) and pending entries of older versions are
// dropped (superseded: they never became anyone's base); AbortVersion(V) drops V's pending
// entries. So a committed entry always holds bytes some destination committed, and a delta
// against it names that version (the receiver checks version and digest before applying).
//
// Buffers of entries that go (replaced, superseded, dropped, evicted) are kept for reuse by
// Buffer() while their bytes stay within another `capacity_bytes` (fresh memory costs a first
// touch per page, seconds per GB on some VMs; box sizes repeat from version to version).
//
// Bounded by `capacity_bytes` (the node's --delta_cache_bytes) over committed + pending bytes:
// adding beyond it first evicts the key's own committed entry (read for this version already),
// then committed entries least recently used (looked up or committed), then refuses the add (that
// box goes full next version). Steady state needs 1x the bytes the node sends as deltas per
// version for single-destination boxes, 2x when one box goes to destinations one after another. Entries are shared_ptrs: an eviction
// never frees bytes an encoder still reads. Thread-safe (one leaf mutex).

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/default_init_allocator.h"
#include "daemon/delta/codec.h"
#include "planner/types.h"

namespace wb::daemon::node {

struct DeltaKey {
  int32_t tensor = 0;
  std::vector<int64_t> begin, end;  // the canonical box
  int elem_size = 0;
  // 0: the canonical bytes; else which bytes of a sender-quantised box (RouteOp::delta_variant:
  // elements or scales, and the destination's format), so quantised and raw copies never mix.
  uint64_t variant = 0;
  static DeltaKey Of(int32_t tensor, const planner::Box& box, int elem_size, uint64_t variant = 0) {
    return {tensor, box.begin, box.end, elem_size, variant};
  }
  friend bool operator<(const DeltaKey& a, const DeltaKey& b) {
    return std::tie(a.tensor, a.begin, a.end, a.elem_size, a.variant) < std::tie(b.tensor, b.begin, b.end, b.elem_size, b.variant);
  }
  friend bool operator==(const DeltaKey& a, const DeltaKey& b) { return !(a < b) && !(b < a); }
  std::string ToString() const;
};

// One version of a key: its packed bytes, or (a pending entry only) the delta stream that makes
// them from the committed entry of `stream_base` (the cache at 1x: see AddPendingStream).
struct DeltaEntry {
  uint64_t version = 0;
  UninitVector<uint8_t> bytes;
  // delta::DigestOf(bytes, element size), computed while they were packed (the next encode's base digest: the
  // encoder then does not hash the base again). For a stream entry: the stream's target digest.
  std::optional<delta::Digest> digest;
  std::vector<uint8_t> stream;  // non-empty: a stream entry (bytes empty)
  uint64_t stream_base = 0;     // the version the stream was made against
  // The next version of this key packs a full copy again (a strided box): WarmSpares keeps a spare
  // buffer for it. Boxes encoded straight from the source need none once they travel as streams.
  bool packs = true;
};

class DeltaCache {
 public:
  explicit DeltaCache(uint64_t capacity_bytes);

  uint64_t capacity() const { return capacity_; }
  bool enabled() const { return capacity_ > 0; }

  // The committed entry of `key` when it holds `version`; null otherwise (none, evicted, another
  // version). Applies queued streams first on the caller's thread when ApplyQueued has not yet;
  // waits (at most kApplyWait, then null) while another thread applies them. Marks it recently
  // used.
  std::shared_ptr<const DeltaEntry> Committed(const DeltaKey& key, uint64_t version);
  static constexpr absl::Duration kApplyWait = absl::Seconds(10);

  // `size` bytes to pack a box into (contents unspecified): a recycled buffer of that size when
  // one is free, else a new one.
  UninitVector<uint8_t> Buffer(size_t size);

  // A buffer to file a stream of `size` bytes in (AddPendingStream): empty, with capacity >= size -
  // one an applied or dropped stream left when there is one of about that size (its pages are
  // faulted in already: a fresh one per box and version cost the sender a first touch of every
  // stream byte on the critical path), else a new one.
  std::vector<uint8_t> StreamBuffer(size_t size);

  // Files `bytes` as `key`'s pending entry of `version` (replacing one already there). False when
  // it does not fit in the capacity even after evicting every committed entry. `packs`: see
  // DeltaEntry::packs.
  bool AddPending(const DeltaKey& key, uint64_t version, UninitVector<uint8_t> bytes,
                  std::optional<delta::Digest> digest = std::nullopt, bool packs = true);

  // The cache at 1x (docs/daemon.md "Deltas", Open (5)): files the delta stream that was sent for
  // `key` in `version`, made against the committed entry of `base_version` (whose target digest is
  // `target_digest`), as the pending entry instead of a full copy of the box. At Commit(version)
  // the stream is queued on that committed entry and applied to its bytes in place
  // (delta::DecodeInPlace) - by ApplyQueued in the background, or by the next Committed() of the
  // key, whichever comes first - so the sender keeps one copy of each box and writes only the
  // changed elements, off the version's critical path. Never evicts the key's own committed entry
  // (the stream's base); false when the stream does not fit.
  bool AddPendingStream(const DeltaKey& key, uint64_t version, uint64_t base_version, std::vector<uint8_t> stream,
                        const delta::Digest& target_digest);

  // CommitVersion(version): its pending entries become the committed ones (stream entries are
  // queued on the committed entry they were made against; one made against another version - two
  // versions in flight against one base - evicts the key: that box goes full once); older pending
  // ones go.
  void Commit(uint64_t version);
  // Applies every queued stream (see AddPendingStream); returns how many. Slow (a pass over each
  // entry's bytes): the node runs it on a background thread after CommitVersion. StopWarming()
  // makes it return early (the rest is applied by Committed()).
  int ApplyQueued();
  // AbortVersion(version): its pending entries go.
  void Drop(uint64_t version);
  // Everything goes (the model was removed).
  void Clear();

  // Makes sure the pool holds a spare buffer, its pages faulted in, for every committed entry, so
  // that the next version's packs (Buffer) find warm memory: without it the first version after
  // the first commit pays the first touch of a whole second copy (seconds per GB on some VMs) on
  // its critical path. Allocates and touches outside every lock; spares stay within the pool's
  // limit. Returns the bytes it added. Slow (first touch): the node runs it on a background thread
  // after CommitVersion; StopWarming() makes a running call return early.
  uint64_t WarmSpares();
  void StopWarming() { stop_warming_.store(true); }

  struct Stats {
    uint64_t committed_bytes = 0, pending_bytes = 0;  // committed includes queued streams
    uint64_t committed_entries = 0, pending_entries = 0;
    uint64_t evictions = 0, refused_adds = 0;
    uint64_t free_bytes = 0;  // kept for reuse
    uint64_t queued_streams = 0, applied_streams = 0, failed_applies = 0, copied_applies = 0;
  };
  Stats stats() const;
  uint64_t bytes() const;  // committed + pending

 private:
  struct Slot {
    std::shared_ptr<const DeltaEntry> entry;
    std::list<DeltaKey>::iterator lru;  // position in lru_ (front = most recent)
    // Committed stream entries not yet applied to `entry`, oldest first: the key's committed
    // version is the last one's.
    std::vector<std::shared_ptr<const DeltaEntry>> queued;
    bool applying = false;  // a thread applies `queued` outside the lock (entry is not handed out)
    uint64_t generation = 0;
    uint64_t size = 0;  // entry->bytes.size() (an in-place apply moves them out meanwhile)
  };
  void EvictLocked(const DeltaKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AddPending / AddPendingStream: files `entry` as `key`'s pending entry of `version` within the
  // capacity, evicting the key's own committed entry first only when `may_evict_own`.
  bool FilePendingLocked(const DeltaKey& key, uint64_t version, std::shared_ptr<const DeltaEntry> entry, bool may_evict_own)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static uint64_t SlotBytes(const Slot& slot);
  // Applies `key`'s queued streams (the caller saw some and no other thread applying); returns the
  // resulting entry, or null when the key was evicted meanwhile or an apply failed. Takes mu_.
  std::shared_ptr<const DeltaEntry> ApplySlot(const DeltaKey& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Free buffers by size; shared with the entries' deleters (an entry may die after the cache).
  struct Pool {
    absl::Mutex mu;
    std::multimap<size_t, UninitVector<uint8_t>> free ABSL_GUARDED_BY(mu);
    std::multimap<size_t, std::vector<uint8_t>> free_streams ABSL_GUARDED_BY(mu);  // by capacity
    uint64_t bytes ABSL_GUARDED_BY(mu) = 0;
    uint64_t limit = 0;
  };
  std::shared_ptr<const DeltaEntry> NewEntry(DeltaEntry e) const;
  const std::shared_ptr<Pool> pool_;

  const uint64_t capacity_;
  std::atomic<bool> stop_warming_{false};
  mutable absl::Mutex mu_;
  std::map<DeltaKey, Slot> committed_ ABSL_GUARDED_BY(mu_);
  std::list<DeltaKey> lru_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::map<DeltaKey, std::shared_ptr<const DeltaEntry>>> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t committed_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_applies_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t copied_applies_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace wb::daemon::node
