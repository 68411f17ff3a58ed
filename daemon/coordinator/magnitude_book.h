#pragma once
// NVFP4 global scales across nodes (docs/daemon.md "Quantized targets"). ModelOpt's per-tensor
// weight_scale_2 is the largest magnitude of the WHOLE tensor (unified over a fused layer's
// tensors), the same on every TP rank; a node quantising its rollouts' NVFP4 pieces only holds
// the parts of each tensor its ranks hold. Per version, the coordinator keeps a MagnitudeBook:
// every node holding NVFP4 rollout pieces of the version reports (ExchangeMagnitudes) each
// tensor's largest magnitude over its part and the part's boxes; once all of them reported, a
// tensor's magnitude is the largest over every part, and it is `whole` when the parts' boxes cover
// the tensor (planner::BoxesCover). The book of the committed version is kept so that a catch-up
// (a late rollout's ranks only) gets the magnitudes the other ranks were quantised with.
//
// Not thread-safe: the coordinator keeps one per version under its lock. Snapshot() hands the
// merged parts out copy-on-write, so the answer (coverage: BoxesCover per tensor, the costly
// part) is computed OUTSIDE the lock (Answer).

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

class MagnitudeBook {
 public:
  // Per tensor (inventory index): the largest magnitude over the parts reported, and their boxes
  // (each distinct box once).
  struct Part {
    float amax = 0.0f;
    bool any = false;
    std::set<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes;  // (begin, end)
  };
  using Parts = std::map<int32_t, Part>;

  // `nodes`: the nodes holding NVFP4 rollout pieces of `version` (ExpectedNodes).
  MagnitudeBook(std::string model_id, uint64_t version, std::set<std::string> nodes, std::shared_ptr<const planner::Inventory> inventory);

  // Records one node's report (a second report of the node replaces nothing: magnitudes only
  // grow, boxes only add, so a retried call is harmless). FAILED_PRECONDITION for a node not
  // expected; INVALID_ARGUMENT naming the tensor for an unknown tensor, a box of the wrong rank
  // or outside the tensor, or more than kMaxBoxesPerTensor boxes of one tensor.
  absl::Status Add(const pb::ExchangeMagnitudesRequest& req);

  bool complete() const { return reported_.size() == nodes_.size(); }
  std::vector<std::string> missing() const;
  uint64_t version() const { return version_; }
  std::shared_ptr<const Parts> Snapshot() const { return parts_; }

  // Fills resp->tensors from a snapshot: every tensor reported, its magnitude and whether the
  // parts cover it. Pure; call it outside the coordinator's lock.
  static void Answer(const Parts& parts, const planner::Inventory& inventory, pb::ExchangeMagnitudesResponse* resp);

  static constexpr size_t kMaxBoxesPerTensor = 4096;

 private:
  std::string model_id_;
  uint64_t version_;
  std::set<std::string> nodes_, reported_;
  std::shared_ptr<const planner::Inventory> inventory_;
  std::map<std::string, int32_t> index_;  // tensor name -> inventory index (built on first Add)
  std::shared_ptr<Parts> parts_ = std::make_shared<Parts>();
};

// The nodes holding NVFP4 rollout pieces (a global scale slot) among `workers` (id -> node,
// role, layout): the ones a version's book waits for.
struct MagnitudeWorker {
  std::string node;
  bool rollout = false;
  const planner::WorkerLayout* layout = nullptr;
};
std::set<std::string> MagnitudeNodes(const std::vector<MagnitudeWorker>& workers);

}  // namespace wb::daemon
