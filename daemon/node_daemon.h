#pragma once
// Node daemon: wires the node's parts (daemon/node/) and owns them. It serves WorkerService (Unix
// socket, local workers) and NodeService (TCP, from the coordinator and peer nodes) through thin
// gRPC adapters (daemon/node/worker_service.cc, node_service.cc) over:
//  - node::WorkerCalls (daemon/node/worker_calls.h): the WorkerService calls;
//  - node::Versions (daemon/node/versions.h): the NodeService calls and running each version
//    (exec plan -> executor over the transports, staging, channels with peers, digests, commit);
//  - LocalWorkers (worker table, snapshots, committed staging, live copies), node::NodeStaging
//    (host/GPU staging, the node's budget), node::ChannelCache, node::NodeTransports, PeerStubs;
//  - CoordinatorSession (registration, heartbeats, re-join) over CoordinatorClient.
// NodeDaemon itself keeps Options, Start / Shutdown, what RegisterNode sends (Registration), the
// re-join of its workers (Rejoin), the control tick (CheckWorkers, staging pool) and is the
// node::CoordinatorAccess seam the parts reach the coordinator session through.
// docs/architecture.md ("Node daemon") draws the parts, their threads and the lock order; see
// docs/daemon.md for the memory model:
//  - trainer sources: live shm (sync: the trainer waits in Publish) or a per-version snapshot taken
//    at Publish (one-step-off / async);
//  - rollout destinations: bytes always land in an "incoming" staging copy per version; at commit it
//    becomes the "committed" copy; sync commit copies it into live weights at once, otherwise
//    Apply copies it. An aborted version only ever touched staging, so live weights keep the
//    previous version byte for byte.

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "base/clock.h"
#include "daemon/device_staging.h"
#include "daemon/fd_channel.h"
#include "daemon/guard_meter.h"
#include "daemon/metrics.h"
#include "daemon/node/channel_cache.h"
#include "daemon/node/coordinator_access.h"
#include "daemon/node/coordinator_client.h"
#include "daemon/node/coordinator_session.h"
#include "daemon/node/gpu_import.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/live_markers.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/node_staging.h"
#include "daemon/node/node_transports.h"
#include "daemon/node/peer_stubs.h"
#include "daemon/node/publish_record.h"
#include "daemon/node/versions.h"
#include "daemon/node/worker_calls.h"
#include "proto/weightbridge.grpc.pb.h"
#include "transport/factory.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

