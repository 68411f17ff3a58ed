#pragma once
// Helpers shared by the end-to-end tests: reading worker progress events, and the expectations
// every run must meet (clean exits, no mismatch, every byte of every version verified).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/harness.h"

namespace wb::e2e {

// Events of `p` named `event`.
std::vector<nlohmann::json> EventsNamed(const Process* p, const std::string& event);

// OK when `p` exits 0 within `timeout`; otherwise an error carrying its log tail.
absl::Status ExpectCleanExit(const Process* p, absl::Duration timeout);

// Sum of the "bytes" of rollout `p`'s "verified" events for `version` with why == "applied".
int64_t VerifiedBytes(const Process* p, uint64_t version);
// Canonical elements the rollout checked for `version` (quantised pieces count their elements,
// not their stored bytes): from its "verified" events with why = "applied".
int64_t VerifiedElements(const Process* p, uint64_t version);

// One version's update window from the workers' events: `start` = the latest of every trainer's
// publish start ("published" t_start) and every rollout's pause / apply start ("applied"
// t_start), `end` = the latest "committed" (trainers) or "applied" (rollouts) time; and the
// largest publish (trainer) and apply (rollout) stalls. A version can start once every trainer
// published it and every rollout paused for it, and is done when every worker saw it committed
// (timing from the trainers' publish alone would count the rollouts' byte checking of the
// previous version, which the test adds, not the system).
struct VersionWindow {
  double start = -1, end = -1;
  double publish_stall_s = 0, apply_stall_s = 0;
  double seconds() const { return start >= 0 && end >= start ? end - start : 0; }
};
VersionWindow UpdateWindow(const std::vector<Process*>& trainers, const std::vector<Process*>& rollouts, uint64_t version);

// Median of `v` (0 when empty).
double Median(std::vector<double> v);

// Path of the test model config (the reduced 2-layer Qwen2.5-0.5B unless `full`; in sanitizer
// builds, the same family with a smaller vocabulary and MLP, testdata/README.md).
std::string ModelConfigPath(bool full = false);

// kTimeScale / Scaled / ScaledMs (sanitizer builds): harness.h.

// Total bytes (bf16) of the model's canonical tensors.
int64_t ModelBytes(const std::string& config_path);

// What every rollout of a finished run must show: no "mismatch" event, applied versions rising
// (one by one unless `mode` is "async", where superseded versions may be skipped) and ending on
// `last`, some bytes of `last` verified. OK, or an error naming each rollout and what it showed;
// `verified` (if not null) gets the bytes of `last` verified over all of them.
absl::Status CheckRolloutsApplied(const std::vector<Process*>& rollouts, const std::string& mode, uint64_t last, int64_t* verified);

}  // namespace wb::e2e
