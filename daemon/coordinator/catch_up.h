#pragma once
// Catch-up of late rollouts (issue 16.6, docs/daemon.md "Catch-up"): a rollout that registers or
// restarts after a version was committed is brought to that version from the copies other
// rollouts hold (committed staging, else live weights), without the trainer, before WaitVersion /
// Apply report the version to it.
//
// This header is the PURE part (no I/O, no locks): which rollouts are late and which may serve
// as sources. The driver side (CoordinatorCore::StartCatchUpLocked and friends) is in
// catch_up.cc; the node side reads a source rollout's copy where the executor gathers memory.

#include <cstdint>
#include <string>
#include <vector>

namespace wb::daemon {

// What the choice needs to know of one worker of the model.
struct CatchUpCandidate {
  std::string id, node;
  bool rollout = false;
  bool has_layout = false;
  bool in_plan = false;       // in the model's installed plan (a late rollout must be)
  uint64_t holds = 0;         // the committed version its node holds for it
  uint64_t catch_up_failed = 0;
  bool stale = false;         // holds the committed version, but a catch-up found its memory changed
};

struct CatchUpChoice {
  std::vector<std::string> sources;  // rollouts holding the committed version
  std::vector<std::string> dests;    // late rollouts to bring there
  // Late rollouts exist but no rollout holds the version: why (empty otherwise).
  std::string no_source;
};

// Late: a rollout with a layout, in the plan, holding less than `committed` (> 0) and whose catch-up
// did not already fail for `committed`. Source: a rollout with a layout holding exactly
// `committed`, in host or CUDA memory, unless a catch-up found its memory no longer holding it
// (`stale`: PlanSlice.certify). A quantised source's quantised pieces hold no canonical
// bytes: the catch-up plan (planner::PlanOptions::quantized_sources) has them serve only late
// rollouts quantised in their format, as copies of the quantised elements and scales, and takes
// everything else from unquantised pieces (or fails naming the box): docs/daemon.md "Catch-up".
// Both lists follow the candidates' order.
CatchUpChoice ChooseCatchUp(uint64_t committed, const std::vector<CatchUpCandidate>& workers);

}  // namespace wb::daemon