class NodeDaemon final : private node::CoordinatorAccess {
 public:
  struct Options {
    std::string node_id = "node0";
    std::string coordinator;  // host:port of CoordinatorService
    std::string data_listen = "127.0.0.1:0";
    // Every deadline and wait of the node (versions, worker calls, sessions). Transports and gRPC
    // measure real time: a FakeClock suits tests of the control logic, not moving bytes.
    Clock* clock = Clock::Real();
    absl::Duration heartbeat = absl::Milliseconds(500);
    int64_t staging_budget_bytes = int64_t{64} << 30;
    // Required: a same-node transport reaching host memory, and (for multi-node plans) a
    // cross-node one. main.cc / tests create them with transport/factory.h.
    transport::TransportSet transports;
    bool checksums = true;  // per-batch xxh3 on cross-node batches (transports that support it)
    // End-to-end digests (daemon/digest/, docs/daemon.md "End-to-end digests"): after a version's
    // buckets the node digests what each op it sends read and what each op it receives landed, on
    // up to digest_threads threads, and reports them with ReportDone (the coordinator commits only
    // when every pair matches).
    bool digests = true;
    int digest_threads = 8;
    // Hash while the buckets run (digest::OpDigestTracker: sources at once, each landed box as its
    // batch completes); false: everything after the buckets (bench:e2e --digest_cost compares).
    bool digest_overlap = true;
    // With digest_overlap: host_tcp hashes the boxes it moves as they cross (transport::UnitHashes;
    // digest::OpDigestTracker::PrepareBatch) instead of this node hashing them from memory.
    bool digest_in_transport = true;
    // Lossless deltas (docs/daemon.md "Deltas (design and status)"): host memory per model for the
    // copies of what this node's destinations committed (daemon/node/delta_cache.h); > 0 = this
    // node sends deltas (advertised in RegisterNode). It decodes deltas others send whatever this is.
    uint64_t delta_cache_bytes = 0;
    // Delta encode / decode threads per version (node::ResolveDeltaThreads: 0 = half the CPUs, 2..16).
    int delta_threads = 0;
    // Receiver-side quantising: threads that quantise pieces whose ops all landed while the buckets
    // still run (daemon/node/quantize_incoming.h; 0 = half the CPUs, at least 1; -1 = none).
    int quantize_early_threads = 0;
    // Sync rollouts' deltas decode in place into the staging their last commit copied into live
    // weights (tagged, taken back from the pool); false: decode against the live weights into new
    // staging (docs/daemon.md "Deltas").
    bool delta_in_place = true;
    // After a commit, the sender's background applier waits this long before it applies the sent
    // streams to its cached copies (node::NodeDeltas: not while the other nodes still commit).
    absl::Duration delta_apply_delay = absl::Milliseconds(200);
    // TEST ONLY: after a version's buckets, before its digests: the host memory of each local
    // region, keyed "<worker id>.b<buffer>" (and "g": the gather staging); fault tests flip a bit
    // of a rollout's staging here.
    std::function<void(const std::string& model_id, uint64_t version, const std::map<std::string, std::pair<uint8_t*, int64_t>>& regions)>
        test_after_buckets;
    // GPU-direct staging (docs/daemon.md): where trainer snapshots and rollout incoming copies of
    // CUDA buffers may live on the GPU. Null or a zero budget: host staging only.
    std::shared_ptr<DeviceStaging> device_staging;
    // nccl lanes are the device-bound "nccl" transports of `transports` (TransportSet::ByDevice):
    // one per GPU listed by --nccl_devices (daemon/nccl_route.h).
    // TEST ONLY: called by the executor before it posts each bucket (fault tests stall a node here).
    std::function<void(const std::string& model_id, uint64_t version, uint32_t bucket)> test_before_bucket;
    // TEST ONLY: see node::Versions::Options::test_commit_answer (a CommitVersion answer lost).
    std::function<absl::Status(const std::string& model_id, uint64_t version, bool catch_up)> test_commit_answer;
    // TEST ONLY: when it returns true the heartbeat is skipped (a frozen node: its lease expires).
    std::function<bool()> test_skip_heartbeat;
    // TEST ONLY: false = this node acts as one built before connection rounds (ExchangeRegions
    // neither asks for nor grants them; it connects in the empty round): rolling-upgrade tests.
    bool test_connect_rounds = true;
    // Channel to the coordinator (TLS + token: daemon/auth.h); empty = insecure.
    std::function<std::shared_ptr<grpc::Channel>(const std::string&)> make_channel;
    // CUDA VMM buffers (BufferSpec.cuda_vmm_key): the fd a worker sent on the fd channel
    // (DaemonFront::FindVmmFd; keyed by model too: worker ids are scoped per model). Unset: such
    // buffers are FAILED_PRECONDITION.
    std::function<absl::StatusOr<CudaVmmFd>(const std::string& model, const std::string& worker, const std::string& key)> cuda_vmm_fd;
    // The uid the worker socket bound `worker` of `model` to (DaemonFront::WorkerUid): RegisterLayout
    // checks each shared-memory segment it maps is that uid's (WorkerCalls::Options::worker_uid).
    std::function<absl::StatusOr<uid_t>(const std::string& model, const std::string& worker)> worker_uid;
    // Opens workers' CUDA IPC / VMM buffers (daemon/node/gpu_import.h). Null: NewGpuImport(), the
    // build's own (CUDA IPC when built with CUDA, else refusing them).
    std::shared_ptr<GpuImport> gpu_import;
    // A copy into a worker's live memory (sync commit, Apply), once started, runs until it is done or
    // this long has passed - never cut short by the client's deadline (docs/daemon.md "Live weights").
    absl::Duration live_copy_timeout = absl::Minutes(2);
    // TEST ONLY: see LiveCopier::FaultHook (a live copy that fails midway).
    LiveCopier::FaultHook test_live_copy_fault;
    // Where this node counts (daemon/metrics.h: the process's instance, ServerOptions::metrics);
    // null = the process default, Metrics(). Must outlive the daemon.
    DaemonMetrics* metrics = nullptr;
    // Where a copy into live memory is recorded before its first byte (daemon/node/live_markers.h),
    // so that a restarted daemon reports those workers TORN, and its trainers' last answered
    // publishes (daemon/node/publish_record.h). Empty: not recorded (main.cc always sets it:
    // --live_state_dir, default LiveMarkers::DefaultDir()).
    std::string live_state_dir;
  };

