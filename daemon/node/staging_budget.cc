#include "daemon/node/staging_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace wb::daemon {

std::shared_ptr<StagingBudget> StagingBudget::Create(std::string node_id, int64_t budget_bytes) {
  std::shared_ptr<StagingBudget> b(new StagingBudget(std::move(node_id), budget_bytes));
  b->self_ = b;
  return b;
}

StagingBudget::Charge::~Charge() {
  if (owner_) owner_->Release(bytes_);
}

absl::StatusOr<std::shared_ptr<StagingBudget::Charge>> StagingBudget::Reserve(int64_t bytes, const std::string& what) {
  if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative staging size ", bytes));
  {
    absl::MutexLock l(&mu_);
    if (bytes > budget_ - in_use_) {
      return absl::ResourceExhaustedError(absl::StrCat("node ", node_id_, ": ", what, " needs ", bytes, " bytes of host staging; ", in_use_,
                                                       " of the node's --staging_budget_bytes=", budget_,
                                                       " are in use (snapshots, versions in flight, committed staging not applied yet)"));
    }
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
  }
  return std::shared_ptr<Charge>(new Charge(self_.lock(), bytes));
}

void StagingBudget::Release(int64_t bytes) {
  absl::MutexLock l(&mu_);
  in_use_ -= bytes;
}

int64_t StagingBudget::in_use() const {
  absl::MutexLock l(&mu_);
  return in_use_;
}

int64_t StagingBudget::peak() const {
  absl::MutexLock l(&mu_);
  return peak_;
}

}  // namespace wb::daemon
