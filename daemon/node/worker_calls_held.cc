// node::WorkerCalls, part three: forwarded calls held while the node (re-)joins its coordinator or
// the coordinator is down (ForwardHeld, CoordinatorDown), Deregister, the leaves of exited workers
// and the owed leaves (see worker_calls.h).
#include <algorithm>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "daemon/log.h"
#include "daemon/node/deadlines.h"
#include "daemon/node/worker_calls.h"

namespace wb::daemon::node {

// Forwards a call about local worker `worker` to the coordinator (`call` gets the deadline).
// Held while the node (re-)registers and re-joins, so it reaches the session that knows the
// worker. NOT_FOUND from the coordinator (Publish, ReportReady, SubmitLayout) means it does not
// know the worker or model and recorded nothing: a restarted coordinator this node has not
// re-joined yet (or a lost lease). Then, once the node has re-joined (a new session: the worker
// was re-submitted), the call is sent again - never twice in one session, all within `deadline`.
// Returns the last answer; *sent_in = the session that attempt was sent in.
//
// With Hold::call, also an UNAVAILABLE / CANCELLED answer: the coordinator is down (killed, not
// yet restarted) or shutting down. Before, such a call answered at once and its client retried
// it blindly (chaos sync 1002, coordinator kills only: 28-53 BeginUpdate failures per rollout per
// run; a trainer or rollout restarting during a rolling restart failed its RegisterWorker). Now it
// waits, within `deadline`, for what the node's session learns: a re-join of a restarted
// coordinator (the call is sent there, after the re-join re-sent the node's workers and any pause
// it held) or the same coordinator answering heartbeats again (sent once more in that session).
// Only for calls the coordinator may record twice without harm - what the client's own retry
// would send; the first attempt may have been recorded before the answer was lost.
absl::Status WorkerCalls::ForwardHeld(const std::string& model, const std::string& worker, absl::Time deadline, uint64_t* sent_in,
                                     const std::function<absl::Status(absl::Time)>& call, const Hold& hold) {
  std::optional<absl::Time> held_from;  // the first answer that found the coordinator unreachable
  bool resent_in_session = false;       // an unreachable call re-sent to the same coordinator, once
  *sent_in = coordinator_.session();
  while (true) {
    if (!coordinator_.AwaitRegistered(deadline)) {
      return absl::UnavailableError(
          absl::StrCat("node ", options_.node_id, " is not registered with the coordinator (re-joining?); worker ", worker, " of model ", model));
    }
    *sent_in = coordinator_.session();
    absl::Status s = call(deadline);
    const bool unreachable = !hold.call.empty() && (absl::IsUnavailable(s) || absl::IsCancelled(s));
    const bool unknown_here = (hold.hold_not_found && absl::IsNotFound(s)) || (hold.hold_failed_precondition && absl::IsFailedPrecondition(s));
    if (!unknown_here && !unreachable) return s;
    if (unreachable && !held_from) {
      held_from = options_.clock->Now();
      Log(LogLevel::kInfo, "worker call held: the coordinator is unreachable",
          {{"node", options_.node_id}, {"worker", worker}, {"call", hold.call}, {"coordinator", options_.coordinator}, {"error", s.message()}});
    }
    if (!coordinator_.AwaitCoordinatorChange(*sent_in, deadline)) {
      if (!unreachable) return s;  // no re-join: the answer stands
      if (options_.clock->Now() >= deadline) {
        const std::string what = absl::StrCat(hold.call, " of worker ", worker, " of model ", model, " on node ", options_.node_id);
        return CoordinatorDown(what, s, held_from.value_or(options_.clock->Now()),
                               !hold.advice.empty() ? hold.advice : "the call may not be recorded there - call it again");
      }
      // The same coordinator answers heartbeats again (a stall, not a restart), or the node is
      // stopping (AwaitRegistered says so): sent once more, never in a loop.
      if (resent_in_session) return s;
      resent_in_session = true;
      Log(LogLevel::kInfo, "worker call sent again: the coordinator answers again",
          {{"node", options_.node_id}, {"worker", worker}, {"call", hold.call}, {"first_answer", s.message()}});
      continue;
    }
    resent_in_session = false;  // a new session
    if (hold.rejoined_worker && !local_.Has({model, worker})) {
      return absl::NotFoundError(absl::StrCat("worker ", worker, " of model ", model, " was not re-joined by node ", options_.node_id, " after ",
                                              local_.restart_reason(), ": register again"));
    }
    Log(LogLevel::kInfo, "worker call sent again after re-join",
        {{"node", options_.node_id}, {"worker", worker}, {"call", hold.call}, {"first_answer", s.message()}});
  }
}

absl::Status WorkerCalls::CoordinatorDown(const std::string& what, const absl::Status& last, absl::Time held_from,
                                          const std::string& advice) const {
  const absl::Time now = options_.clock->Now();
  // Since when: the node's heartbeats know best (the outage may have begun before this call);
  // else when this call first found it unreachable.
  absl::Time since = held_from;
  if (std::optional<absl::Time> beats = coordinator_.UnreachableSince(); beats && *beats < since) since = *beats;
  return absl::UnavailableError(absl::StrCat(
      what, ": the coordinator at ", options_.coordinator.empty() ? "(unknown address)" : options_.coordinator, " could not be reached since ",
      absl::FormatTime("%Y-%m-%d %H:%M:%E3S UTC", since, absl::UTCTimeZone()), " (", absl::FormatDuration(now - since), " ago; ", last.message(),
      ") and was not back within the call's timeout (held ", absl::FormatDuration(now - held_from), " for the node to re-join it); ", advice));
}

namespace {

// A leave the coordinator did not answer: no answer in time (it stalls), refused connections (it
// is down), or its server shut down under the call. It may come back as the same process.
bool Unanswered(const absl::Status& s) { return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsCancelled(s); }

}  // namespace

absl::Status WorkerCalls::SendLeave(const LocalWorkers::WorkerKey& key, const std::string& reason, absl::Duration timeout) {
  pb::LeaveWorkerRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(key.first);
  r.set_worker_id(key.second);
  r.set_reason(reason);
  pb::LeaveWorkerResponse rr;
  return coordinator_.client().LeaveWorker(r, &rr, timeout);
}

absl::Status WorkerCalls::Deregister(const pb::DeregisterRequest& req, absl::Duration time_left) {
  const absl::Time deadline = CallerDeadline(options_.clock, time_left);
  const LocalWorkers::WorkerKey key{req.model_id(), req.worker_id()};
  // Removed here first: a re-join from now on does not re-send it, so a coordinator the node
  // re-joins after this never hears of the worker.
  local_.Remove(key);
  if (publish_record_ != nullptr) publish_record_->Forget(key.first, key.second);
  const uint64_t session0 = coordinator_.session();
  uint64_t sent_in = 0;
  // Held while the coordinator is down (a worker leaving during a coordinator restart): a
  // LeaveWorker is harmless twice (a worker the coordinator does not have is no error there).
  absl::Status s = ForwardHeld(
      req.model_id(), req.worker_id(), deadline, &sent_in,
      [&](absl::Time dl) { return SendLeave(key, "deregistered", std::min(absl::Seconds(5), CallTimeout(options_.clock, dl))); },
      Hold{.call = "Deregister", .hold_not_found = false, .rejoined_worker = false, .advice = "the worker is removed on this node"});
  // Sent after a re-join: the restarted coordinator was not given the worker (removed here before
  // that re-join took its list), so its "unknown model" means nothing is left to leave.
  if (absl::IsNotFound(s) && sent_in != session0) return absl::OkStatus();
  if (!Unanswered(s)) return s;
  // Not answered by the deadline: the node owes the leave and sends it when the coordinator
  // answers again (SendOwedLeaves). Before, the caller was told to call Deregister again, and a
  // coordinator back from a stall kept the worker as a member until a re-join.
  switch (local_.OweLeave(key, "deregistered")) {
    case LocalWorkers::Owed::kKept:
      return absl::Status(s.code(), absl::StrCat(s.message(), "; node ", options_.node_id,
                                                 " owes the coordinator the worker's leave and sends it when the coordinator answers again (a "
                                                 "re-join of the node rebuilds the membership without the worker instead): no need to call "
                                                 "Deregister again"));
    case LocalWorkers::Owed::kSuperseded:
      return absl::Status(s.code(), absl::StrCat(s.message(), "; the worker registered again on node ", options_.node_id,
                                                 " meanwhile, which replaces its old registration at the coordinator"));
    case LocalWorkers::Owed::kFull:
      break;
  }
  return absl::Status(s.code(), absl::StrCat(s.message(), "; the coordinator may still count it (node ", options_.node_id, " owes it ",
                                             LocalWorkers::kMaxOwedLeaves, " leaves already): call Deregister again"));
}

// Why the leaves go to a sender thread: the liveness check runs on the node's control thread,
// which also re-registers and re-joins after a coordinator restart and runs the staging pool's
// tick. A leave to a coordinator that gives no answer held that thread for the leave's timeout
// (7 s; 5 s per owed leave re-sent), so a re-join waited behind it. Now the control tick only
// queues them and returns; the sender owes the ones that go unanswered, as before.
void WorkerCalls::LeaveExited() {
  std::vector<QueuedLeave> leaves;
  for (LocalWorkers::WorkerKey& key : local_.ReapExited()) {  // removed here, marked leaving
    leaves.push_back({std::move(key), "its process exited", absl::Seconds(7), /*owed=*/false});
  }
  QueueLeaves(std::move(leaves));
}

void WorkerCalls::SendOwedLeaves() {
  if (local_.OwedLeaves() == 0) return;
  // Only once the coordinator answers again: the node's heartbeats got an answer since the outage
  // and the node is registered, not re-joining (a re-join drops the owed leaves instead). A try
  // at a coordinator still away would only find it away.
  if (coordinator_.UnreachableSince().has_value() || !coordinator_.AwaitRegistered(options_.clock->Now())) return;
  std::vector<QueuedLeave> leaves;
  for (LocalWorkers::OwedLeave& o : local_.TakeOwedLeaves()) leaves.push_back({std::move(o.key), std::move(o.reason), absl::Seconds(5), true});
  QueueLeaves(std::move(leaves));
}

void WorkerCalls::QueueLeaves(std::vector<QueuedLeave> leaves) {
  if (leaves.empty()) return;
  std::thread ended;  // a sender that has run out of work: joined outside the lock (it is done)
  {
    absl::MutexLock l(&leaves_mu_);
    if (leaves_stopped_) {
      // The node is stopping: not sent. Owed, so that the ids are no longer marked leaving.
      for (const QueuedLeave& q : leaves) local_.OweLeave(q.key, q.reason);
      return;
    }
    for (QueuedLeave& q : leaves) queued_leaves_.push_back(std::move(q));
    if (sending_) return;  // the running sender takes them
    sending_ = true;
    ended = std::move(sender_);
    sender_ = std::thread([this] { SendQueuedLeaves(); });
  }
  if (ended.joinable()) ended.join();
}

void WorkerCalls::SendQueuedLeaves() {
  // Once one owed leave found the coordinator unreachable again, the owed ones after it stay owed
  // untried (SendOwedLeaves re-queues them when it answers again); an exited worker's first leave
  // is always tried, as the tick tried each before.
  bool unanswered = false;
  while (true) {
    QueuedLeave q;
    {
      absl::MutexLock l(&leaves_mu_);
      if (queued_leaves_.empty() || leaves_stopped_) {
        for (const QueuedLeave& left : queued_leaves_) local_.OweLeave(left.key, left.reason);  // stopping
        queued_leaves_.clear();
        sending_ = false;
        return;
      }
      q = std::move(queued_leaves_.front());
      queued_leaves_.pop_front();
    }
    absl::Status s = unanswered && q.owed ? absl::UnavailableError("not sent: the coordinator did not answer the leave before it")
                                          : SendLeave(q.key, q.reason, q.timeout);
    if (Unanswered(s)) {
      unanswered = true;
      // Best effort once was all an exited worker's leave got before owed leaves: a coordinator
      // back from a stall (the same process, no re-join) kept the worker as a member, holding
      // later versions that waited for it.
      const LocalWorkers::Owed owed = local_.OweLeave(q.key, q.reason);
      if (!q.owed) {
        Log(LogLevel::kWarning, "exited worker's leave owed: the coordinator did not answer",
            {{"node", options_.node_id}, {"model", q.key.first}, {"worker", q.key.second}, {"error", s.message()},
             {"kept", owed == LocalWorkers::Owed::kKept}});
      }
      continue;
    }
    // NOT_FOUND: the coordinator does not have the worker (any more): nothing left to leave.
    if (q.owed) {
      Log(LogLevel::kInfo, "owed leave sent",
          {{"node", options_.node_id}, {"model", q.key.first}, {"worker", q.key.second}, {"answer", s.ok() ? std::string("OK") : std::string(s.message())}});
    } else if (!s.ok()) {
      Log(LogLevel::kInfo, "exited worker's leave refused", {{"node", options_.node_id}, {"model", q.key.first}, {"worker", q.key.second}, {"error", s.message()}});
    }
    local_.LeaveDone(q.key);
  }
}

WorkerCalls::~WorkerCalls() { StopLeaves(); }

void WorkerCalls::StopLeaves() {
  std::thread sender;
  {
    absl::MutexLock l(&leaves_mu_);
    leaves_stopped_ = true;
    sender = std::move(sender_);
  }
  if (sender.joinable()) sender.join();  // a leave in flight ends within its timeout
}

bool WorkerCalls::AwaitLeavesSent(absl::Duration timeout) {
  absl::MutexLock l(&leaves_mu_);
  auto idle = [&]() ABSL_SHARED_LOCKS_REQUIRED(leaves_mu_) { return !sending_; };
  return leaves_mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

}  // namespace wb::daemon::node
