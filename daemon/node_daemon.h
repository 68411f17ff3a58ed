#pragma once
// Node daemon: WorkerService (Unix socket, local workers) and NodeService (TCP, from the
// coordinator and peer nodes), the executor that runs this node's plan slice bucket by bucket on
// the transport interface (transport/transport.h), and staging.
//
// Executor (per version): every local memory of the version (trainer live buffers in sync mode or
// their Publish snapshot, rollout incoming staging, the rank-0 gather staging) is registered with
// the same-node transport and, when the slice has cross-node ops, with the cross-node transport.
// For each peer node, the node with the smaller id calls the other's ExchangeRegions (endpoint +
// region descriptors, per model); both connect (or keep a healthy channel) and import. Then per
// bucket: one batch of same-node ops (one-sided) and, per peer, one batch of the ops between the
// two nodes in op-index order - the mirror batch the peer derives from its own slice in the same
// way. Every batch of a bucket is waited for before the next bucket starts, so relays (and
// rank0_broadcast reads of gathered data) read delivered bytes. AbortVersion disconnects the
// version's peers so blocked waits end at once.
// See docs/daemon.md for the memory model:
//  - trainer sources: live shm (sync: the trainer waits in Publish) or a per-version snapshot taken
//    at Publish (one-step-off / async);
//  - rollout destinations: bytes always land in an "incoming" staging copy per version; at commit it
//    becomes the "committed" copy; sync commit copies it into live weights at once, otherwise
//    Apply copies it. An aborted version only ever touched staging, so live weights keep the
//    previous version byte for byte.

#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "planner/types.h"
#include "proto/weightbridge.grpc.pb.h"
#include "daemon/device_staging.h"
#include "daemon/fd_channel.h"
#include "daemon/layout_discovery.h"
#include "daemon/metrics.h"
#include "daemon/nic_meter.h"
#include "daemon/digest/op_digests.h"
#include "daemon/node/channel_cache.h"
#include "daemon/node/exec_plan.h"
#include "daemon/node/executor.h"
#include "daemon/node/coordinator_client.h"
#include "daemon/node/coordinator_session.h"
#include "daemon/node/gpu_import.h"
#include "daemon/node/live_copy.h"
#include "daemon/node/local_workers.h"
#include "daemon/node/staging_budget.h"
#include "daemon/staging_pool.h"
#include "base/clock.h"
#include "transport/device_allocator.h"
#include "transport/factory.h"
#include "base/shm_segment.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

class NodeDaemon {
 public:
  struct Options {
    std::string node_id = "node0";
    std::string coordinator;  // host:port of CoordinatorService
    std::string data_listen = "127.0.0.1:0";
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
    // TEST ONLY: when it returns true the heartbeat is skipped (a frozen node: its lease expires).
    std::function<bool()> test_skip_heartbeat;
    // Channel to the coordinator (TLS + token: daemon/auth.h); empty = insecure.
    std::function<std::shared_ptr<grpc::Channel>(const std::string&)> make_channel;
    // CUDA VMM buffers (BufferSpec.cuda_vmm_key): the fd a worker sent on the fd channel
    // (DaemonFront::FindVmmFd; keyed by model too: worker ids are scoped per model). Unset: such
    // buffers are FAILED_PRECONDITION.
    std::function<absl::StatusOr<CudaVmmFd>(const std::string& model, const std::string& worker, const std::string& key)> cuda_vmm_fd;
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
    // so that a restarted daemon reports those workers TORN. Empty: not recorded (main.cc always
    // sets it: --live_state_dir, default LiveMarkers::DefaultDir()).
    std::string live_state_dir;
  };

  explicit NodeDaemon(Options options);
  ~NodeDaemon();

  // Registers with the coordinator (node_address = where our NodeService listens; peers reach it
  // there for ExchangeRegions, so it is also our data_address) and starts heartbeats (which also
  // watch local worker processes).
  absl::Status Start(const std::string& node_address);
  void Shutdown();

  void set_coordinator(const std::string& address) { options_.coordinator = address; }
  pb::WorkerService::Service* worker_service();
  pb::NodeService::Service* node_service();
  const std::string& data_address() const { return data_address_; }
  // Options::metrics, or the process default.
  DaemonMetrics& metrics() const { return options_.metrics != nullptr ? *options_.metrics : Metrics(); }

