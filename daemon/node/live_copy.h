#pragma once
// Copies into a worker's live memory (staging -> live at a sync commit or an Apply), and the
// bookkeeping that says whether a worker's live weights are whole.
//
// Contract (docs/daemon.md "Live weights: whole or TORN"):
//  - Apply / CommitVersion never report a version that is not whole in live memory.
//  - A live copy, once started, runs to its own bounded timeout (NodeDaemon::Options::
//    live_copy_timeout), never to the client's deadline: the client's deadline bounds the wait for
//    the version, not a copy that has started writing live weights (cancelling it would leave the
//    weights part new, part old).
//  - A live copy that fails after it started writing (transport error, the worker's memory gone)
//    leaves the worker TORN: LiveState records which version was being written over which one and
//    why; the node reports it in Status, Apply and WaitVersion until a later copy into that worker
//    succeeds (a whole version again).
//  - One live copy per worker at a time (LiveState::Begin refuses a second one): two copies of
//    different versions interleaving would tear the weights even when both succeed.
//  - With markers attached (daemon/node/live_markers.h), a copy is recorded on disk before its
//    first byte (LiveState::Mark) and the record follows the state (removed when whole, rewritten
//    when torn), so a daemon killed mid-copy finds it after its restart: when the same worker
//    registers the same memory again (LiveState::Adopt) it is TORN until a copy succeeds.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/node/live_markers.h"
#include "planner/types.h"
#include "transport/device_allocator.h"
#include "base/shm_segment.h"
#include "transport/transport.h"

namespace wb::daemon {

// One buffer of staging (snapshot, incoming, committed, gather): host bytes, or device memory the
// daemon allocated on the GPU of the worker's buffer (GPU-direct staging).
struct StagedBuffer {
  std::vector<uint8_t> host;                         // when device == nullptr
  std::shared_ptr<transport::DeviceMemory> device;  // non-null: the bytes live on this GPU (host empty)
  // Given back to the staging pool with this tag (StagingPool::Give): set by a sync commit once the
  // bytes are a rollout's committed version (NodeStaging::BaseTag), so that the next version takes
  // this buffer back and decodes its deltas in place. Written only by the commit, read only when
  // the last reference drops.
  std::string pool_tag;
  int64_t size() const { return device ? device->size() : static_cast<int64_t>(host.size()); }
};
using StagedBytes = std::vector<StagedBuffer>;  // one entry per buffer, layout order

// A worker's CUDA buffer: its IPC handle imported into the cuda_ipc transport (released with the
// last reference).
struct CudaImport {
  transport::Transport* t = nullptr;
  transport::RegionHandle h;
  int64_t size = 0;
  int device = 0;  // the daemon's ordinal of the buffer's GPU
  // CUDA VMM buffers: the fd channel's cache keys of the allocations it was imported from, in the
  // buffer's order (CudaVmmFd::cache_key); empty for CUDA IPC buffers. A RegisterLayout naming the
  // same keys is a replay only while these are still the keys' allocations (LocalWorkers::SameLayout).
  std::vector<std::string> allocation_keys;
  ~CudaImport();
};

// Sync commit: a same-node relay left to the commit, copied from another rollout's incoming
// staging straight into the destination rollout's live host buffer.
struct RelayAtCommit {
  std::string src_worker;  // local rollout whose incoming staging holds the bytes
  int32_t src_buffer = 0;
  int32_t dst_buffer = 0;  // in the destination's live buffers
  transport::CopyOp op;    // regions unset: src offsets/strides in the source staging buffer, dst in the live buffer
};

// A worker's live memory: host shm segments or CUDA imports, one entry per buffer (layout order;
// exactly one of the two is non-null per buffer).
struct LiveBuffers {
  std::vector<std::shared_ptr<transport::ShmSegment>> host;
  std::vector<std::shared_ptr<CudaImport>> cuda;
};

// The transport view of `box` inside `piece` (offset of the box's first element, the piece's strides).
transport::StridedRef RefFor(const planner::Piece& piece, const planner::Box& box, int elem, transport::RegionHandle region);

// FAILED_PRECONDITION "<label>: live buffer b: ..." for the first segment that shrank or faulted
// (transport::ShmSegment::CheckIntact); null entries (CUDA buffers) are skipped.
absl::Status CheckLive(const std::vector<std::shared_ptr<transport::ShmSegment>>& segments, const std::string& label);

class LiveCopier {
 public:
  // TEST ONLY: called before each live copy with its label; a non-OK answer makes the copy fail
  // midway (only the first half of its ops is copied, then the answer is returned). After an OK
  // answer the copy runs in two halves and the hook is called again between them with
  // "<label> midway" (live memory part new, part old: a test may stall or kill the daemon there;
  // a non-OK answer fails the copy there).
  using FaultHook = std::function<absl::Status(const std::string& label)>;

