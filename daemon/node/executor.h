#pragma once
// Runs a node's ExecPlan (daemon/node/exec_plan.h) for one version over transport::Transport:
//  1. registers the version's memory with the transports that must reach it (same-node host,
//     cuda_ipc, the host channel, each nccl lane); a CUDA source of cross-node ops gets a host copy
//     first (the host channel reaches host memory only); an nccl region not already GPU staging on
//     its lane's GPU is copied there first (a bounce);
//  2. exports the descriptors the peers import (ChannelSetup::Publish), then sets up the plan's
//     channels through ChannelSetup on up to kMaxChannelSetups threads, each starting only after
//     every smaller channel of the plan started (the global order: no connect waits in a cycle);
//  3. posts the buckets' batches per the plan's rules (pipelined; a batch that reads written regions
//     after every earlier batch completed; buckets with nccl routes after a barrier, each GPU
//     running its lane pairs in the global order) and waits for every posted batch, with the
//     version's deadline; `aborted` is checked before each bucket;
//  4. lossless deltas (ExecOptions::deltas): per bucket a lengths batch per peer before its
//     routes, streams in place of full copies, decodes as routes land, and after the buckets the
//     refusals and one full resend of refused ops (daemon/node/delta_exchange.h).
// Every region it registered or imported is released before Run returns, on every path, and only
// after every batch it posted was waited for (transports touch the memory until then).

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/node/delta_exchange.h"
#include "daemon/node/exec_plan.h"
#include "transport/device_allocator.h"
#include "transport/transport.h"

namespace wb::daemon::node {

// Channels set up at once (NCCL's init takes a while per lane pair).
inline constexpr size_t kMaxChannelSetups = 16;

// The memory backing one region key of the version on this node.
struct RegionMemory {
  transport::MemoryKind kind = transport::MemoryKind::kHost;
  uint8_t* base = nullptr;  // host address, or device pointer of GPU staging
  int64_t size = 0;
  int device = -1;
  // Non-zero: a worker's CUDA buffer, already a region of the cuda_ipc transport (owned by the
  // worker's import, not by this version); `base` is unused then.
  transport::RegionHandle cuda_import;
};

struct ExecTransports {
  transport::Transport* local = nullptr;  // same-node, host memory (host_shm)
  transport::Transport* cross = nullptr;  // the host channel to other nodes (host_tcp)
  transport::Transport* cuda = nullptr;   // same-node, CUDA memory (cuda_ipc)
  std::map<int, transport::Transport*> lanes;  // nccl lanes by GPU
};

// A channel as set up: the connection this version uses and the peer's region descriptors.
struct ChannelLink {
  transport::PeerId id;
  std::map<std::string, std::string> regions;  // region key -> descriptor
};

// How the executor meets its peers (the node daemon: ExchangeRegions + its channel cache; tests:
// a fake that pairs two executors in one process).
class ChannelSetup {
 public:
  virtual ~ChannelSetup() = default;
  // Our region descriptors, per transport name (a kind or "nccl/<device>"), are ready: from now on
  // a peer may receive them. Called once, before any Setup.
  virtual void Publish(std::map<std::string, std::map<std::string, std::string>> descriptors) = 0;
  // Exchanges regions with the channel's peer and connects (or keeps a healthy cached channel),
  // before `deadline`. Called from up to kMaxChannelSetups threads at once, in the plan's order.
  virtual absl::StatusOr<ChannelLink> Setup(const ChannelPlan& channel, transport::Transport* t, absl::Time deadline) = 0;
};

struct LinkStat {
  uint64_t bytes = 0;
  double seconds = 0;  // the peer's first post -> its last completed batch
};

struct ExecOptions {
  std::string label;  // "<model> v<version>", for messages
  uint64_t version = 0;
  absl::Time deadline;
  // Checked before each bucket: a non-OK answer stops the version with it.
  std::function<absl::Status()> aborted;
  // TEST ONLY: before each bucket is posted.
  std::function<void(uint32_t bucket)> before_bucket;
  // Called on the executor thread before it posts bucket `bucket`'s batches; blocks until every
  // outgoing op of that bucket has its bytes ready (sender quantisation, delta encoding), or fails
  // the version with its status. Null: nothing to wait for.
  std::function<absl::Status(uint32_t bucket)> before_post;
  // GPU staging of `size` bytes on `device` for an nccl bounce; null when over budget.
  std::function<absl::StatusOr<std::shared_ptr<transport::DeviceMemory>>(int device, int64_t size, const std::string& what)> device_staging;
  // Observers (optional): a batch completed OK (route, its transport's kind); an nccl bounce of
  // `bytes`; after each round of waits (the node meters NIC paths there).
  std::function<void(const Route& route, const std::string& kind)> on_batch_done;
  // An op's bytes are final in this node's memory: each route op landing here, once (a
  // sender-quantised op's two copies are two route ops with one op index, each reported when its
  // own bytes are final) - as its batch completes, or, for a delta stream
  // decoded here, as its decode succeeds (a refused one when its full resend completes). Ops left
  // to the commit are not reported. Any thread, possibly under the executor's lock: must not block
  // (receiver-side quantisation starts a piece once every op into it landed).
  std::function<void(const RouteOp& op)> on_op_landed;
  std::function<void(uint64_t bytes)> on_bounce;
  std::function<void()> after_wait;
  // Called on the executor thread with each route's batch (handles filled, delta streams in
  // place) right before it is posted: end-to-end digests ask the host channel to hash what it
  // moves there (transport::Batch::unit_hashes). Null: nothing.
  std::function<void(const Route& route, transport::Batch& batch)> prepare_batch;
  // Batches on a cross-node channel (host channel routes, delta protocol batches, nccl lanes):
  // `channel_post(channel)` right before each is posted - a non-OK answer fails it unposted (the
  // version was aborted) - and `channel_waited(channel)` once it was waited for or its post failed.
  // The node counts its batches in flight per channel with them: an aborted execution's channel
  // that another execution shares is torn down only while the aborted one has batches on it
  // (Versions::AbortVersion). Any thread, never under the executor's lock. Null: not counted.
  std::function<absl::Status(const std::string& channel)> channel_post;
  // Batch::group of every batch on a cross-node channel (0: none): the node cancels an aborted
  // execution's batches on a channel another execution shares with Transport::CancelBatches.
  uint64_t batch_group = 0;
  std::function<void(const std::string& channel)> channel_waited;
  // Bytes landed on this node so far (progress, read by another thread); may be null.
  std::atomic<uint64_t>* bytes_done = nullptr;
  // Lossless deltas (issue 17.2; daemon/node/delta_exchange.h): ops with RouteOp::delta whose
  // destination has a base version travel as delta streams on the host channel (default: none).
  DeltaOptions deltas;
};

struct ExecResult {
  std::map<std::string, LinkStat> links;  // per peer node (own id: same-node copies)
  std::map<std::string, transport::PeerId> channels;  // channel name -> connection used
  double setup_s = 0, buckets_s = 0;  // registering + channels; the buckets
  DeltaStats delta;                   // what travelled as deltas, what was refused and resent
};

// Runs `plan` with `memory` (every local region key the plan names). `result` is filled as far as
// the run got (channels also on failure: the caller drops them).
absl::Status RunExecPlan(const ExecPlan& plan, const std::map<std::string, RegionMemory>& memory, const ExecTransports& transports,
                         ChannelSetup& setup, const ExecOptions& options, ExecResult& result);

}  // namespace wb::daemon::node
