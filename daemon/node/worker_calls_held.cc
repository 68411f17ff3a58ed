// node::WorkerCalls, part three: forwarded calls held while the node (re-)joins its coordinator or
// the coordinator is down (ForwardHeld, CoordinatorDown), and Deregister (see worker_calls.h).
#include <algorithm>
#include <optional>

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

absl::Status WorkerCalls::Deregister(const pb::DeregisterRequest& req, absl::Duration time_left) {
  const absl::Time deadline = CallerDeadline(options_.clock, time_left);
  // Removed here first: a re-join from now on does not re-send it, so a coordinator the node
  // re-joins after this never hears of the worker.
  local_.Remove({req.model_id(), req.worker_id()});
  pb::LeaveWorkerRequest r;
  r.set_node_id(options_.node_id);
  r.set_model_id(req.model_id());
  r.set_worker_id(req.worker_id());
  r.set_reason("deregistered");
  pb::LeaveWorkerResponse rr;
  const uint64_t session0 = coordinator_.session();
  uint64_t sent_in = 0;
  // Held while the coordinator is down (a worker leaving during a coordinator restart): a
  // LeaveWorker is harmless twice (a worker the coordinator does not have is no error there).
  absl::Status s = ForwardHeld(
      req.model_id(), req.worker_id(), deadline, &sent_in,
      [&](absl::Time dl) { return coordinator_.client().LeaveWorker(r, &rr, std::min(absl::Seconds(5), CallTimeout(options_.clock, dl))); },
      Hold{.call = "Deregister",
           .hold_not_found = false,
           .rejoined_worker = false,
           .advice = "the worker is removed on this node, but the coordinator may still count it: call Deregister again"});
  // Sent after a re-join: the restarted coordinator was not given the worker (removed here before
  // that re-join took its list), so its "unknown model" means nothing is left to leave.
  if (absl::IsNotFound(s) && sent_in != session0) return absl::OkStatus();
  return s;
}

}  // namespace wb::daemon::node
