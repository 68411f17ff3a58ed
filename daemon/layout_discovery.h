#pragma once
// Layout discovery on the node daemon (WorkerService.DescribeLayout, RegisterLayoutResponse.layout;
// docs/integration.md): a model spec + a layout spec -> pb::LayoutDescription, through the pure
// planner/layout_info.h. The node computes it itself, from the spec it holds for the model (the
// coordinator's, kept when a worker of the model registered on this node) or from the spec in the
// request, so a worker can ask before it registers anything; the coordinator resolves presets with
// the same planner code (planner::MakePresetLayout), so both agree.
//
// Thread-safe. Parsed configs and inventories are cached per spec (a few entries), so describing
// many ranks of one big model (Kimi-K2: ~70k tensors) builds its inventory once.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "planner/layout_info.h"
#include "planner/model_config.h"
#include "planner/presets.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

namespace pb = ::weightbridge::v1;

// The description in proto form. `buffer_ids[i]` is the id of buffer index i (missing: i).
pb::LayoutDescription LayoutInfoToProto(const planner::LayoutInfo& info, const planner::Inventory& inventory,
                                        const std::vector<uint32_t>& buffer_ids, const std::string& source);

class LayoutDescriber {
 public:
  struct Model {
    std::optional<planner::ModelConfig> config;  // set for models from hf_config_json
    planner::Inventory inventory;
  };

  // The model's config and inventory from its spec (hf_config_json or explicit tensors), as the
  // coordinator builds them. INVALID_ARGUMENT naming the model for a spec without either.
  absl::StatusOr<std::shared_ptr<const Model>> ModelOf(const pb::ModelSpec& spec);

  // Describes `layout` of the model `spec`:
  //  - a preset: the framework's local tensors in buffer 0 (id `buffers[0].buffer_id` when given);
  //  - explicit pieces: one local tensor per piece. With `buffers` (RegisterLayout's), piece buffer
  //    ids must be among them; without, every id the pieces name is a buffer. Validated as
  //    `validate_as`'s layout with the described sizes (planner::ValidateLayout); nullopt: as a
  //    rollout's when a piece is quantised, else as a trainer's (bounds and shapes).
  // Index probes: FAILED_PRECONDITION (describe the pieces RegisterLayout resolved them to).
  // Errors keep the planner's message (the caller adds worker and model).
  // `worker` names the layout in validation errors.
  absl::StatusOr<pb::LayoutDescription> Describe(const pb::ModelSpec& spec, const pb::LayoutSpec& layout,
                                                 const std::vector<pb::BufferSpec>& buffers,
                                                 std::optional<planner::Role> validate_as, const std::string& worker = "layout");
  // The same with the planner-level result (wbctl layout prints from it too).
  absl::StatusOr<planner::LayoutInfo> DescribeInfo(const Model& model, const pb::LayoutSpec& layout,
                                                   const std::vector<pb::BufferSpec>& buffers,
                                                   std::optional<planner::Role> validate_as, std::vector<uint32_t>* buffer_ids,
                                                   const std::string& worker = "layout");

  // RegisterLayout, before any buffer is mapped or anything submitted: a preset's description,
  // with the registered buffers checked against it (INVALID_ARGUMENT "worker W of model M, preset
  // P rank R: buffer 0 needs N bytes, registered K ..."); nullopt for pieces and index probes.
  absl::StatusOr<std::optional<pb::LayoutDescription>> DescribePresetForRegister(const pb::ModelSpec& spec,
                                                                                 const pb::RegisterLayoutRequest& req);
  // RegisterLayout, once the coordinator accepted the layout: `resolved` (its pieces over the
  // registered buffers; index probes already turned into pieces) described, source "pieces" or
  // "index_probe".
  absl::StatusOr<pb::LayoutDescription> DescribeResolved(const pb::ModelSpec& spec, const pb::ResolvedLayout& resolved,
                                                         const std::string& source, planner::Role role, const std::string& worker);

 private:
  // Explicit pieces over `resolved`'s buffers: converted, described and validated (DescribeInfo).
  static absl::StatusOr<planner::LayoutInfo> DescribeResolvedPieces(const Model& model, const pb::ResolvedLayout& resolved,
                                                                    std::optional<planner::Role> validate_as, const std::string& worker);

  static constexpr size_t kCacheEntries = 8;
  absl::Mutex mu_;
  // (cache key, model), most recently used last.
  std::vector<std::pair<std::string, std::shared_ptr<const Model>>> cache_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon
