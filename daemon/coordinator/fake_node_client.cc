#include "daemon/coordinator/fake_node_client.h"

namespace wb::daemon {

absl::Status FakeNodeClient::InstallPlan(const pb::PlanSlice& slice, absl::Duration) {
  {
    absl::MutexLock l(&mu_);
    ++calls_.install;
    calls_.last_plan_epoch = slice.plan_epoch();
    calls_.last_slice_ops = static_cast<size_t>(slice.ops_size());
  }
  return on_install ? on_install(slice) : absl::OkStatus();
}

absl::Status FakeNodeClient::ExecuteVersion(const pb::ExecuteVersionRequest& req, absl::Duration) {
  {
    absl::MutexLock l(&mu_);
    ++calls_.execute;
  }
  return on_execute ? on_execute(req) : absl::OkStatus();
}

absl::Status FakeNodeClient::CommitVersion(const std::string& model_id, uint64_t version, absl::Duration) {
  absl::Status s = on_commit ? on_commit(model_id, version) : absl::OkStatus();
  absl::MutexLock l(&mu_);
  ++calls_.commit;
  if (s.ok()) calls_.committed.push_back(version);
  return s;
}

void FakeNodeClient::CancelCalls() {
  {
    absl::MutexLock l(&mu_);
    ++calls_.cancel;
  }
  if (on_cancel) on_cancel();
}

absl::Status FakeNodeClient::AbortVersion(const std::string& model_id, uint64_t version, uint64_t plan_epoch, const std::string&,
                                          absl::Duration) {
  absl::Status s = on_abort ? on_abort(model_id, version) : absl::OkStatus();
  absl::MutexLock l(&mu_);
  ++calls_.abort;
  calls_.aborted.push_back(version);
  calls_.aborted_epochs.push_back(plan_epoch);
  return s;
}

FakeNodeClient::Calls FakeNodeClient::calls() const {
  absl::MutexLock l(&mu_);
  return calls_;
}

bool FakeNodeClient::AwaitCalls(const std::function<bool(const Calls&)>& pred, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto holds = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return pred(calls_); };
  return mu_.AwaitWithDeadline(absl::Condition(&holds), deadline);
}

}  // namespace wb::daemon
