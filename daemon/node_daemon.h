#pragma once
// Node daemon: WorkerService (Unix socket, local workers) and NodeService (TCP, from the
// coordinator), the executor that runs this node's plan slice bucket by bucket, and staging.
// See docs/daemon.md for the memory model:
//  - trainer sources: live shm (sync: the trainer waits in Publish) or a per-version snapshot taken
//    at Publish (one-step-off / async);
//  - rollout destinations: bytes always land in an "incoming" staging copy per version; at commit it
//    becomes the "committed" copy; sync commit copies it into live weights at once, otherwise
//    Apply copies it. An aborted version only ever touched staging, so live weights keep the
//    previous version byte for byte.

#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/data_channel.h"
#include "planner/types.h"
#include "proto/weightbridge.grpc.pb.h"
#include "tools/cc/clock.h"
#include "transport/shm_segment.h"

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
    std::function<std::shared_ptr<grpc::Channel>(const std::string&)> make_channel;
    std::unique_ptr<DataChannel> data_channel;  // required (main.cc / tests pick the implementation)
  };

  explicit NodeDaemon(Options options);
  ~NodeDaemon();

  // Starts the data channel, registers with the coordinator (node_address = where our NodeService
  // listens) and starts heartbeats.
  absl::Status Start(const std::string& node_address);
  void Shutdown();

  void set_coordinator(const std::string& address) { options_.coordinator = address; }
  pb::WorkerService::Service* worker_service();
  pb::NodeService::Service* node_service();
  const std::string& data_address() const { return data_address_; }

 private:
  class WorkerImpl;
  class NodeImpl;
  friend class WorkerImpl;
  friend class NodeImpl;

  using Bytes = std::vector<std::vector<uint8_t>>;  // one vector per buffer
  struct LocalWorker {
    std::string model_id;
    planner::Role role = planner::Role::kTrainer;
    int32_t gpu = 0;
    pb::Mode mode = pb::MODE_SYNC;
    bool has_layout = false;
    std::vector<std::shared_ptr<transport::ShmSegment>> buffers;  // live memory, layout order
    planner::WorkerLayout layout;
    std::map<uint64_t, std::shared_ptr<Bytes>> snapshots;  // trainer: version -> copy
    std::shared_ptr<Bytes> committed;                      // rollout: newest committed staging
    uint64_t committed_version = 0;
    uint64_t applied_version = 0;
  };
  struct ModelPlan {
    pb::PlanSlice slice;
    planner::Inventory inventory;
    std::vector<planner::WorkerLayout> layouts;  // per slice worker (empty when not local)
    std::map<uint32_t, const pb::TransferOp*> ops_by_index;
    std::vector<int> incoming_per_bucket;        // remote -> local ops per bucket
  };
  struct Exec {
    std::string model_id;
    uint64_t version = 0;
    uint64_t epoch = 0;
    std::shared_ptr<const ModelPlan> plan;
    std::map<std::string, std::shared_ptr<Bytes>> incoming;  // local rollout worker -> staging
    std::vector<int> received_per_bucket;
    uint64_t bytes_done = 0;
    bool started = false, aborted = false, failed = false;
    std::string error;
    absl::Time deadline;
  };

  absl::StatusOr<std::shared_ptr<Exec>> GetExecLocked(const std::string& model_id, uint64_t version, uint64_t epoch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunExec(std::shared_ptr<Exec> exec);
  absl::Status RunExecInner(Exec& exec);
  absl::Status OnFrame(const FrameHeader& header, absl::Span<const uint8_t> payload);
  void HeartbeatLoop();
  absl::Status Register();

  Options options_;
  std::unique_ptr<WorkerImpl> worker_impl_;
  std::unique_ptr<NodeImpl> node_impl_;
  std::unique_ptr<pb::CoordinatorService::Stub> coordinator_;
  std::string node_address_, data_address_;

  absl::Mutex mu_;
  uint64_t incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, LocalWorker> workers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<const ModelPlan>> plans_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<Exec>> execs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> committed_ ABSL_GUARDED_BY(mu_);                       // model -> version
  std::map<std::pair<std::string, uint64_t>, std::string> aborted_ ABSL_GUARDED_BY(mu_);  // reason
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread heartbeat_;
};

}  // namespace wb::daemon
