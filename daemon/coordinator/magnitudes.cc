// CoordinatorCore: NVFP4 global scales across nodes (daemon/coordinator/magnitude_book.h;
// docs/daemon.md "Quantized targets"). A version's book is opened when it starts, for the nodes
// holding NVFP4 rollout pieces in its plan; each of them reports its parts' magnitudes before its
// ReportDone, and a node whose pieces do not cover their tensors waits for the others. The
// committed version's book is kept for catch-ups.
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "daemon/coordinator/core.h"
#include "daemon/log.h"

namespace wb::daemon {

void CoordinatorCore::StartMagnitudesLocked(const std::string& model_id, Model& m, uint64_t v) {
  // Books of versions that never finished are dead once a newer one starts; the committed
  // version's stays (a catch-up re-delivers it).
  const uint64_t committed = m.machine->committed();
  for (auto it = m.magnitudes.begin(); it != m.magnitudes.end();) {
    it = (it->first != committed || it->first >= v) ? m.magnitudes.erase(it) : std::next(it);
  }
  if (m.plan.magnitudes == nullptr || m.plan.magnitudes->held.empty()) return;
  m.magnitudes.emplace(v, MagnitudeBook(model_id, v, m.plan.magnitudes));
}

void CoordinatorCore::MagnitudesDoneLocked(Model& m, const std::string& node, uint64_t v) {
  auto book = m.magnitudes.find(v);
  if (book != m.magnitudes.end()) book->second.MarkDone(node);
}

absl::Status CoordinatorCore::ExchangeMagnitudes(const pb::ExchangeMagnitudesRequest& req, pb::ExchangeMagnitudesResponse* resp) {
  if (!req.coordinator_instance().empty() && req.coordinator_instance() != instance_) {
    return absl::FailedPreconditionError(absl::StrCat("version ", req.version(), " of model ", req.model_id(),
                                                      " was started by an earlier coordinator process"));
  }
  const absl::Time deadline = Deadline(req.timeout_ms());
  const uint64_t v = req.version();
  MagnitudeBook::Snap snap;
  std::shared_ptr<const planner::Inventory> inventory;
  {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(Model * m, models_.Get(req.model_id()));
    ModelRegistry::Held held(models_, *m);  // m is kept across the wait below
    auto book = m->magnitudes.find(v);
    if (req.catch_up()) {
      // Answered from the reports of the nodes that took the committed version (nothing added:
      // the late ranks' parts are those the others were quantised with).
      if (book == m->magnitudes.end() || v != m->machine->committed()) {
        return absl::NotFoundError(absl::StrCat("no NVFP4 magnitudes kept for version ", v, " of model ", req.model_id(),
                                                " (committed: ", m->machine->committed(), ")"));
      }
      snap = book->second.Snapshot();
      inventory = m->inventory;
    } else {
      const VersionRecord* rec = m->machine->Find(v);
      if (rec != nullptr && (rec->state == VState::kAborted || rec->state == VState::kSuperseded)) {
        return absl::AbortedError(absl::StrCat("version ", v, " of model ", req.model_id(), " ended (", VStateName(rec->state), ")",
                                               rec->error.empty() ? "" : ": ", rec->error));
      }
      if (rec == nullptr || rec->state != VState::kTransferring) {
        return absl::FailedPreconditionError(absl::StrCat("version ", v, " of model ", req.model_id(), " is not transferring (",
                                                          rec == nullptr ? "unknown" : VStateName(rec->state), ")"));
      }
      if (book == m->magnitudes.end()) {
        return absl::FailedPreconditionError(absl::StrCat("version ", v, " of model ", req.model_id(),
                                                          " has no NVFP4 rollout piece in its plan"));
      }
      RETURN_IF_ERROR(book->second.Add(req));
      if (!req.wait()) {
        for (const std::string& n : book->second.missing()) resp->add_missing_nodes(n);
        return absl::OkStatus();
      }
      auto state = [m, v]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        const VersionRecord* r = m->machine->Find(v);
        return r == nullptr ? VState::kAborted : r->state;
      };
      auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        auto b = m->magnitudes.find(v);
        return stopping_ || b == m->magnitudes.end() || b->second.complete() || state() == VState::kAborted ||
               state() == VState::kSuperseded;
      };
      if (!options_.clock->WaitUntil(&mu_, absl::Condition(&ready), deadline)) {
        auto b = m->magnitudes.find(v);
        return absl::DeadlineExceededError(absl::StrCat("version ", v, " of model ", req.model_id(), ": NVFP4 magnitudes of node(s) ",
                                                        b == m->magnitudes.end() ? "?" : absl::StrJoin(b->second.missing(), ", "),
                                                        " did not arrive in time"));
      }
      if (stopping_) return absl::UnavailableError("coordinator shutting down");
      book = m->magnitudes.find(v);
      if (book == m->magnitudes.end() || !book->second.complete()) {
        const VersionRecord* r = m->machine->Find(v);
        return absl::AbortedError(absl::StrCat("version ", v, " of model ", req.model_id(), " ended while waiting for NVFP4 magnitudes",
                                               r != nullptr && !r->error.empty() ? ": " : "", r != nullptr ? r->error : ""));
      }
      snap = book->second.Snapshot();
      inventory = m->inventory;
    }
  }
  MagnitudeBook::Answer(snap, *inventory, resp);  // coverage per tensor: outside the lock
  return absl::OkStatus();
}

}  // namespace wb::daemon
