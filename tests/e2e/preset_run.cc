#include "tests/e2e/preset_run.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/harness.h"

namespace wb::e2e {

absl::Status RunPresetCase(const PresetRun& r) {
  absl::StatusOr<std::unique_ptr<Harness>> harness = Harness::Create(r.harness);
  if (!harness.ok()) return harness.status();
  ClusterOptions options;
  options.num_nodes = 2;
  absl::StatusOr<std::unique_ptr<Cluster>> cluster = Cluster::Start(harness->get(), options);
  if (!cluster.ok()) return cluster.status();
  Cluster& cl = **cluster;

  RunOptions run;
  run.config = Runfile("tests/e2e/testdata/" + r.config);
  run.model_id = r.model_id;
  run.mode = r.mode;
  run.versions = r.versions;
  run.timeout_ms = ScaledMs(60000);
  run.layout_source = "preset";  // the coordinator resolves the presets from the config
  std::vector<WorkerSpec> trainers = r.trainers;
  if (r.mode == "one_step_off") {
    for (WorkerSpec& t : trainers) t.step_ms = 300;
  }
  absl::StatusOr<Cluster::RunResult> result = cl.RunWorkers(run, trainers, r.rollouts);
  if (!result.ok()) return result.status();
  if (!result->failures.empty()) {
    std::vector<std::string> failed;
    for (const absl::Status& s : result->failures) failed.push_back(s.ToString());
    auto st = cl.Status();
    return absl::InternalError(absl::StrCat(absl::StrJoin(failed, "\n"), "\ncluster status at failure: ",
                                            st.ok() ? st->DebugString() : st.status().ToString()));
  }
  const uint64_t last = static_cast<uint64_t>(run.versions);
  int64_t verified = 0;
  if (absl::Status applied = CheckRolloutsApplied(result->rollouts, r.mode, last, &verified); !applied.ok()) return applied;
  const int64_t model_bytes = ModelBytes(run.config);
  if (model_bytes <= 0) return absl::InternalError(absl::StrCat("no model bytes in ", run.config));
  if (verified < model_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("the rollouts verified ", verified, " bytes of version ", last, ", less than the model's ", model_bytes));
  }
  return absl::OkStatus();
}

}  // namespace wb::e2e
