// rollout_worker: a rollout rank for end-to-end tests. Builds its layout from a preset (vllm or
// sglang), keeps its live weights in POSIX shared memory, and after every update checks EVERY
// byte of every piece against the canonical weights of the version it was told is live. Progress
// lines and exit codes: tests/e2e/worker_common.h.
//
// Per mode:
//   sync:          BeginUpdate (paused), WaitVersion(v) (committed = copied into live), verify v.
//   one_step_off:  generate a step with the current weights, then Apply(v) at the step boundary
//                  (may return a newer version), verify what was applied.
//   async:         generate a step, then Apply(newer than live) at the safe point, verify.
// With --tolerate_failures a failed version is reported ("version_failed") after checking that
// the live weights are still exactly the previous version (all zero before the first one).
#include <cstdio>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "tests/e2e/worker_common.h"

namespace wb::e2e {
namespace {

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
  while (v <= ctx.last_version) {
    if (ctx.mode != client::Mode::kSync && ctx.step > absl::ZeroDuration()) {
      absl::SleepFor(ctx.step);  // generation with the live weights
    }
    double t_start = MonotonicSeconds();
    uint64_t got = 0;
    double stall = 0;
    absl::Status status;
    if (ctx.mode == client::Mode::kSync) {
      status = ctx.client->BeginUpdate(ctx.version_timeout);
      if (status.ok()) {
        auto committed = ctx.client->WaitVersion(v, ctx.version_timeout);
        status = committed.status();
        if (status.ok()) got = *committed;
        stall = MonotonicSeconds() - t_start;
      }
    } else {
      // one_step_off asks for exactly the next version; async for anything newer than live.
      uint64_t want = ctx.mode == client::Mode::kOneStepOff ? v : live + 1;
      auto r = ctx.client->Apply(want, ctx.version_timeout);
      status = r.status();
      if (status.ok()) {
        got = r->applied_version;
        stall = r->stall_seconds;
      }
    }
    if (!status.ok()) {
      Emit(ctx, {{"event", "version_failed"}, {"version", v}, {"still", live},
                 {"code", absl::StatusCodeToString(status.code())},
                 {"message", std::string(status.message())}});
      std::fprintf(stderr, "%s: version %llu failed: %s\n", ctx.worker_id.c_str(),
                   static_cast<unsigned long long>(v), status.ToString().c_str());
      // Atomicity: whatever went wrong, the live weights must still be exactly `live`.
      if (!VerifyAndReport(ctx, live, "after_failure")) return kExitMismatch;
      if (!ctx.tolerate_failures) return kExitRpc;
      failed.push_back(v);
      ++v;
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
    Emit(ctx, {{"event", "applied"}, {"version", got}, {"requested", v}, {"t_start", t_start},
               {"stall_s", stall}, {"reconnects", ctx.client->reconnects()}});
    if (!VerifyAndReport(ctx, live, "applied")) return kExitMismatch;
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