  explicit NodeDaemon(Options options);
  ~NodeDaemon() override;
  NodeDaemon(const NodeDaemon&) = delete;
  NodeDaemon& operator=(const NodeDaemon&) = delete;

  // Registers with the coordinator (node_address = where our NodeService listens; peers reach it
  // there for ExchangeRegions, so it is also our data_address) and starts heartbeats (which also
  // watch local worker processes).
  absl::Status Start(const std::string& node_address);
  void Shutdown();

  void set_coordinator(const std::string& address) { options_.coordinator = address; }
  pb::WorkerService::Service* worker_service() { return worker_impl_.get(); }
  pb::NodeService::Service* node_service() { return node_impl_.get(); }
  const std::string& data_address() const { return data_address_; }
  // Options::metrics, or the process default.
  DaemonMetrics& metrics() const { return options_.metrics != nullptr ? *options_.metrics : Metrics(); }

 private:
  // node::CoordinatorAccess, over coord_ and coordinator_client_ (set by Start).
  CoordinatorClient& client() override;
  bool AwaitRegistered(absl::Time deadline) override;
  uint64_t session() override;
  std::optional<std::string> AwaitCoordinatorChange(uint64_t session0, absl::Time deadline) override;
  std::optional<absl::Time> UnreachableSince() override;
  std::string coordinator_instance() override;
  void TrackProgress(const std::string& model_id, uint64_t version, std::weak_ptr<const std::atomic<uint64_t>> bytes_done) override;

  // Checks local worker processes; tells the coordinator about the ones that exited.
  void CheckWorkers();
  // What RegisterNode sends (addresses, transports): daemon/node/coordinator_session.h.
  pb::RegisterNodeRequest Registration() const;
  // Runs on the session's control thread once per heartbeat period: worker liveness, staging pool,
  // the transports' guard counts (wb_transport_guard_*).
  void ControlTick();
  // Records every transport's bounds against peers (TransportStats::guards) through guard_meter_.
  void RecordGuards();
  // After (re-)registration: aborts local versions in flight (`reason`), re-submits models,
  // workers and layouts the node holds.
  void Rejoin(const std::string& reason);

  // Declaration order is construction order: each part is built from the ones above it.
  Options options_;
  node::NodeTransports transports_;
  std::shared_ptr<GpuImport> gpu_import_;  // options_.gpu_import or the build's
  LiveCopier copier_;                      // staging -> live copies on the host transport
  // The local workers: table, layouts, buffers, snapshots, committed staging, live state, the
  // node-local outcomes Apply waits for (aborted versions, re-joins) and live copies.
  LocalWorkers local_;
  node::NodeStaging staging_;
  node::ChannelCache channels_;  // healthy cross-node channels per (model, channel) (own leaf lock)
  node::PeerStubs peer_stubs_;   // gRPC stubs to peers' NodeService (own leaf lock)
  node::UnstartedCoordinatorClient unstarted_;  // client() before Start
  node::Versions versions_;
  GuardMeter guard_meter_;  // wb_transport_guard_* from the transports' counts (own leaf lock)
  node::WorkerCalls worker_calls_;
  std::unique_ptr<pb::WorkerService::Service> worker_impl_;
  std::unique_ptr<pb::NodeService::Service> node_impl_;
  // Node -> coordinator calls (daemon/node/coordinator_client.h) and the session over them:
  // registration, heartbeats, re-registration (Rejoin). Set by Start, before any worker can reach
  // the node (the worker socket opens after Start); read by gRPC threads through CoordinatorAccess.
  std::unique_ptr<CoordinatorClient> coordinator_client_;
  std::unique_ptr<CoordinatorSession> coord_;
  std::atomic<CoordinatorClient*> client_{nullptr};
  std::atomic<CoordinatorSession*> session_{nullptr};
  std::unique_ptr<LiveMarkers> markers_;  // set by Start (live_state_dir), then const; used through local_
  std::unique_ptr<node::PublishRecord> publish_record_;  // the same; used through worker_calls_
  std::string node_address_, data_address_;
  std::atomic<bool> stopped_{false};
};

}  // namespace wb::daemon
