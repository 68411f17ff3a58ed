#pragma once
// Shared code of the end-to-end test workers (trainer_worker, rollout_worker): flags, model and
// preset layout setup, connection to the node daemon, and machine-readable progress lines.
//
// Progress protocol: every event is ONE line on stdout holding one JSON object with at least
// "event", "worker" and "t" (CLOCK_MONOTONIC seconds, comparable across processes on a host).
// Events: "ready" (registered), "published", "publish_failed", "committed", "applied",
// "verified", "version_failed", "mismatch", "done", "error". The harness parses these lines;
// humans read stderr.
//
// Exit codes: 0 every version handled and every check passed; 1 an RPC failed (and failures were
// not tolerated); 2 bad flags or setup; 3 a byte did not match the expected version.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/worker_client.h"
#include "nlohmann/json.hpp"
#include "planner/inventory.h"
#include "planner/model_config.h"
#include "planner/presets.h"
#include "planner/types.h"
#include "tests/e2e/cuda_vmm_worker_buffer.h"
#include "tests/e2e/cuda_worker_buffer.h"
#include "tests/e2e/weights.h"

namespace wb::e2e {

inline constexpr int kExitOk = 0;
inline constexpr int kExitRpc = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitMismatch = 3;

// Everything a worker knows after setup.
struct WorkerContext {
  std::string worker_id;
  planner::Role role = planner::Role::kTrainer;
  client::Mode mode = client::Mode::kSync;
  planner::ModelConfig config;
  planner::Inventory inventory;
  planner::PresetLayout preset;  // this rank's layout (one buffer)
  std::unique_ptr<client::WorkerClient> client;
  MemoryView memory;
  // --memory=cuda / cuda_vmm: the weights live in `cuda` (on --gpu); `memory` views the host
  // mirror `host_mirror`, uploaded after each fill (PushWeights) and downloaded before each check
  // (cuda_vmm: the whole allocation, several buffers at their offsets in it; preset.layout then
  // holds the pieces over those buffers).
  std::unique_ptr<CudaWorkerBuffer> cuda;
  std::vector<uint8_t> host_mirror;
  int vmm_allocations = 0;       // cuda_vmm: allocations behind the weights
  int vmm_spanning_buffers = 0;  // cuda_vmm: buffers that cross an allocation boundary
  uint64_t first_version = 1;
  uint64_t last_version = 1;
  absl::Duration version_timeout;
  absl::Duration step;  // simulated compute (trainer) / generation (rollout) per step
  bool tolerate_failures = false;
  std::string gate_dir;  // trainer: wait for <gate_dir>/publish-<v> before publishing v; sync rollout: <gate_dir>/begin-<v>
};

// Reads the flags (declared in worker_common.cc), builds the inventory and this rank's preset
// layout, connects, registers the worker, creates its shm buffer and registers the layout.
absl::StatusOr<WorkerContext> SetUpWorker(planner::Role role);

// --memory=cuda: uploads the host mirror into the CUDA buffer (no-op for shm memory).
absl::Status PushWeights(const WorkerContext& ctx);

// Seconds on CLOCK_MONOTONIC.
double MonotonicSeconds();

// Prints one progress line (adds "worker" and "t").
void Emit(const WorkerContext& ctx, nlohmann::json event);
void EmitError(const std::string& worker, const absl::Status& status);

// Checks every byte of the rollout's pieces against `version`; emits "verified" or "mismatch".
// Returns false on any mismatch.
bool VerifyAndReport(const WorkerContext& ctx, uint64_t version, const std::string& why);

// Like VerifyAndReport, for a rollout whose daemon lost track of what its live weights hold (a
// node restarted: it counts them as holding nothing): checks them against each candidate in turn
// and emits "verified" (with "candidates") for the first they match whole, or "mismatch" against
// the first candidate when they match none (part of one version and part of another, say).
// Returns the version matched, nullopt when none.
std::optional<uint64_t> VerifyOneOfAndReport(const WorkerContext& ctx, const std::vector<uint64_t>& candidates,
                                             const std::string& why);

// Waits until `path` exists (inotify, bounded by `timeout`).
absl::Status WaitForGate(const std::string& path, absl::Duration timeout);

}  // namespace wb::e2e