  // `host` is the same-node transport that reaches host memory (host_shm); must outlive this.
  LiveCopier(std::string node_id, transport::Transport* host, FaultHook fault = nullptr)
      : node_id_(std::move(node_id)), host_(host), fault_(std::move(fault)) {}

  // Copies a rollout's staging (same layout as its live memory) into its live buffers, piece by
  // piece (and the scales of quantised pieces). *wrote = true once any byte may have been written
  // into live memory (a batch was posted): an error with *wrote == false left live memory as it was.
  absl::Status CopyToLive(const StagedBytes& staging, const LiveBuffers& live, const planner::WorkerLayout& layout,
                          const planner::Inventory& inventory, const std::string& label, absl::Time deadline, bool* wrote) const;
  // Sync commit: the relays left to the commit, from other rollouts' incoming staging into this
  // rollout's live host buffers.
  absl::Status CopyRelaysToLive(const std::vector<RelayAtCommit>& relays,
                                const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming,
                                const std::vector<std::shared_ptr<transport::ShmSegment>>& live, const std::string& label,
                                absl::Time deadline, bool* wrote) const;
  // The same relays into the rollout's own incoming host staging instead (`staging`: the
  // destination's buffers, layout order; its live layout is its staging layout, relays never go
  // into quantised rollouts): a sync rollout that resumed (EndUpdate) before its commit's copy
  // started gets them there, so that staging holds the whole version and becomes its committed
  // copy, and its live memory is not written while its engine reads it.
  absl::Status CopyRelaysToStaging(const std::vector<RelayAtCommit>& relays,
                                   const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming, StagedBytes& staging,
                                   const std::string& label, absl::Time deadline) const;
  // Whole buffers (src[i] -> dst[i], size[i] bytes) on the host transport.
  absl::Status CopyFlat(const std::vector<const uint8_t*>& src, const std::vector<uint8_t*>& dst, const std::vector<int64_t>& size,
                        const std::string& label, absl::Time deadline) const;

 private:
  // Posts every batch (all of its ops, or the first half when the fault hook says so), waits for
  // each, and returns the first error.
  absl::Status Run(std::map<transport::Transport*, transport::Batch>& batches, const std::string& label, absl::Time deadline,
                   bool* wrote) const;
  // CopyRelaysToLive / CopyRelaysToStaging: `dst` = (base, size) per destination buffer (null base:
  // not host memory, named `dst_what` in the error).
  absl::Status CopyRelays(const std::vector<RelayAtCommit>& relays, const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming,
                          const std::vector<std::pair<uint8_t*, int64_t>>& dst, const std::string& dst_what, const std::string& label,
                          absl::Time deadline, bool* wrote) const;

  std::string node_id_;
  transport::Transport* host_;
  FaultHook fault_;
};

// Per worker: are its live weights whole, being written, or torn? Not thread-safe: the node daemon
// guards it with its own mutex (so its waits can use it in conditions).
class LiveState {
 public:
  enum class State { kWhole, kCopying, kTorn };
  struct Info {
    State state = State::kWhole;
    uint64_t writing = 0;  // version being (or last) written
    uint64_t over = 0;     // the version live memory held before (0: none yet)
    std::string reason;    // kTorn: why the copy failed
  };

  // A copy of `writing` over `over` starts; false (nothing changes) when one is running already.
  bool Begin(const std::string& worker, uint64_t writing, uint64_t over);
  bool Copying(const std::string& worker) const;
  // The copy ended. OK: whole again. Error with `wrote`: torn (`result` is the reason). Error
  // without `wrote`: back to the state before Begin (live memory was not touched).
  void End(const std::string& worker, const absl::Status& result, bool wrote);
  Info Get(const std::string& worker) const;
  bool Torn(const std::string& worker) const { return Get(worker).state == State::kTorn; }
  // The worker left (its memory with it).
  void Forget(const std::string& worker);

  // Durable markers (null: none kept). Not owned; must outlive this.
  void AttachMarkers(LiveMarkers* markers) { markers_ = markers; }
  // After Begin, before the copy's first byte: records it durably. An error means nothing was
  // recorded and the copy must not start (End it with that error and wrote = false). Workers
  // without host shm buffers (CUDA only) are not recorded.
  absl::Status Mark(const std::string& model, const std::string& worker, const std::vector<std::shared_ptr<transport::ShmSegment>>& live);
  // `worker` of `model` registered `live` memory: when an earlier process of this daemon died
  // copying into exactly that memory (a marker it left), the worker is TORN from now on.
  void Adopt(const std::string& model, const std::string& worker, const std::vector<std::shared_ptr<transport::ShmSegment>>& live,
             const std::string& node);

  // DATA_LOSS naming worker, node, the versions and the reason, or OK when not torn.
  absl::Status TornError(const std::string& worker, const std::string& node) const;
  static const char* Name(State s);

 private:
  std::map<std::string, Info> info_;       // absent = whole
  std::map<std::string, Info> before_;     // state before a running copy (restored when it never wrote)
  LiveMarkers* markers_ = nullptr;
};

}  // namespace wb::daemon
