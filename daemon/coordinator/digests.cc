// CoordinatorCore: end-to-end digests of versions (issue 17.4; docs/daemon.md "End-to-end
// digests"). Every node reports, with ReportDone, the digests of what each op it sends read and of
// what each op it receives landed; a version commits only when no pair differs, and counts as
// verified when every op of its plan had both and they matched.
#include "absl/strings/str_cat.h"
#include "daemon/coordinator/core.h"
#include "daemon/log.h"
#include "daemon/metrics.h"

namespace wb::daemon {
namespace {

// The daemon's metrics (CoordinatorOptions::metrics), else the process default.
DaemonMetrics& MetricsOf(DaemonMetrics* injected) { return injected != nullptr ? *injected : Metrics(); }

}  // namespace

void CoordinatorCore::StartDigestsLocked(const std::string& model_id, Model& m, uint64_t v) {
  // Books of versions that never finished (aborted, superseded) are dead once a newer one starts.
  m.digests.erase(m.digests.begin(), m.digests.lower_bound(v));
  std::map<std::string, std::string> node_of;
  for (const auto& [id, rec] : m.workers) node_of[id] = rec.node;
  m.digests.erase(v);
  m.digests.emplace(v, DigestBook(model_id, v, m.plan.plan, m.plan.worker_ids, m.inventory, std::move(node_of)));
}

absl::Status CoordinatorCore::AddDigestsLocked(const std::string& model_id, Model& m, const pb::ReportDoneRequest& req) {
  auto book = m.digests.find(req.version());
  if (book == m.digests.end()) return absl::OkStatus();
  absl::Status s = book->second.Add(req);
  if (s.ok()) return s;
  const std::string node = options_.local_node.empty() ? std::string("coordinator") : options_.local_node;
  MetricsOf(options_.metrics).Version(node, model_id, "digest_mismatch");
  Log(LogLevel::kError, "version digest mismatch", {{"model", model_id}, {"version", req.version()}, {"node", req.node_id()}, {"error", s.message()}});
  m.digests.erase(book);
  return s;
}

void CoordinatorCore::FinishDigestsLocked(const std::string& model_id, Model& m, uint64_t v) {
  auto book = m.digests.find(v);
  if (book == m.digests.end()) return;
  const DigestVerdict verdict = book->second.Verdict();
  m.landed[v] = std::make_shared<const LandedRecord>(book->second.LandedByWorker());
  while (m.landed.size() > Model::kLandedKept) m.landed.erase(m.landed.begin());
  m.digests.erase(book);
  m.verdicts[v] = verdict;
  while (m.verdicts.size() > kVersionDetailsKept) m.verdicts.erase(m.verdicts.begin());
  if (verdict.verified) {
    MetricsOf(options_.metrics).Version(options_.local_node.empty() ? std::string("coordinator") : options_.local_node, model_id, "verified");
  }
  Log(LogLevel::kInfo, verdict.verified ? "version verified" : "version not fully verified",
      {{"model", model_id}, {"version", v}, {"ops_verified", static_cast<int64_t>(verdict.ops_verified)},
       {"ops", static_cast<int64_t>(verdict.ops_total)}});
}

}  // namespace wb::daemon
