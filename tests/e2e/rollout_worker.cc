// rollout_worker: a rollout rank for end-to-end tests. Builds its layout from a preset (vllm or
// sglang), keeps its live weights in POSIX shared memory, and after every update checks EVERY
// byte of every piece against the canonical weights of the version it was told is live. Progress
// lines and exit codes: tests/e2e/worker_common.h.
//
// Per mode:
//   sync:          BeginUpdate (paused), WaitVersion(v) (committed = copied into live), verify v.
//   one_step_off:  generate a step with the current weights, then Apply(v) at the step boundary
//                  (may return a newer version), verify what was applied.
//   async:         generate a step, then Apply(v) at the safe point (waits for v or newer, applies
//                  the newest committed), verify what was applied. v is live + 1 after an applied
//                  version and the next one after a failed one: an aborted version is answered
//                  ABORTED at once, every time it is asked for (the node's record of the abort), so
//                  asking for live + 1 again would spin through the worker's versions without
//                  applying one (docs/soak.md, chaos_delta_test seeds 13, 39, 42, 44).
// With --tolerate_failures a failed version is reported ("version_failed") after checking that
// the live weights are still exactly the previous version (all zero before the first one).
// Sync: a failed BeginUpdate / WaitVersion is followed by EndUpdate before the weights are read,
// as RolloutHook.update does (the engine resumes; no later commit may write them while it reads),
// and EndUpdate's answer says which version they hold (a commit can land before the wait fails:
// a node killed after its copy, before its answer); a TORN answer (DATA_LOSS: the copy into
// them was cut short) is reported ("torn") and the weights are not checked until a version lands
// whole; an answer below the version held after the node restarted (it counts the weights as
// holding nothing) is checked against every version from the one held to the one waited for
// (whole, whichever). A failure that says nothing about the version (UNAVAILABLE: the node or coordinator is
// restarting) waits for the same version again, for up to --timeout_ms, instead of counting
// versions up on fast failures.
// Every mode: the live weights must not change while the engine generates (nothing may write them
// between the answer that named them and the next update call), so once they were verified they
// are verified again right before that call ("before_update"). Without it a write into them after
// the check went unseen (a stale call of a killed process copying the next version into its
// restarted successor's weights was seen only when it landed during the check).
#include <algorithm>
#include <cstdio>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "tests/e2e/worker_common.h"

