#pragma once
// Hand-written in-process CoordinatorClient for tests (coordinator_session_test): node
// registration with incarnations and a coordinator instance id, restarts (a new instance that
// knows no node), lost leases, outages, and a record of every heartbeat. Other calls answer OK
// with an empty response and are counted. Thread-safe.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "base/clock.h"
#include "daemon/node/coordinator_client.h"

namespace wb::daemon {

class FakeCoordinatorClient final : public CoordinatorClient {
 public:
  struct Beat {
    absl::Time at;               // on the clock given to the fake
    absl::Duration timeout;      // the RPC timeout the node gave
    pb::HeartbeatRequest request;
    bool ok = false;             // answered OK (else NOT_FOUND or UNAVAILABLE)
  };
  explicit FakeCoordinatorClient(Clock* clock) : clock_(clock) {}

  // The coordinator process restarts: a new instance id; it knows no node (heartbeats NOT_FOUND).
  void Restart();
  // The coordinator drops `node` (an expired lease): same instance, heartbeats NOT_FOUND.
  void ForgetNode(const std::string& node);
  // false: every call fails UNAVAILABLE (the coordinator is down or unreachable).
  void SetReachable(bool reachable);
  // lease_ms the coordinator answers in RegisterNode and Heartbeat (0: none).
  void SetLeaseMs(int64_t lease_ms);

  std::string instance();
  int registrations();
  std::vector<Beat> beats();  // every Heartbeat call, in order (also failed ones)
  // Test waits, bounded in REAL time (the node's threads run on their own): until `n` heartbeat
  // calls (answered or not) / `n` registrations have been made. False when that did not happen.
  bool AwaitBeats(size_t n, absl::Duration timeout);
  bool AwaitRegistrations(int n, absl::Duration timeout);
  int calls(const std::string& method);

  absl::Status RegisterNode(const pb::RegisterNodeRequest& req, pb::RegisterNodeResponse* resp, absl::Duration timeout) override;
  absl::Status Heartbeat(const pb::HeartbeatRequest& req, pb::HeartbeatResponse* resp, absl::Duration timeout) override;
  absl::Status JoinWorker(const pb::JoinWorkerRequest&, pb::JoinWorkerResponse*, absl::Duration) override { return Count("JoinWorker"); }
  absl::Status SubmitLayout(const pb::SubmitLayoutRequest&, pb::SubmitLayoutResponse*, absl::Duration) override { return Count("SubmitLayout"); }
  absl::Status LeaveWorker(const pb::LeaveWorkerRequest&, pb::LeaveWorkerResponse*, absl::Duration) override { return Count("LeaveWorker"); }
  absl::Status Publish(const pb::CoordPublishRequest&, pb::PublishResponse*, absl::Duration) override { return Count("Publish"); }
  absl::Status ReportReady(const pb::ReportReadyRequest&, pb::ReportReadyResponse*, absl::Duration) override { return Count("ReportReady"); }
  absl::Status ReportDone(const pb::ReportDoneRequest&, pb::ReportDoneResponse*, absl::Duration) override { return Count("ReportDone"); }
  absl::Status ReportApplied(const pb::ReportAppliedRequest&, pb::ReportAppliedResponse*, absl::Duration) override {
    return Count("ReportApplied");
  }
  absl::Status WaitVersion(const pb::WaitVersionRequest&, pb::WaitVersionResponse*, absl::Duration) override { return Count("WaitVersion"); }
  absl::Status ExchangeMagnitudes(const pb::ExchangeMagnitudesRequest&, pb::ExchangeMagnitudesResponse*, absl::Duration) override {
    return Count("ExchangeMagnitudes");
  }
  absl::Status ClusterStatus(const pb::StatusRequest&, pb::StatusResponse*, absl::Duration) override { return Count("ClusterStatus"); }
  absl::Status Drain(const pb::DrainRequest&, pb::DrainResponse*, absl::Duration) override { return Count("Drain"); }

 private:
  absl::Status Count(const std::string& method);

  Clock* const clock_;
  absl::Mutex mu_;
  int restarts_ ABSL_GUARDED_BY(mu_) = 0;
  bool reachable_ ABSL_GUARDED_BY(mu_) = true;
  int64_t lease_ms_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_incarnation_ ABSL_GUARDED_BY(mu_) = 1;
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, uint64_t> nodes_ ABSL_GUARDED_BY(mu_);  // node -> its incarnation
  std::vector<Beat> beats_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon
