#include "daemon/node/fake_coordinator_client.h"

#include "absl/strings/str_cat.h"

namespace wb::daemon {

void FakeCoordinatorClient::Restart() {
  absl::MutexLock l(&mu_);
  restarts_ += 1;
  nodes_.clear();
}

void FakeCoordinatorClient::ForgetNode(const std::string& node) {
  absl::MutexLock l(&mu_);
  nodes_.erase(node);
}

void FakeCoordinatorClient::SetReachable(bool reachable) {
  absl::MutexLock l(&mu_);
  reachable_ = reachable;
}

void FakeCoordinatorClient::SetLeaseMs(int64_t lease_ms) {
  absl::MutexLock l(&mu_);
  lease_ms_ = lease_ms;
}

std::string FakeCoordinatorClient::instance() {
  absl::MutexLock l(&mu_);
  return absl::StrCat("fake-coordinator-", restarts_);
}

int FakeCoordinatorClient::registrations() {
  absl::MutexLock l(&mu_);
  return registrations_;
}

std::vector<FakeCoordinatorClient::Beat> FakeCoordinatorClient::beats() {
  absl::MutexLock l(&mu_);
  return beats_;
}

bool FakeCoordinatorClient::AwaitBeats(size_t n, absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto have = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return beats_.size() >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&have), timeout);
}

bool FakeCoordinatorClient::AwaitRegistrations(int n, absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto have = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return registrations_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&have), timeout);
}

int FakeCoordinatorClient::calls(const std::string& method) {
  absl::MutexLock l(&mu_);
  return calls_[method];
}

absl::Status FakeCoordinatorClient::Count(const std::string& method) {
  absl::MutexLock l(&mu_);
  calls_[method] += 1;
  if (!reachable_) return absl::UnavailableError(absl::StrCat("fake coordinator unreachable (", method, ")"));
  return absl::OkStatus();
}

absl::Status FakeCoordinatorClient::RegisterNode(const pb::RegisterNodeRequest& req, pb::RegisterNodeResponse* resp, absl::Duration) {
  absl::MutexLock l(&mu_);
  calls_["RegisterNode"] += 1;
  if (!reachable_) return absl::UnavailableError("fake coordinator unreachable (RegisterNode)");
  registrations_ += 1;
  const uint64_t incarnation = next_incarnation_++;
  nodes_[req.node_id()] = incarnation;
  resp->set_incarnation(incarnation);
  resp->set_coordinator_instance(absl::StrCat("fake-coordinator-", restarts_));
  resp->set_lease_ms(lease_ms_);
  return absl::OkStatus();
}

absl::Status FakeCoordinatorClient::Heartbeat(const pb::HeartbeatRequest& req, pb::HeartbeatResponse* resp, absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  calls_["Heartbeat"] += 1;
  Beat beat{clock_->Now(), timeout, req, false};
  absl::Status s;
  auto node = nodes_.find(req.node_id());
  if (!reachable_) {
    s = absl::UnavailableError("fake coordinator unreachable (Heartbeat)");
  } else if (node == nodes_.end() || node->second != req.incarnation()) {
    s = absl::NotFoundError(absl::StrCat("node ", req.node_id(), " incarnation ", req.incarnation(), " is not registered"));
  } else {
    beat.ok = true;
    resp->set_lease_ms(lease_ms_);
  }
  beats_.push_back(std::move(beat));
  return s;
}

}  // namespace wb::daemon
