// CoordinatorCore: ClusterStatus and the WatchStatus push stream.
#include <limits>

#include "absl/strings/str_cat.h"
#include "daemon/convert.h"
#include "daemon/coordinator/checks.h"
#include "daemon/coordinator/core.h"
#include "daemon/coordinator/status_budget.h"
#include "daemon/log.h"
#include "base/status_macros.h"

namespace wb::daemon {

// StatusRequest's filter: ids as other requests check them (INVALID_ARGUMENT), and known here
// (NOT_FOUND naming the id). Looked up with Find: reading a status does not count as using a model.
absl::Status CoordinatorCore::CheckStatusFilterLocked(const pb::StatusRequest& req) const {
  RETURN_IF_ERROR(CheckName("StatusRequest.model_id", req.model_id(), options_.max_name_bytes, true));
  RETURN_IF_ERROR(CheckName("StatusRequest.node_id", req.node_id(), options_.max_name_bytes, true));
  if (!req.model_id().empty() && models_.Find(req.model_id()) == nullptr) {
    return absl::NotFoundError(absl::StrCat("status filter: unknown model ", EchoValue(req.model_id())));
  }
  if (!req.node_id().empty() && nodes_.Find(req.node_id()) == nullptr) {
    return absl::NotFoundError(absl::StrCat("status filter: unknown node ", EchoValue(req.node_id())));
  }
  return absl::OkStatus();
}

namespace {

// What the budget keeps longest for a filtered status: what the filter asked for.
StatusKeep KeepFor(const pb::StatusRequest& filter) {
  if (!filter.model_id().empty()) return StatusKeep::kVersions;
  if (!filter.node_id().empty()) return StatusKeep::kNodeLists;
  return StatusKeep::kDefault;
}

}  // namespace

void CoordinatorCore::FillStatusLocked(const pb::StatusRequest& filter, pb::StatusResponse* out) {
  const absl::Time now = options_.clock->Now();
  const std::string& only_model = filter.model_id();
  const std::string& only_node = filter.node_id();
  for (auto& [id, n] : nodes_) {
    if (!only_node.empty() && id != only_node) continue;
    pb::NodeStatus* ns = out->add_nodes();
    ns->set_node_id(id);
    ns->set_address(n.address);
    ns->set_data_address(n.data_address);
    ns->set_alive(n.alive);
    ns->set_draining(n.draining);
    ns->set_lease_left_ms(std::max<int64_t>(0, absl::ToInt64Milliseconds(n.lease_expiry - now)));
    for (const auto& [name, instance] : n.transport_instances) ns->add_transports(name);
    for (const std::string& nic : n.data_nics) ns->add_data_nics(nic);
    uint32_t count = 0;
    bool busy = false;
    for (auto& [mid, m] : models_) {
      for (auto& [w, rec] : m.workers) count += rec.node == id;
      busy |= m.machine->InFlightInvolves(id);
    }
    ns->set_num_workers(count);
    ns->set_drained(n.draining && !busy);
  }
  for (auto& [mid, m] : models_) {
    if (!only_model.empty() && mid != only_model) continue;
    const planner::Plan& plan = *m.plan.plan;
    pb::ModelStatus* ms = out->add_models();
    ms->set_model_id(mid);
    ms->set_mode(m.spec.mode());
    ms->set_strategy(m.spec.strategy());
    ms->set_committed_version(m.machine->committed());
    ms->set_plan_fingerprint(plan.fingerprint);
    ms->set_last_transfer_seconds(m.last_seconds);
    ms->set_last_transfer_bytes(m.last_bytes);
    ms->set_last_transfer_gbps(m.last_seconds > 0 ? m.last_bytes / m.last_seconds / 1e9 : 0);
    ms->set_num_trainer_workers(m.spec.num_trainer_workers());
    ms->set_num_rollout_workers(m.spec.num_rollout_workers());
    ms->set_max_staleness(m.spec.max_staleness());
    ms->set_draining(cluster_draining_ || m.machine->draining());
    ms->set_plan_error(m.plan_error);  // e.g. a trainer layout with a hole (NODE helper, issue 15.13)
    uint32_t nt = 0, nr = 0;
    for (auto& [w, rec] : m.workers) {
      if (!rec.has_layout) continue;
      (rec.role == planner::Role::kTrainer ? nt : nr) += 1;
    }
    ms->set_registered_trainers(nt);
    ms->set_registered_rollouts(nr);
    StatsToProto(plan.stats, static_cast<int>(plan.buckets.size()), ms->mutable_plan_stats());
    for (auto& [w, rec] : m.workers) {
      if (!only_node.empty() && rec.node != only_node) continue;
      pb::WorkerStatus* ws = out->add_workers();
      ws->set_worker_id(w);
      ws->set_model_id(mid);
      ws->set_role(ToProto(rec.role));
      ws->set_node_id(rec.node);
      ws->set_applied_version(m.machine->Applied(w));
      ws->set_has_layout(rec.has_layout);
      ws->set_paused(m.machine->IsPaused(w));
      if (const LeftOutRollout* lo = LeftOutLocked(m, w)) {
        // Not being caught up while left out: only once its BeginUpdate put it back in the plan.
        ws->set_left_out(true);
        ws->set_left_out_reason(lo->reason);
      } else if (rec.role == planner::Role::kRollout && rec.has_layout && rec.holds < m.machine->committed()) {
        // Late (docs/daemon.md "Catch-up"): being caught up, or why its catch-up failed.
        ws->set_catching_up(rec.catch_up_failed != m.machine->committed());
        ws->set_catch_up_error(rec.catch_up_error);
      } else if (rec.stale_version != 0 && rec.stale_version == m.machine->committed()) {
        ws->set_catch_up_error(rec.stale_error);  // a source that serves the version no more
      }
    }
    for (auto& [v, rec] : m.machine->records()) {
      pb::VersionStatus* vs = out->add_versions();
      vs->set_model_id(mid);
      vs->set_version(v);
      vs->set_state(VStateName(rec.state));
      vs->set_bytes_total(rec.bytes_total);
      uint64_t done = 0;
      auto p = m.progress.find(v);
      if (p != m.progress.end()) for (auto& [n, b] : p->second) done += b;
      vs->set_bytes_done(rec.state == VState::kCommitted ? rec.bytes_total : std::min(done, rec.bytes_total));
      if (rec.started != absl::InfinitePast()) {
        absl::Time end = rec.finished != absl::InfinitePast() ? rec.finished : now;
        vs->set_seconds(absl::ToDoubleSeconds(end - rec.started));
      }
      vs->set_error(rec.error);
      // A started version: the plan it ran (the model's plan may have changed since, e.g. a sync
      // rollout left out of it and back: issue H115); a queued one: the plan it would run now.
      vs->set_num_ops(rec.started != absl::InfinitePast() ? rec.num_ops : static_cast<uint32_t>(plan.stats.num_ops));
      if (auto d = m.verdicts.find(v); d != m.verdicts.end()) {
        vs->set_verified(d->second.verified);
        vs->set_ops_verified(d->second.ops_verified);
      }
      if (auto d = m.deltas.find(v); d != m.deltas.end()) {
        // Saturating: the figures are what nodes said, and a sum never wraps into a small number.
        auto add = [](uint64_t a, uint64_t b) { return b > std::numeric_limits<uint64_t>::max() - a ? std::numeric_limits<uint64_t>::max() : a + b; };
        for (const auto& [node, t] : d->second) {
          vs->set_delta_bytes(add(vs->delta_bytes(), t.stream));
          vs->set_delta_replaced_bytes(add(vs->delta_replaced_bytes(), t.replaced));
          vs->set_delta_fallback_bytes(add(vs->delta_fallback_bytes(), t.fallback));
        }
      }
    }
  }
}

// The filter narrows the status first; the byte budget trims what is left (so a status of one
// model is whole unless that model alone is over the budget).
absl::Status CoordinatorCore::ClusterStatus(const pb::StatusRequest& req, pb::StatusResponse* resp) {
  {
    absl::MutexLock l(&mu_);
    RETURN_IF_ERROR(CheckStatusFilterLocked(req));
    resp->set_role("coordinator");
    FillStatusLocked(req, resp);
  }
  FitStatus(resp, req);
  return absl::OkStatus();
}

// The status byte budget (status_budget.h), outside mu_: trimming reads the whole message again.
void CoordinatorCore::FitStatus(pb::StatusResponse* status, const pb::StatusRequest& filter) const {
  if (options_.max_status_bytes <= 0) return;
  const StatusTrim trim = FitStatusToBudget(status, static_cast<size_t>(options_.max_status_bytes), KeepFor(filter));
  // Node ids, addresses and workers are never dropped: a status they alone make too big is sent as
  // it is; said in the log, at most once a minute (watchers rebuild every second).
  const int64_t now_s = absl::ToUnixSeconds(options_.clock->Now());
  int64_t warned = status_warned_at_s_.load();
  if (!trim.fits && now_s - warned >= 60 && status_warned_at_s_.compare_exchange_strong(warned, now_s)) {
    Log(LogLevel::kWarning, "status over its byte budget after trimming",
        {{"bytes", trim.bytes_after}, {"budget", options_.max_status_bytes}, {"nodes", status->nodes_size()},
         {"workers", status->workers_size()}});
  }
}

// A write to a client that stopped reading blocks on flow control and does not return by itself, so
// the stream's own deadline and cancel checks (after the write) never run: the stream held its
// watcher slot and a server thread until the client went away (security review: two such
// clients held both slots of max_status_watchers = 2 for as long as they liked). The watchdog
// calls `cancel` (the adapter's ServerContext::TryCancel, which makes a blocked write return
// false) once the stream is kWatchWriteGrace past its deadline, or that long after Shutdown(),
// and it is still running. A condition wait on mu_ with a deadline: no polling; it wakes at
// once when the stream ends. Real time, as the stream's deadline.
CoordinatorCore::WatchDog::WatchDog(CoordinatorCore* core, absl::Time deadline, const std::function<void()>& cancel)
    : core_(core) {
  if (!cancel) return;
  thread_ = std::thread([this, deadline, cancel] {
    bool fire = false;
    {
      absl::MutexLock l(&core_->mu_);
      auto over = [this]() ABSL_SHARED_LOCKS_REQUIRED(core_->mu_) { return done_ || core_->stopping_; };
      core_->mu_.AwaitWithDeadline(absl::Condition(&over), deadline + kWatchWriteGrace);
      if (!done_ && core_->stopping_) {
        // Shutdown: a stream in its wait ends UNAVAILABLE by itself; only a blocked write is cut.
        auto ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(core_->mu_) { return done_; };
        core_->mu_.AwaitWithDeadline(absl::Condition(&ended), absl::Now() + kWatchWriteGrace);
      }
      fire = !done_;
    }
    if (fire) cancel();
  });
}

CoordinatorCore::WatchDog::~WatchDog() {
  {
    absl::MutexLock l(&core_->mu_);
    done_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool CoordinatorCore::AwaitStatusWatchersAtMost(int n, absl::Time deadline) const {
  absl::MutexLock l(&mu_);
  auto few = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return status_watchers_ <= n; };
  return mu_.AwaitWithDeadline(absl::Condition(&few), deadline);
}

// Runs on real time (a client's stream and its cancellation are real-time things).
absl::Status CoordinatorCore::WatchStatus(const pb::WatchStatusRequest& req,
                                          const std::function<bool(const pb::StatusResponse&)>& write,
                                          const std::function<bool()>& cancelled, const std::function<void()>& cancel) {
  const absl::Duration timeout =
      req.timeout_ms() > 0 ? std::min(absl::Milliseconds(req.timeout_ms()), kWatchMaxTimeout) : kWatchDefaultTimeout;
  const absl::Time deadline = absl::Now() + timeout;
  {
    absl::MutexLock l(&mu_);
    if (stopping_) return absl::UnavailableError("coordinator shutting down");
    // The filter is checked once, at the start: a model removed later (eviction) leaves the
    // stream running, its messages without that model.
    RETURN_IF_ERROR(CheckStatusFilterLocked(req.request()));
    if (status_watchers_ >= options_.max_status_watchers) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "WatchStatus: ", status_watchers_, " status watchers open already (limit max_status_watchers = ",
          options_.max_status_watchers, "); use ClusterStatus or close a watcher"));
    }
    ++status_watchers_;
  }
  // The slot is freed however the stream ends (deadline, cancelled client, shutdown, write error).
  struct Slot {
    CoordinatorCore* c;
    ~Slot() {
      absl::MutexLock l(&c->mu_);
      --c->status_watchers_;
    }
  } slot{this};
  // Declared after `slot`: the watchdog is stopped and joined before the slot is freed, and before
  // the handler returns (`cancel` may touch the server's per-call context only while it runs).
  WatchDog watchdog(this, deadline, cancel);

  uint64_t seen = 0;
  bool first = true;
  std::string last_sent;
  absl::Time next_rebuild = absl::InfinitePast();
  while (true) {
    pb::StatusResponse status;
    bool built = false;
    {
      absl::MutexLock l(&mu_);
      if (!first) {
        // Wake on a change, on Shutdown, for the safety-net rebuild, at the stream's deadline, and
        // every kWatchCancelCheck to notice a client that went away (gRPC's sync API has no
        // cancellation callback that could signal mu_).
        auto changed = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || status_generation_ != seen; };
        const absl::Time wake = std::min({deadline, next_rebuild, absl::Now() + kWatchCancelCheck});
        mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
      }
      if (stopping_) return absl::UnavailableError("coordinator shutting down: status stream closed");
      // No write starts past the deadline: a stream that ends by itself ends within the
      // watchdog's grace, so the watchdog only ever cancels a write that flow control holds.
      if (!first && absl::Now() >= deadline) return absl::OkStatus();
      if (first || status_generation_ != seen || absl::Now() >= next_rebuild) {
        seen = status_generation_;
        status.set_role("coordinator");
        FillStatusLocked(req.request(), &status);
        built = true;
      }
    }
    if (cancelled()) return absl::CancelledError("status watcher went away");
    if (built) {
      FitStatus(&status, req.request());
      next_rebuild = absl::Now() + options_.status_resend;
      std::string bytes;
      status.SerializeToString(&bytes);
      // Deterministic enough for a change check: same fields in the same order from one process.
      if (first || bytes != last_sent) {
        if (!write(status)) return absl::CancelledError("status watcher went away (write failed)");
        last_sent = std::move(bytes);
      }
      first = false;
    }
    if (absl::Now() >= deadline) return absl::OkStatus();
  }
}

}  // namespace wb::daemon
