#pragma once
// CoordinatorService over gRPC: a thin adapter. Every handler forwards to CoordinatorCore
// (daemon/coordinator/core.h: tables, planning outside the lock, the version driver over the
// NodeClient seam) and converts its absl::Status to gRPC here, through Serve() (proto/grpc_status.h
// ToGrpcStatus, in one place). Access rules are not here: the auth interceptor checks every call
// before its handler runs (daemon/auth_policy.h). See docs/daemon.md and docs/architecture.md
// "Coordinator".

#include <memory>

#include "daemon/coordinator/core.h"
#include "daemon/metrics.h"
#include "proto/weightbridge.grpc.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

class Coordinator final : public pb::CoordinatorService::Service {
 public:
  using Options = CoordinatorOptions;
  static constexpr absl::Duration kWatchDefaultTimeout = CoordinatorCore::kWatchDefaultTimeout;
  static constexpr absl::Duration kWatchMaxTimeout = CoordinatorCore::kWatchMaxTimeout;
  static constexpr absl::Duration kWatchCancelCheck = CoordinatorCore::kWatchCancelCheck;

  explicit Coordinator(Options options);
  ~Coordinator() override { Shutdown(); }
  // Starts the driver and planner threads. Shutdown() stops them and fails every waiter (UNAVAILABLE).
  void Start() { core_.Start(); }
  void Shutdown() { core_.Shutdown(); }
  CoordinatorCore& core() { return core_; }

  grpc::Status RegisterNode(grpc::ServerContext*, const pb::RegisterNodeRequest*, pb::RegisterNodeResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const pb::HeartbeatRequest*, pb::HeartbeatResponse*) override;
  grpc::Status CreateModel(grpc::ServerContext*, const pb::CreateModelRequest*, pb::CreateModelResponse*) override;
  grpc::Status JoinWorker(grpc::ServerContext*, const pb::JoinWorkerRequest*, pb::JoinWorkerResponse*) override;
  grpc::Status SubmitLayout(grpc::ServerContext*, const pb::SubmitLayoutRequest*, pb::SubmitLayoutResponse*) override;
  grpc::Status LeaveWorker(grpc::ServerContext*, const pb::LeaveWorkerRequest*, pb::LeaveWorkerResponse*) override;
  // Contracts: CoordinatorCore (Publish: sync OK only when every node acknowledged the commit).
  grpc::Status Publish(grpc::ServerContext*, const pb::CoordPublishRequest*, pb::PublishResponse*) override;
  grpc::Status ReportReady(grpc::ServerContext*, const pb::ReportReadyRequest*, pb::ReportReadyResponse*) override;
  grpc::Status ReportDone(grpc::ServerContext*, const pb::ReportDoneRequest*, pb::ReportDoneResponse*) override;
  grpc::Status ReportApplied(grpc::ServerContext*, const pb::ReportAppliedRequest*, pb::ReportAppliedResponse*) override;
  grpc::Status WaitVersion(grpc::ServerContext*, const pb::WaitVersionRequest*, pb::WaitVersionResponse*) override;
  grpc::Status ExchangeMagnitudes(grpc::ServerContext*, const pb::ExchangeMagnitudesRequest*, pb::ExchangeMagnitudesResponse*) override;
  grpc::Status ClusterStatus(grpc::ServerContext*, const pb::StatusRequest*, pb::StatusResponse*) override;
  grpc::Status WatchStatus(grpc::ServerContext*, const pb::WatchStatusRequest*,
                           grpc::ServerWriter<pb::StatusResponse>*) override;
  // Waits until at most `n` WatchStatus streams are open (tests: a cancelled client frees its
  // slot); false if `deadline` passes first.
  bool AwaitStatusWatchersAtMost(int n, absl::Time deadline) const { return core_.AwaitStatusWatchersAtMost(n, deadline); }
  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest*, pb::DrainResponse*) override;
  grpc::Status Plan(grpc::ServerContext*, const pb::PlanRequest*, pb::PlanResponse*) override;

 private:
  DaemonMetrics* metrics_;  // Options::metrics or Metrics()
  CoordinatorCore core_;
};

}  // namespace wb::daemon