  // ---- WorkerService calls (daemon/node_daemon_workers.cc; the gRPC adapter is
  // daemon/node/worker_service.cc). Each answers as the RPC of the same name; errors name the
  // worker, model and node.
  absl::Status RegisterWorker(const pb::RegisterWorkerRequest& req, pb::RegisterWorkerResponse* resp);
  absl::Status RegisterLayout(const pb::RegisterLayoutRequest& req, pb::RegisterLayoutResponse* resp);
  absl::Status Publish(const pb::PublishRequest& req, pb::PublishResponse* resp);
  absl::Status BeginUpdate(const pb::BeginUpdateRequest& req, pb::BeginUpdateResponse* resp);
  absl::Status Apply(const pb::ApplyRequest& req, pb::ApplyResponse* resp);
  absl::Status WaitVersion(const pb::WaitVersionRequest& req, pb::WaitVersionResponse* resp);
  absl::Status Deregister(const pb::DeregisterRequest& req);
  absl::Status DescribeLayout(const pb::DescribeLayoutRequest& req, pb::DescribeLayoutResponse* resp);
  // Status on both services: the coordinator's cluster status plus this node's live states.
  absl::Status ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp);

  // ---- NodeService calls (daemon/node_daemon_versions.cc; the gRPC adapter is
  // daemon/node/node_service.cc).
  absl::Status InstallPlan(const pb::InstallPlanRequest& req);
  absl::Status ExecuteVersion(const pb::ExecuteVersionRequest& req);
  absl::Status CommitVersion(const pb::CommitVersionRequest& req);
  absl::Status AbortVersion(const pb::AbortVersionRequest& req);
  absl::Status ExchangeRegions(const pb::ExchangeRegionsRequest& req, pb::ExchangeRegionsResponse* resp);
  absl::Status DropWorker(const pb::DropWorkerRequest& req);
  absl::Status Drain(const pb::DrainRequest& req, pb::DrainResponse* resp);

 private:
  // Publish / Apply without their metrics (Publish and Apply count them before the reply).
  absl::Status PublishVersion(const pb::PublishRequest& req, pb::PublishResponse* resp);
  absl::Status ApplyVersion(const pb::ApplyRequest& req, pb::ApplyResponse* resp);
  // Forwards a call about local worker `worker` to the coordinator (`call` gets the deadline),
  // held while the node (re-)registers and sent again once after a re-join that answered
  // NOT_FOUND (daemon/node_daemon_workers.cc). *sent_in = the session of the last attempt.
  absl::Status ForwardHeld(const std::string& model, const std::string& worker, absl::Time deadline, uint64_t* sent_in,
                           const std::function<absl::Status(absl::Time)>& call);
  // A waiting call the coordinator could not answer (UNAVAILABLE, NOT_FOUND, CANCELLED): ABORTED
  // naming the restart once the node re-joined a restarted coordinator, else `s`.
  absl::Status RestartAware(const absl::Status& s, uint64_t session0, absl::Time deadline, const std::string& what);

  // StagedBuffer, CudaImport, RelayAtCommit: daemon/node/live_copy.h.
  using Bytes = StagedBytes;  // one entry per buffer, layout order
  // `n` empty buffers whose host memory goes back to staging_pool_ when the last reference drops
  // (fill them with TakeHost): every host staging of a version is made this way.
  // `charges` (daemon/node/staging_budget.h) are held until the memory is gone.
  std::shared_ptr<Bytes> NewBytes(size_t n = 0, std::vector<std::shared_ptr<StagingBudget::Charge>> charges = {});
  // `bytes`, also holding `charge` until the memory is gone.
  static std::shared_ptr<Bytes> KeepWith(std::shared_ptr<Bytes> bytes, std::shared_ptr<StagingBudget::Charge> charge);
  // Host staging of `size` bytes from staging_pool_ (recycled when one of that size is idle).
  std::vector<uint8_t> TakeHost(int64_t size);
  // An idle host staging buffer of `size` bytes in staging_pool_ ahead of the first version that
  // needs it (StagingPool::Prewarm), within what the node's staging budget leaves.
  void PrewarmStaging(int64_t size);
  // The local worker table (daemon/node/local_workers.h).
  using WorkerKey = LocalWorkers::WorkerKey;
  using LocalWorker = LocalWorkers::Worker;
  static std::string LiveKey(const std::string& model, const std::string& worker) { return LocalWorkers::LiveKey(model, worker); }
  struct ModelPlan {
    pb::PlanSlice slice;
    planner::Inventory inventory;
    // Per slice worker (empty when the slice has no layout for it). `layouts` is what transfers
    // address: a rollout's staging, where quantised pieces are replaced by their canonical-dtype
    // shadows (planner::StagingLayout); `live_layouts` is the worker's own layout (commit/Apply
    // copy into it; the quantiser writes its quantised pieces and scales in staging). The same
    // for everyone without quantised pieces.
    std::vector<planner::WorkerLayout> layouts;
    std::vector<planner::WorkerLayout> live_layouts;
    std::vector<bool> quantized;                 // the worker holds quantised pieces (host staging)
    bool hosts_gather = false;                   // rank0_broadcast: this node holds the gather staging
  };
  // One peer node's side of a version's data plane.
  struct PeerState {
    bool have = false;  // its ExchangeRegions (request or response) arrived
    bool reuse = false;
    std::string endpoint;
    std::map<std::string, std::string> regions;  // key -> descriptor
  };
  using LinkStat = node::LinkStat;
  struct Exec {
    std::string model_id;
    uint64_t version = 0;
    uint64_t epoch = 0;
    std::string coordinator_instance;  // of the ExecuteVersion that started it (set under mu_ before the thread)
    std::shared_ptr<const ModelPlan> plan;
    std::map<std::string, std::shared_ptr<Bytes>> incoming;  // local rollout worker -> staging
    std::shared_ptr<Bytes> gather;                           // rank-0 gather staging (one buffer)
    std::atomic<uint64_t> bytes_done{0};  // read by the heartbeat thread without mu_
    int64_t staging_bytes = 0;            // incoming + gather, allocated by the executor (not under mu_)
    std::shared_ptr<StagingBudget::Charge> charge;  // staging_bytes of the node's budget; travels with the staging
    bool started = false, aborted = false, failed = false;
    // Catch-up (docs/daemon.md "Catch-up"): an execution of a catch-up slice (catch_up_plans_) for
    // the already committed `version`: its ROLE_TRAINER workers are rollouts holding it (sources).
    bool catch_up = false;
    // Every byte of the version landed in this node's staging (the executor finished OK, before
    // ReportDone): only then may CommitVersion make it the committed copy (FAILED_PRECONDITION before).
    bool transferred = false;
    std::string error;
    absl::Time deadline;
    // Data plane of this version (guarded by mu_).
    bool regions_ready = false;
    // transport name (a kind, "host_tcp", or an nccl lane, "nccl/<device>") -> (key -> descriptor)
    std::map<std::string, std::map<std::string, std::string>> local_desc;
    std::map<std::string, PeerState> peers;              // channel (ChannelName) -> the peer's side
    std::map<std::string, transport::PeerId> connected;  // channel -> the connection this version uses
    std::map<std::string, LinkStat> links;  // executor thread only: peer node (own id = same-node) -> totals
    // Sync mode: same-node relays into a rollout whose staging nothing else reads are not copied
    // staging to staging during the transfer; the commit copies them from the relay's source
    // staging straight into the rollout's live buffers (RunExecInner "Relays at commit"). Written
    // by the executor under mu_ before it reports done; read by CommitVersion.
    using RelayAtCommit = daemon::RelayAtCommit;
    std::map<std::string, std::vector<RelayAtCommit>> relays_at_commit;  // destination rollout -> copies
    std::map<std::string, std::set<int32_t>> pieces_at_commit;           // destination rollout -> its pieces they fill
    uint64_t relay_bytes_at_commit = 0;
    // Executor thread only: seconds spent allocating staging, registering memory and setting up
    // channels (ExchangeRegions, Connect), and in the buckets (logged with "version transferred").
    double staging_s = 0, setup_s = 0, buckets_s = 0;
    // The pure plan this node ran (set by the executor before its buckets): routes, ops with their
    // region keys, pieces and boxes, relays at commit. Kept for what runs after the buckets.
    std::shared_ptr<const node::ExecPlan> exec_plan;
    // Executor thread only: the digests of this node's ops after the buckets (reported with
    // ReportDone; docs/daemon.md "End-to-end digests") and the seconds they took.
    digest::OpDigests digests;
    double digest_s = 0;
  };

  absl::StatusOr<std::shared_ptr<Exec>> GetExecLocked(const std::string& model_id, uint64_t version, uint64_t epoch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunExec(std::shared_ptr<Exec> exec);
  absl::Status RunExecInner(Exec& exec);
  // After every byte of a version landed: quantises the quantised pieces of this node's rollouts
  // from their shadows into their places and scales in incoming (host) staging, on a few threads.
  absl::Status QuantizeIncoming(Exec& exec);
  // Exchanges regions with `peer` and returns the channel for this version (connecting if needed):
  // our transport `mine` (named `mine_name`) with the peer's transport named `theirs_name`.
  absl::StatusOr<node::ChannelLink> SetupPeer(Exec& exec, const node::ChannelPlan& channel, transport::Transport* mine);
  // The executor's ChannelSetup: SetupPeer per channel, our descriptors into exec.local_desc.
  class ExecChannels;
  // Which memory backs each region key of a version on this node ("w<i>.b<j>", "g"), and what keeps
  // it alive while the executor runs (GatherVersionMemory).
  struct VersionMemory {
    std::map<std::string, node::RegionMemory> regions;
    std::vector<std::shared_ptr<void>> holds;  // snapshots / segments / staging / CUDA imports
    // Live segments read in place (sync trainers, catch-up sources): checked again after the buckets.
    std::vector<std::pair<std::string, std::shared_ptr<transport::ShmSegment>>> live_sources;
  };
  // Allocates the version's incoming staging (per local rollout, on its GPU where it may) and the
  // gather staging, outside mu_.
  absl::Status AllocateStaging(Exec& exec, const node::LanePlan& lanes);
  // The memory of each local region key: rollout staging, trainer live buffers (sync) or snapshots,
  // a catch-up source's committed staging or live buffers, the gather staging.
  absl::Status GatherVersionMemory(Exec& exec, VersionMemory& out);
  // Local sync rollouts whose live buffers are all host memory (relays may be left to the commit).
  std::set<uint32_t> HostLiveSyncRollouts(const ModelPlan& plan);
  // Deadline, abort check, metrics and progress of the executor for `exec`.
  node::ExecOptions ExecOptionsFor(Exec& exec);
  // After the buckets: end-to-end digests of the local ops (`digests`: started before the buckets;
  // null with --digests=false) and the TEST ONLY after-buckets hook.
  absl::Status DigestVersion(Exec& exec, const VersionMemory& memory, digest::OpDigestTracker* digests);
  // Drops the cached channel `chan` (ChannelName) of a model and disconnects it (outside mu_).
  void DropChannel(const std::string& model_id, const std::string& chan, transport::PeerId id);
  // gRPC stub to peer node `peer` at `address`; one per peer node, replaced when its address changes.
  std::shared_ptr<pb::NodeService::Stub> PeerStub(const std::string& peer, const std::string& address);
  // Checks local worker processes; tells the coordinator about the ones that exited.
  void CheckWorkers();
  // What RegisterNode sends (addresses, transports): daemon/node/coordinator_session.h.
  pb::RegisterNodeRequest Registration() const;
  // Runs on the session's control thread once per heartbeat period: worker liveness, staging pool.
  void ControlTick();
  // After (re-)registration: aborts local versions in flight (`reason`), re-submits models,
  // workers and layouts the node holds.
  void Rejoin(const std::string& reason);
  // The coordinator session's (CoordinatorSession, coord_); false / nullopt / 0 before Start.
  std::optional<std::string> AwaitCoordinatorChange(uint64_t session0, absl::Time deadline);
  bool AwaitRegistered(absl::Time deadline);
  uint64_t session();
  // Opens a worker's CUDA IPC buffer through the cuda_ipc transport. FAILED_PRECONDITION naming
  // the buffer when this node has no usable cuda_ipc transport (no GPU visible, or built without CUDA).
  absl::StatusOr<std::shared_ptr<CudaImport>> ImportCuda(const std::string& model, const std::string& worker, const pb::BufferSpec& b);
  // One copy of staging into a local rollout's live memory (sync commit or Apply): LocalWorkers::RunLiveCopies.
  using LiveJob = LocalWorkers::LiveJob;
  // Copies a worker's live buffers (host or CUDA) into `out` (one entry per buffer). With
  // `on_gpu`, a CUDA buffer is copied device to device into GPU staging when the budget allows
  // (else, and for host buffers, into host memory).
  absl::Status ReadLive(const std::vector<std::shared_ptr<transport::ShmSegment>>& buffers,
                        const std::vector<std::shared_ptr<CudaImport>>& cuda, Bytes& out, const std::string& label, absl::Time deadline,
                        bool on_gpu = false);
  // GPU staging of `size` bytes on `device`, or nullptr (host staging) when off / over budget.
  absl::StatusOr<std::shared_ptr<transport::DeviceMemory>> TryDeviceStaging(int device, int64_t size, const std::string& label);
  // The same-node transport that reaches CUDA memory (cuda_ipc), or nullptr.
  transport::Transport* CudaTransport() const;
  // The nccl lanes (device -> transport) when this node moves GPU staging across nodes (nccl built
  // and usable, GPU staging on), else empty.
  std::map<int, transport::Transport*> NcclLanes() const;
  // The cross-node transport of this node named `name`: the host channel's kind ("host_tcp") or an
  // nccl lane ("nccl/<device>"); nullptr when there is none.
  transport::Transport* CrossTransport(const std::string& name) const;
  // Cross-node channels: "<node>" for the host channel, "<node>\n<mine>><theirs>" for the nccl lane
  // pair (our lane, the peer's lane), e.g. "n1\nnccl/0>nccl/3" (a newline cannot be part of a node
  // id given by flag). ChannelTransportName returns <mine> ("" for the host channel).
  static std::string ChannelName(const std::string& peer, const std::string& mine, const std::string& theirs) {
    return node::ChannelName(peer, mine, theirs);
  }
  static std::string ChannelTransportName(const std::string& chan) { return node::ChannelTransportName(chan); }

  Options options_;
  std::unique_ptr<pb::WorkerService::Service> worker_impl_;
  std::unique_ptr<pb::NodeService::Service> node_impl_;
  std::unique_ptr<pb::CoordinatorService::Stub> coordinator_;
  // Node -> coordinator calls (daemon/node/coordinator_client.h) and the session over them:
  // registration, heartbeats (never take mu_), re-registration (Rejoin). Set by Start.
  std::unique_ptr<CoordinatorClient> coordinator_client_;
  std::unique_ptr<CoordinatorSession> coord_;
  std::shared_ptr<GpuImport> gpu_import_;  // options_.gpu_import or the build's
  LayoutDescriber describer_;               // RegisterLayout / DescribeLayout (thread-safe)
  std::string node_address_, data_address_;

  // Lock order: mu_ -> local_'s own mutex (LocalWorkers never calls back into NodeDaemon); the
  // channel cache, staging pool and budget have leaf locks of their own.
  absl::Mutex mu_;
  std::unique_ptr<LiveMarkers> markers_;  // set by Start (live_state_dir), then const; used through local_
  LiveCopier copier_;                     // staging -> live copies on the host transport
  // The local workers: table, layouts, buffers, snapshots, committed staging, live state, the
  // node-local outcomes Apply waits for (aborted versions, re-joins) and live copies.
  LocalWorkers local_;
  std::map<std::string, std::shared_ptr<const ModelPlan>> plans_ ABSL_GUARDED_BY(mu_);
  // model -> its latest catch-up slice (PlanSlice.catch_up), apart from its plan.
  std::map<std::string, std::shared_ptr<const ModelPlan>> catch_up_plans_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<Exec>> execs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> committed_ ABSL_GUARDED_BY(mu_);                       // model -> version
  node::ChannelCache channels_;  // healthy cross-node channels per (model, channel) (own leaf lock)
  NicMeter nic_meter_;  // wb_nic_bytes_total from the host channel's per-path counts (own lock)
  // Host staging memory reused across versions (own lock; buffers come back from NewBytes' deleter).
  std::shared_ptr<StagingPool> staging_pool_;
  // --staging_budget_bytes as the node's total of host staging (own lock).
  std::shared_ptr<StagingBudget> budget_;
  absl::Mutex stubs_mu_;
  struct PeerStubEntry {
    std::string address;
    std::shared_ptr<pb::NodeService::Stub> stub;
  };
  std::map<std::string, PeerStubEntry> peer_stubs_ ABSL_GUARDED_BY(stubs_mu_);  // peer node -> stub
  // Executor threads, one per started version. A thread files its id in exec_done_ as its last
  // step under mu_; the next ExecuteVersion (and Shutdown) joins those, so a daemon that runs for
  // weeks at one version a second keeps only the executors still running, not one per version.
  std::map<uint64_t, std::thread> exec_threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> exec_done_ ABSL_GUARDED_BY(mu_);
  uint64_t next_exec_thread_ ABSL_GUARDED_BY(mu_) = 0;
  // Moves the finished executor threads out (to be joined by the caller without mu_ held).
  std::vector<std::thread> TakeFinishedExecThreadsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkExecThreadDone(uint64_t id);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace wb::daemon
