// trainer_worker: a trainer rank for end-to-end tests. Builds its layout from a preset (megatron
// or fsdp), keeps its weights in POSIX shared memory, and for each version fills every piece with
// the canonical weights of that version (tests/common/weight_gen.h) and publishes it. Progress lines
// and exit codes: tests/e2e/worker_common.h.
//
// Per mode:
//   sync:          fill v, Publish(v) (returns once the version no longer needs the buffers),
//                  WaitVersion(v) before touching the buffers again.
//   one_step_off:  fill v, Publish(v) (returns after the daemon's snapshot), go on computing v+1.
//   async:         as one_step_off; Publish blocks while a rollout lags more than max_staleness.
// A Publish refused because the node's limit of versions published and not yet committed is
// reached (RESOURCE_EXHAUSTED) is asked again once the newest published version landed (a
// "publish_limited" event), up to --timeout_ms; only then is the version counted failed.
#include <algorithm>
#include <cstdio>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/e2e/worker_common.h"

namespace wb::e2e {
namespace {

// How long a trainer waits for the test to open the gate of its next version (--gate_dir).
constexpr absl::Duration kGateTimeout = absl::Minutes(10);

int Run() {
  auto ctx_or = SetUpWorker(planner::Role::kTrainer);
  if (!ctx_or.ok()) {
    EmitError("trainer", ctx_or.status());
    return ctx_or.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitRpc;
  }
  WorkerContext& ctx = *ctx_or;
  std::vector<uint64_t> published, failed;
  for (uint64_t v = ctx.first_version; v <= ctx.last_version; ++v) {
    if (!ctx.gate_dir.empty()) {
      // Not the version deadline: the test opens the gate once its own checks of the previous
      // version are done, which on a loaded machine took longer than a deliberately short
      // --timeout_ms (the drain test's 10 s). The harness ends a worker whose gate never opens.
      absl::Status gate = WaitForGate(absl::StrCat(ctx.gate_dir, "/publish-", v), std::max(ctx.version_timeout, kGateTimeout));
      if (!gate.ok()) {
        EmitError(ctx.worker_id, gate);
        return kExitRpc;
      }
    }
    double fill_start = MonotonicSeconds();
    auto filled = FillPieces(ctx.inventory, ctx.preset.layout, ctx.memory, v);
    if (!filled.ok()) {
      EmitError(ctx.worker_id, filled.status());
      return kExitUsage;
    }
    if (absl::Status pushed = PushWeights(ctx); !pushed.ok()) {
      EmitError(ctx.worker_id, pushed);
      return kExitRpc;
    }
    Emit(ctx, {{"event", "filled"}, {"version", v}, {"bytes", *filled},
               {"fill_s", MonotonicSeconds() - fill_start}});
    if (ctx.step > absl::ZeroDuration()) absl::SleepFor(ctx.step);  // simulated training step

    double t_start = MonotonicSeconds();
    auto pub = ctx.client->Publish(v, ctx.version_timeout);
    absl::Status status = pub.status();
    // RESOURCE_EXHAUSTED: this trainer has as many versions published and not yet committed as
    // its node allows (--max_concurrent_versions; "wait for one"), e.g. while a transfer hangs
    // until the transfer deadline after a restart. Back-pressure, not a failed version: wait for
    // the newest version published to land (committed or aborted - either frees the slots up to
    // it) and publish the same version again, up to the version deadline. Counting it failed
    // instead let the trainers refuse-and-skip every remaining version within seconds of such a
    // hang and exit, so the last version never existed and every rollout waited for it
    // (chaos_delta_test, docs/soak.md).
    const absl::Time limit_deadline = absl::Now() + ctx.version_timeout;
    while (status.code() == absl::StatusCode::kResourceExhausted && !published.empty() && absl::Now() < limit_deadline) {
      Emit(ctx, {{"event", "publish_limited"}, {"version", v}, {"waits_for", published.back()},
                 {"code", absl::StatusCodeToString(status.code())}, {"message", std::string(status.message())}});
      const double wait_start = MonotonicSeconds();
      auto landed = ctx.client->WaitVersion(published.back(), limit_deadline - absl::Now());
      if (landed.status().code() == absl::StatusCode::kDeadlineExceeded) break;
      // Answered at once (already committed or aborted) yet the slot may still be taken: pace the
      // next ask instead of spinning on the node until the deadline.
      if (MonotonicSeconds() - wait_start < 0.1) absl::SleepFor(absl::Milliseconds(100));
      pub = ctx.client->Publish(v, std::max(absl::ZeroDuration(), limit_deadline - absl::Now()));
      status = pub.status();
    }
    if (status.ok()) {
      Emit(ctx, {{"event", "published"}, {"version", v}, {"t_start", t_start},
                 {"stall_s", pub->stall_seconds}, {"reconnects", ctx.client->reconnects()}});
      if (ctx.mode == client::Mode::kSync) {
        auto committed = ctx.client->WaitVersion(v, ctx.version_timeout);
        status = committed.status();
        if (status.ok()) Emit(ctx, {{"event", "committed"}, {"version", *committed}});
      }
    }
    if (!status.ok()) {
      Emit(ctx, {{"event", "publish_failed"}, {"version", v},
                 {"code", absl::StatusCodeToString(status.code())},
                 {"message", std::string(status.message())}});
      std::fprintf(stderr, "%s: version %llu failed: %s\n", ctx.worker_id.c_str(),
                   static_cast<unsigned long long>(v), status.ToString().c_str());
      if (!ctx.tolerate_failures) return kExitRpc;
      failed.push_back(v);
      continue;
    }
    published.push_back(v);
  }
  if (ctx.mode != client::Mode::kSync && !published.empty()) {
    // The run is complete once the last published version landed (or failed) everywhere.
    auto committed = ctx.client->WaitVersion(published.back(), ctx.version_timeout);
    if (committed.ok()) {
      Emit(ctx, {{"event", "committed"}, {"version", *committed}});
    } else {
      Emit(ctx, {{"event", "publish_failed"}, {"version", published.back()},
                 {"code", absl::StatusCodeToString(committed.status().code())},
                 {"message", std::string(committed.status().message())}});
      if (!ctx.tolerate_failures) return kExitRpc;
    }
  }
  Emit(ctx, {{"event", "done"}, {"published", published}, {"failed", failed},
             {"reconnects", ctx.client->reconnects()}});
  return kExitOk;
}

}  // namespace
}  // namespace wb::e2e

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trainer_worker --socket=PATH --config=config.json --preset=megatron|fsdp --rank=R ...");
  absl::ParseCommandLine(argc, argv);
  return wb::e2e::Run();
}