namespace wb::e2e {
namespace {

// Sync: EndUpdate after a failed BeginUpdate / WaitVersion. Asked again while the node is away or
// a copy into the live weights still runs (UNAVAILABLE / DEADLINE_EXCEEDED), for up to the
// version timeout: until it answers, the weights may be written.
absl::StatusOr<client::EndUpdateResult> EndUpdateAfterFailure(WorkerContext& ctx) {
  const double until = MonotonicSeconds() + absl::ToDoubleSeconds(ctx.version_timeout);
  while (true) {
    absl::StatusOr<client::EndUpdateResult> ended = ctx.client->EndUpdate(ctx.version_timeout);
    const absl::StatusCode code = ended.status().code();
    const bool again = code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
    if (!again || MonotonicSeconds() > until) return ended;
    absl::SleepFor(absl::Milliseconds(100));
  }
}

int Run() {
  auto ctx_or = SetUpWorker(planner::Role::kRollout);
  if (!ctx_or.ok()) {
    EmitError("rollout", ctx_or.status());
    return ctx_or.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitRpc;
  }
  WorkerContext& ctx = *ctx_or;
  uint64_t live = 0;  // version in the live buffer (0 = never written)
  std::vector<uint64_t> applied, failed;
  uint64_t v = ctx.first_version;
  int reconnects_at_live = 0;  // the client's reconnects when `live` was last answered
  uint64_t retry_v = 0;  // the version asked for again after a transient failure, since retry_since
  double retry_since = 0;
  bool live_checked = false;  // `live` was verified whole since the last update call (not torn)
  while (v <= ctx.last_version) {
    if (ctx.mode != client::Mode::kSync && ctx.step > absl::ZeroDuration()) {
      absl::SleepFor(ctx.step);  // generation with the live weights
    }
    // Generation is over (sync: it ran after the last answer): the weights it read must still be
    // the version the daemon named.
    if (live_checked && !VerifyAndReport(ctx, live, "before_update")) return kExitMismatch;
    live_checked = false;
    double t_start = MonotonicSeconds();
    uint64_t got = 0;
    double stall = 0;
    absl::Status status;
    if (ctx.mode == client::Mode::kSync) {
      if (!ctx.gate_dir.empty()) {
        // Test pacing (--gate_dir given to a rollout): BeginUpdate of v goes when the test opens
        // its gate (e2e_restart_wait_test sends it while the coordinator is down).
        absl::Status gate = WaitForGate(absl::StrCat(ctx.gate_dir, "/begin-", v), std::max(ctx.version_timeout, absl::Minutes(10)));
        if (!gate.ok()) {
          EmitError(ctx.worker_id, gate);
          return kExitRpc;
        }
        Emit(ctx, {{"event", "begin_update"}, {"version", v}});
      }
      status = ctx.client->BeginUpdate(ctx.version_timeout);
      if (status.ok()) {
        auto committed = ctx.client->WaitVersion(v, ctx.version_timeout);
        status = committed.status();
        if (status.ok()) got = *committed;
        stall = MonotonicSeconds() - t_start;
      }
    } else {
      // one_step_off asks for exactly v; async for v or anything newer (v > live: below). Never a
      // version that already failed (async once asked for live + 1 again after each failure).
      auto r = ctx.client->Apply(v, ctx.version_timeout);
      status = r.status();
      if (status.ok()) {
        got = r->applied_version;
        stall = r->stall_seconds;
      }
    }
    if (!status.ok()) {
      bool torn = false;
      bool lost_track = false;  // the node restarted since: it counts the weights as holding nothing
      if (ctx.mode == client::Mode::kSync) {
        absl::StatusOr<client::EndUpdateResult> ended = EndUpdateAfterFailure(ctx);
        if (ended.status().code() == absl::StatusCode::kDataLoss) {
          torn = true;
        } else if (!ended.ok()) {
          // The weights may still be written: the engine must not resume on them.
          EmitError(ctx.worker_id, ended.status());
          return kExitRpc;
        } else if (ended->applied_version < live && ctx.client->reconnects() > reconnects_at_live) {
          lost_track = true;
        } else if (ended->applied_version < live) {
          EmitError(ctx.worker_id, absl::InternalError(absl::StrCat(
                                       "EndUpdate after a failed wait: live version went backwards from ",
                                       live, " to ", ended->applied_version)));
          return kExitMismatch;
        } else {
          live = ended->applied_version;  // a commit may have landed before the wait failed
        }
      }
      Emit(ctx, {{"event", "version_failed"}, {"version", v}, {"still", live}, {"torn", torn},
                 {"code", absl::StatusCodeToString(status.code())},
                 {"message", std::string(status.message())}});
      std::fprintf(stderr, "%s: version %llu failed: %s\n", ctx.worker_id.c_str(),
                   static_cast<unsigned long long>(v), status.ToString().c_str());
      // Atomicity: whatever went wrong, the live weights must still be exactly `live` (sync: the
      // whole version EndUpdate named), unless the node reported them torn.
      if (torn) {
        Emit(ctx, {{"event", "torn"}, {"version", v}, {"message", std::string(status.message())}});
      } else if (lost_track) {
        // Whole, whichever version: the one held before, or one whose commit landed before the
        // node went away (its answer lost with it).
        std::vector<uint64_t> candidates;
        for (uint64_t c = live; c <= std::max(v, live); ++c) candidates.push_back(c);
        std::optional<uint64_t> holds = VerifyOneOfAndReport(ctx, candidates, "after_failure");
        if (!holds.has_value()) return kExitMismatch;
        live = *holds;
        live_checked = true;
      } else if (!VerifyAndReport(ctx, live, "after_failure")) {
        return kExitMismatch;
      } else {
        live_checked = true;
      }
      if (!ctx.tolerate_failures) return kExitRpc;
      failed.push_back(v);
      if (retry_v != v) retry_v = v, retry_since = MonotonicSeconds();
      const bool transient = status.code() == absl::StatusCode::kUnavailable;
      if (!transient || MonotonicSeconds() - retry_since > absl::ToDoubleSeconds(ctx.version_timeout)) {
        // The failed version is given up (counted once, in `failed`); the next call asks for the
        // one after it, in every mode, so every failure moves v on and the loop ends.
        v = std::max(v + 1, live + 1);
      } else {
        absl::SleepFor(absl::Milliseconds(100));  // the node / coordinator is coming back: ask again
      }
      continue;
    }
    if (got < v && ctx.mode != client::Mode::kAsync) {
      EmitError(ctx.worker_id, absl::InternalError(absl::StrCat(
                                   "asked for version ", v, ", daemon reported ", got)));
      return kExitRpc;
    }
    if (got < live) {
      EmitError(ctx.worker_id, absl::InternalError(absl::StrCat(
                                   "live version went backwards from ", live, " to ", got)));
      return kExitMismatch;
    }
    live = got;
    reconnects_at_live = ctx.client->reconnects();
    Emit(ctx, {{"event", "applied"}, {"version", got}, {"requested", v}, {"t_start", t_start},
               {"stall_s", stall}, {"reconnects", ctx.client->reconnects()}});
    if (!VerifyAndReport(ctx, live, "applied")) return kExitMismatch;
    live_checked = true;
    applied.push_back(live);
    if (ctx.mode == client::Mode::kSync && ctx.step > absl::ZeroDuration()) {
      absl::SleepFor(ctx.step);  // generation after resuming
    }
    v = live + 1;
  }
  Emit(ctx, {{"event", "done"}, {"applied", applied}, {"failed", failed}, {"live", live},
             {"reconnects", ctx.client->reconnects()}});
  return kExitOk;
}

}  // namespace
}  // namespace wb::e2e

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "rollout_worker --socket=PATH --config=config.json --preset=vllm --tp=T --rank=R ...");
  absl::ParseCommandLine(argc, argv);
  return wb::e2e::Run();
}
