#pragma once
// One byte-exact end-to-end run of preset layouts, shared by the tests of model families and
// presets (e2e_families_test, e2e_families2_test, e2e_fsdp2_tp_test): a fresh two-node cluster,
// trainers on n0, rollouts on n1, every rollout byte checked by the workers.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/e2e/cluster.h"

namespace wb::e2e {

struct PresetRun {
  std::string harness;  // the harness's name (its temp directory)
  std::string model_id;
  std::string config;  // file under tests/e2e/testdata/
  std::string mode;    // sync | one_step_off | async
  int versions = 3;
  std::vector<WorkerSpec> trainers, rollouts;  // presets resolved by the coordinator from the config
};

// Runs `r`. One-step-off trainers get a 300 ms training step: they do not wait for the rollouts,
// and an Apply(v) that finds v + 1 committed already applies the newest (docs/daemon.md), which
// would count as a skipped version. OK when every worker exited cleanly, CheckRolloutsApplied
// holds for the last version, and the rollouts together verified at least the model's bytes (the
// engine's ranks hold the whole model at least once; norms and replicated KV heads more often,
// vocabulary padding not verified); otherwise an error saying what failed (with the cluster's
// status when a worker failed).
absl::Status RunPresetCase(const PresetRun& r);

}  // namespace wb::e2e
