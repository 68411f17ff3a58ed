#include "daemon/node/coordinator_session.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/log.h"

namespace wb::daemon {
namespace {

// RegisterNode waits for a coordinator that is not up yet this long (plus 2 s for its answer).
constexpr absl::Duration kRegisterTimeout = absl::Seconds(12);

}  // namespace

CoordinatorSession::CoordinatorSession(Options options) : options_(std::move(options)) {}

CoordinatorSession::~CoordinatorSession() {
  Stop();
  options_.clock->Forget(&mu_);
}

absl::Status CoordinatorSession::Start() {
  if (absl::Status s = Register(); !s.ok()) return s;
  absl::MutexLock l(&mu_);
  if (stop_ || started_) return absl::FailedPreconditionError(absl::StrCat("node ", options_.node_id, ": session already started or stopped"));
  started_ = true;
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  control_ = std::thread([this] { ControlLoop(); });
  return absl::OkStatus();
}

void CoordinatorSession::Stop() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (control_.joinable()) control_.join();
}

absl::Status CoordinatorSession::Register() {
  pb::RegisterNodeResponse resp;
  absl::Status s = options_.client->RegisterNode(options_.registration, &resp, kRegisterTimeout);
  if (!s.ok()) return s;
  std::string reason;
  {
    absl::MutexLock l(&mu_);
    if (coordinator_instance_.empty()) {
      reason.clear();  // first registration
    } else if (coordinator_instance_ != resp.coordinator_instance()) {
      reason = absl::StrCat("the coordinator restarted (instance ", coordinator_instance_, " -> ", resp.coordinator_instance(), ")");
    } else {
      reason = absl::StrCat("node ", options_.node_id, " lost its lease at the coordinator and registered again");
    }
    incarnation_ = resp.incarnation();
    coordinator_instance_ = resp.coordinator_instance();
    if (resp.lease_ms() > 0) lease_ = absl::Milliseconds(resp.lease_ms());
    registered_ = true;
    unreachable_since_.reset();  // it answered
    rejoining_ = !reason.empty();
    if (!reason.empty()) last_change_ = reason;
  }
  if (!reason.empty()) {
    Log(LogLevel::kWarning, "node re-registered", {{"node", options_.node_id}, {"reason", reason}, {"incarnation", resp.incarnation()}});
    if (options_.rejoin) options_.rejoin(reason);
    absl::MutexLock l(&mu_);
    rejoining_ = false;
    session_ += 1;
  }
  return absl::OkStatus();
}

bool CoordinatorSession::AwaitRegistered(absl::Time deadline) {
  absl::MutexLock l(&mu_);
  auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || (registered_ && !rejoining_); };
  options_.clock->WaitUntil(&mu_, absl::Condition(&ready), deadline);
  return !stop_ && registered_ && !rejoining_;
}

uint64_t CoordinatorSession::session() {
  absl::MutexLock l(&mu_);
  return session_;
}

std::optional<std::string> CoordinatorSession::AwaitCoordinatorChange(uint64_t session0, absl::Time deadline) {
  absl::MutexLock l(&mu_);
  kick_ = true;
  const uint64_t ok0 = hb_ok_;
  // hb_ok_ moves by 2: a heartbeat that was already in flight when we kicked may be older than
  // the failure we are explaining.
  auto settled = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stop_ || session_ != session0 || (hb_ok_ >= ok0 + 2 && registered_ && !rejoining_);
  };
  options_.clock->WaitUntil(&mu_, absl::Condition(&settled), deadline);
  if (session_ != session0) return last_change_;
  return std::nullopt;
}

void CoordinatorSession::TrackProgress(const std::string& model_id, uint64_t version,
                                       std::weak_ptr<const std::atomic<uint64_t>> bytes_done) {
  absl::MutexLock l(&mu_);
  progress_[{model_id, version}] = std::move(bytes_done);
}

std::optional<absl::Time> CoordinatorSession::UnreachableSince() {
  absl::MutexLock l(&mu_);
  return unreachable_since_;
}

std::string CoordinatorSession::coordinator_instance() {
  absl::MutexLock l(&mu_);
  return coordinator_instance_;
}

absl::Duration CoordinatorSession::lease() {
  absl::MutexLock l(&mu_);
  return lease_;
}

void CoordinatorSession::HeartbeatLoop() {
  Clock* clock = options_.clock;
  absl::Time next = clock->Now();
  while (true) {
    pb::HeartbeatRequest req;
    absl::Duration rpc_timeout;
    {
      absl::MutexLock l(&mu_);
      auto due = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || kick_; };
      clock->WaitUntil(&mu_, absl::Condition(&due), next);
      if (stop_) return;
      kick_ = false;
      // Fixed rate from the previous beat's start: a slow beat does not push the next one back.
      // A kicked beat before its time is extra and leaves the schedule alone (each used to push
      // it one period on: a burst of failing worker calls silenced the node past its lease).
      const absl::Time now = clock->Now();
      if (now >= next) next = std::max(next + options_.heartbeat, now);
      if (!registered_) continue;  // the control thread registers
      req.set_node_id(options_.node_id);
      req.set_incarnation(incarnation_);
      for (auto it = progress_.begin(); it != progress_.end();) {
        std::shared_ptr<const std::atomic<uint64_t>> bytes = it->second.lock();
        if (!bytes) {
          it = progress_.erase(it);
          continue;
        }
        pb::VersionProgress* p = req.add_progress();
        p->set_model_id(it->first.first);
        p->set_version(it->first.second);
        p->set_bytes_done(bytes->load());
        ++it;
      }
      // A beat may be slow on a loaded machine; it is only late once the lease is in danger.
      rpc_timeout = std::max(options_.heartbeat, lease_ / 3);
    }
    if (options_.test_skip_heartbeat && options_.test_skip_heartbeat()) continue;
    pb::HeartbeatResponse resp;
    const absl::Time sent = clock->Now();
    absl::Status s = options_.client->Heartbeat(req, &resp, rpc_timeout);
    absl::MutexLock l(&mu_);
    // Any answer from the coordinator (NOT_FOUND included) ends an outage; no answer starts one.
    const bool unreachable = absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsCancelled(s);
    if (!unreachable) {
      unreachable_since_.reset();
    } else if (!unreachable_since_) {
      unreachable_since_ = sent;
    }
    if (s.ok() && req.incarnation() == incarnation_) {
      hb_ok_ += 1;
      if (resp.lease_ms() > 0) lease_ = absl::Milliseconds(resp.lease_ms());
    } else if (absl::IsNotFound(s) && req.incarnation() == incarnation_) {
      // The coordinator lost us (lease) or is a new process (restart): register and re-join.
      registered_ = false;
    }
  }
}

void CoordinatorSession::ControlLoop() {
  Clock* clock = options_.clock;
  while (true) {
    bool need_register = false;
    {
      absl::MutexLock l(&mu_);
      auto due = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || !registered_; };
      clock->WaitUntil(&mu_, absl::Condition(&due), clock->Now() + options_.heartbeat);
      if (stop_) return;
      need_register = !registered_;
    }
    if (options_.tick) options_.tick();
    if (!need_register) continue;
    absl::Status s = Register();
    if (!s.ok()) {
      Log(LogLevel::kWarning, "coordinator unreachable", {{"node", options_.node_id}, {"error", s.message()}});
      absl::MutexLock l(&mu_);
      auto stop = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; };
      clock->WaitUntil(&mu_, absl::Condition(&stop), clock->Now() + options_.heartbeat);
    }
  }
}

}  // namespace wb::daemon
