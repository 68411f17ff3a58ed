#pragma once
// RL-loop stall simulation (bench/rl_sim): given a train-step time, a rollout (generation) time
// and, per weight-transfer strategy, the transfer time the planner's cost model predicts, simulate
// N steps of an RL loop in each mode and measure how long trainer and rollout GPUs are blocked by
// weight updates ("stall"). Pure: no I/O. See docs/rl_sim.md for the model and its assumptions.
//
// Model (one trainer group, one rollout group; a step = one batch generated, one optimizer step):
//  - sync: generate batch b with v(b-1) [R], train on it [T] -> v(b), update. Blocking strategies
//    and WeightBridge alike hold both sides for the transfer X (rollouts paused, bytes land in live
//    weights; the trainer keeps its buffers unchanged until done).
//  - one_step_off: batch b+1 is generated with v(b-1) while the trainer trains on batch b.
//  - async: the rollout generates back to back and takes the newest version at each batch boundary;
//    the trainer trains whenever the next batch is ready.
//  Blocking strategies (the open-source baselines: a collective gather + broadcast): an update is a
//  collective that holds the trainer and the rollout for X; in one_step_off it runs when both reach
//  their boundary, in async it interrupts generation at once.
//  WeightBridge (non-blocking, one_step_off/async): the trainer stalls only for the snapshot S_t;
//  the transfer runs in the background, one version at a time (a newer published version
//  supersedes a queued one); the rollout stalls for the apply copy S_r, plus (one_step_off only)
//  any time spent waiting for a version that has not arrived yet beyond what an instant transfer
//  would wait.
// Stall = time blocked by the update mechanism; waiting for the other side's data (inherent to the
// RL algorithm: trainer idle during generation in sync, etc.) is not counted.

#include <string>

namespace wb::bench {

enum class SimMode { kSync, kOneStepOff, kAsync };
const char* SimModeName(SimMode m);

struct SimParams {
  double train_s = 30;     // T: one optimizer step
  double rollout_s = 60;   // R: generating one batch
  double transfer_s = 1;   // X: one version's transfer (cost model makespan)
  double snapshot_s = 0;   // S_t: trainer-side snapshot copy (non-blocking strategy only)
  double apply_s = 0;      // S_r: rollout-side apply copy (non-blocking strategy only)
  bool blocking = true;    // baselines: true; WeightBridge: false
  int steps = 50;
};

struct SimResult {
  double trainer_stall_s = 0;  // per step
  double rollout_stall_s = 0;  // per step
  double step_s = 0;           // wall time per trainer step (steady state: total / steps)
  int versions_applied = 0;    // by the rollout (async may skip superseded ones)
};

SimResult SimulateLoop(SimMode mode, const SimParams& p);

}  // namespace wb::bench
