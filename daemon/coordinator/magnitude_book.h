#pragma once
// NVFP4 global scales across nodes (docs/daemon.md "Quantized targets"). ModelOpt's per-tensor
// weight_scale_2 is the largest magnitude of the WHOLE tensor (unified over a fused layer's
// tensors), the same on every TP rank; a node quantising its rollouts' NVFP4 pieces only holds
// the parts of each tensor its ranks hold. Per version, the coordinator keeps a MagnitudeBook:
// every node holding NVFP4 rollout pieces in the plan reports (ExchangeMagnitudes) each tensor's
// largest magnitude over its part; once all of them reported, a tensor's magnitude is the largest
// over every part, and it is `whole` when the parts of the nodes that reported it cover the tensor
// (planner::BoxesCover). Which boxes a node holds comes from the plan (MagnitudePlan), never from
// the node's word: a node cannot claim a part it does not hold. The book of the committed version
// is kept so that a catch-up (a late rollout's ranks only) gets the magnitudes the other ranks
// were quantised with.
//
// Not thread-safe: the coordinator keeps one per version under its lock. Snapshot() hands the
// merged parts out copy-on-write, so the answer (coverage: BoxesCover per tensor, the costly
// part) is computed OUTSIDE the lock (Answer). A MagnitudePlan is made once per plan, outside the
// lock (MakeMagnitudePlan), and shared read-only by the plan's books.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "planner/packed_layout.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

// A worker of a plan as MakeMagnitudePlan sees it.
struct MagnitudeWorker {
  std::string node;
  bool rollout = false;
  const planner::PackedLayout* layout = nullptr;
};

// What a plan's nodes hold of NVFP4 tensors: per node holding NVFP4 rollout pieces (a global
// scale slot, planner::HasGlobalScales), per tensor, the canonical boxes of those pieces.
struct MagnitudePlan {
  std::map<std::string, std::map<int32_t, std::vector<planner::Box>>> held;
  std::map<std::string, int32_t> index;  // name -> inventory index of every tensor in `held`
};
std::shared_ptr<const MagnitudePlan> MakeMagnitudePlan(const std::vector<MagnitudeWorker>& workers, const planner::Inventory& inventory);

class MagnitudeBook {
 public:
  // Per tensor (inventory index): the largest magnitude over the parts reported, and the nodes
  // whose parts it covers.
  struct Part {
    float amax = 0.0f;
    std::set<std::string> nodes;
  };
  using Parts = std::map<int32_t, Part>;
  struct Snap {
    std::shared_ptr<const Parts> parts;
    std::shared_ptr<const MagnitudePlan> plan;
  };

  // The book waits for every node of `plan->held` (plan must not be null).
  MagnitudeBook(std::string model_id, uint64_t version, std::shared_ptr<const MagnitudePlan> plan);

  // Records one node's report. Reports only grow the merge (the largest magnitude, the nodes per
  // tensor), so a retried call is harmless. FAILED_PRECONDITION for a node holding no NVFP4 piece
  // in the plan; INVALID_ARGUMENT naming the tensor for one the node holds no NVFP4 piece of.
  // Nothing is recorded when any part is refused.
  absl::Status Add(const pb::ExchangeMagnitudesRequest& req);
  // The node reported the version done without its magnitudes (its report failed, or it runs an
  // older daemon): it counts as reported, with no parts, so no node waits for it any longer; the
  // tensors only it held stay partial in the answer. No-op for a node not in the book.
  void MarkDone(const std::string& node);

  bool complete() const { return reported_.size() == plan_->held.size(); }
  std::vector<std::string> missing() const;
  uint64_t version() const { return version_; }
  Snap Snapshot() const;

  // Fills resp->tensors from a snapshot: every tensor reported, its magnitude and whether the
  // reporting nodes' parts cover it. Pure; call it outside the coordinator's lock.
  static void Answer(const Snap& snap, const planner::Inventory& inventory, pb::ExchangeMagnitudesResponse* resp);

 private:
  std::string model_id_;
  uint64_t version_;
  std::shared_ptr<const MagnitudePlan> plan_;
  std::set<std::string> reported_;
  std::shared_ptr<Parts> parts_ = std::make_shared<Parts>();
  mutable bool shared_ = false;  // a snapshot of parts_ was handed out: the next Add copies first
};

}  // namespace wb::daemon
