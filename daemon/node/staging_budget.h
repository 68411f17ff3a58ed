#pragma once
// The node's host staging budget (--staging_budget_bytes) as one total: every byte of host staging
// a node holds - trainer snapshots (one-step-off / async Publish), rollout incoming staging and the
// rank-0 gather staging of every version in flight, and rollouts' committed staging not applied
// yet - is reserved here before it is allocated, and released when the last user of that memory
// drops it (a Charge travels with the memory). A reservation that would take the total past the
// budget is refused, naming the node, the budget, what is in use and what was asked for.
// Thread-safe (own leaf lock).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace wb::daemon {

class StagingBudget {
 public:
  // Bytes reserved; released when the Charge is destroyed (hold it as long as the memory lives).
  class Charge {
   public:
    ~Charge();
    int64_t bytes() const { return bytes_; }

   private:
    friend class StagingBudget;
    Charge(std::shared_ptr<StagingBudget> owner, int64_t bytes) : owner_(std::move(owner)), bytes_(bytes) {}
    std::shared_ptr<StagingBudget> owner_;
    int64_t bytes_;
  };

  static std::shared_ptr<StagingBudget> Create(std::string node_id, int64_t budget_bytes);

  // RESOURCE_EXHAUSTED "node N: <what> needs B bytes of host staging; X of the node's
  // --staging_budget_bytes=Y are in use (...)" when in_use + bytes > budget.
  absl::StatusOr<std::shared_ptr<Charge>> Reserve(int64_t bytes, const std::string& what);
  int64_t in_use() const;
  int64_t budget() const { return budget_; }
  // Largest in_use seen (tests, metrics).
  int64_t peak() const;

 private:
  StagingBudget(std::string node_id, int64_t budget_bytes) : node_id_(std::move(node_id)), budget_(budget_bytes) {}
  void Release(int64_t bytes);
  std::weak_ptr<StagingBudget> self_;
  const std::string node_id_;
  const int64_t budget_;
  mutable absl::Mutex mu_;
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace wb::daemon
