#pragma once
// In-process NodeClient for tests and the control-plane bench: answers at once (OK unless a hook
// says otherwise) and records what it was asked. Hooks run on the caller's thread (the
// coordinator's driver or its RPC helpers), outside the coordinator's lock, so a hook may call
// back into the coordinator (e.g. ReportDone from on_execute, as a real node does later).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/coordinator/node_client.h"

namespace wb::daemon {

class FakeNodeClient final : public NodeClient {
 public:
  explicit FakeNodeClient(std::string node_id) : node_id_(std::move(node_id)) {}

  const std::string& node_id() const { return node_id_; }

  // Hooks (set before the coordinator can call; empty = OK).
  std::function<absl::Status(const pb::PlanSlice&)> on_install;
  std::function<absl::Status(const pb::ExecuteVersionRequest&)> on_execute;
  std::function<absl::Status(const std::string& model_id, uint64_t version)> on_commit;
  std::function<absl::Status(const std::string& model_id, uint64_t version)> on_abort;
  std::function<void()> on_cancel;  // CancelCalls (a hook blocking a call ends it here)

  absl::Status InstallPlan(const pb::PlanSlice& slice, absl::Duration timeout) override;
  absl::Status ExecuteVersion(const pb::ExecuteVersionRequest& req, absl::Duration timeout) override;
  absl::Status CommitVersion(const std::string& model_id, uint64_t version, absl::Duration timeout) override;
  absl::Status AbortVersion(const std::string& model_id, uint64_t version, uint64_t plan_epoch, const std::string& reason,
                            absl::Duration timeout) override;
  void CancelCalls() override;

  // What the coordinator asked so far.
  struct Calls {
    int install = 0, execute = 0, commit = 0, abort = 0, cancel = 0;
    uint64_t last_plan_epoch = 0;
    std::vector<uint64_t> committed, aborted;  // versions, in call order
    std::vector<uint64_t> aborted_epochs;      // AbortVersion's plan_epoch, as `aborted`
    size_t last_slice_ops = 0;
  };
  Calls calls() const;
  // Waits (real time) until `pred(calls())` holds; false at `deadline`.
  bool AwaitCalls(const std::function<bool(const Calls&)>& pred, absl::Time deadline) const;

 private:
  const std::string node_id_;
  mutable absl::Mutex mu_;
  Calls calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon
