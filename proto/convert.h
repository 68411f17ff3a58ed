#pragma once
// weightbridge.v1 protos <-> planner value types: the ONE conversion library, used by the daemons
// (daemon/) and the clients (client/, wbctl). planner/ never sees a proto; this is the edge.
//
// Contract (what is validated where):
//
//  * FromProto / *FromProto take UNTRUSTED input (requests, files, another process) and return
//    absl::StatusOr. They check everything needed for the result to be a well-formed planner value
//    and fail with INVALID_ARGUMENT naming what is wrong (field, tensor, piece index, value):
//      - enums: a value the proto does not define; UNSPECIFIED takes the proto's documented default
//        where it has one (dtype -> bf16, strategy -> weightbridge), and is an error where it has
//        none (role, mode: the request must say);
//      - tensors: empty or duplicate names, a dimension <= 0 (a tensor has at least one element);
//      - boxes: begin and end of different ranks;
//      - pieces: a tensor name not in the inventory, a buffer id the layout did not declare,
//        box / strides rank different from the tensor's, quantisation fields without quant_dtype,
//        offsets beyond int64.
//    They do NOT check a layout against the model (boxes inside the tensor's shape, overlaps, bytes
//    inside the buffer, coverage): that is planner::ValidateLayout's job, on the converted value,
//    on the side that owns the model (the daemons). So a client may convert early and fail fast,
//    and the daemon is still the authority.
//  * ToProto / *ToProto take values WE produced (planner output, presets, a client's own config).
//    They cannot fail on such values and return the proto directly. The exception is
//    PieceToProto / PiecesToProto: a caller's hand-made planner::Piece may name a tensor index the
//    inventory lacks or a negative buffer / offset, so they return StatusOr.
//  * Buffers: a proto piece names its buffer by id, a planner piece by index. LayoutFromProto /
//    LayoutToProto map through the layout's BufferSpec list; PieceFromProto / PieceToProto (a
//    worker's own pieces, buffers registered as ids 0..n-1) use id == index.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/presets.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::convert {

namespace pb = ::weightbridge::v1;
using TensorSpecs = google::protobuf::RepeatedPtrField<pb::TensorSpec>;
using BufferSpecs = google::protobuf::RepeatedPtrField<pb::BufferSpec>;

// ---- enums ----

// A model's version mode as a worker-side value (design.md "Versions and modes").
enum class Mode : uint8_t { kSync, kOneStepOff, kAsync };
const char* ModeName(Mode mode);      // "sync", "one_step_off", "async"
const char* ModeName(pb::Mode mode);  // same names; UNSPECIFIED reads "sync" (the daemon's default)
absl::StatusOr<Mode> ParseMode(const std::string& name);
// The strategies the daemons execute, by name (owner_broadcast is planned, never executed).
absl::StatusOr<planner::Strategy> ParseStrategy(const std::string& name);

absl::StatusOr<planner::DType> FromProto(pb::DType dtype);
absl::StatusOr<planner::Role> FromProto(pb::Role role);
absl::StatusOr<Mode> FromProto(pb::Mode mode);
// Fails for strategies the daemons cannot execute.
absl::StatusOr<planner::Strategy> FromProto(pb::Strategy strategy);

pb::DType ToProto(planner::DType dtype);
pb::Role ToProto(planner::Role role);
pb::Mode ToProto(Mode mode);
// owner_broadcast has no proto value (never executed): UNSPECIFIED.
pb::Strategy ToProto(planner::Strategy strategy);
pb::Route ToProto(planner::Route route);

// ---- boxes and tensors ----

absl::StatusOr<planner::Box> FromProto(const pb::Box& box);
pb::Box ToProto(const planner::Box& box);
void ToProto(const planner::Box& box, pb::Box* out);

absl::StatusOr<planner::TensorSpec> FromProto(const pb::TensorSpec& spec);
pb::TensorSpec ToProto(const planner::TensorSpec& spec);

absl::StatusOr<planner::Inventory> InventoryFromProto(const TensorSpecs& tensors);
absl::StatusOr<planner::Inventory> FromProto(const pb::ExplicitInventory& inventory);
void InventoryToProto(const planner::Inventory& inventory, TensorSpecs* out);
pb::ExplicitInventory ToProto(const planner::Inventory& inventory);

// ---- pieces and layouts ----

// One piece, buffer id == buffer index (a worker's own pieces).
absl::StatusOr<planner::Piece> PieceFromProto(const pb::Piece& piece, const planner::Inventory& inventory);
absl::StatusOr<pb::Piece> PieceToProto(const planner::Piece& piece, const planner::Inventory& inventory);
absl::StatusOr<pb::ExplicitPieces> PiecesToProto(const std::vector<planner::Piece>& pieces,
                                                 const planner::Inventory& inventory);

// A resolved layout (pieces name tensors and buffer ids) -> planner layout (indices).
absl::StatusOr<planner::WorkerLayout> LayoutFromProto(const pb::ResolvedLayout& layout,
                                                      const planner::Inventory& inventory);
// Inverse; `buffers` supplies the ids / specs in buffer-index order (the layout was made for them).
void LayoutToProto(const planner::WorkerLayout& layout, const planner::Inventory& inventory,
                   const BufferSpecs& buffers, pb::ResolvedLayout* out);

// ---- parallel configs and plan statistics ----

// A preset's parallel config (0 = the preset's default of 1; etp 0 = tp). Every count (and the
// rank) over planner::kMaxPresetWorld is INVALID_ARGUMENT naming the field and the value sent.
// Shared by the coordinator (resolving presets) and the node (layout discovery), so both always
// describe the same layout.
absl::StatusOr<planner::ParallelConfig> ParallelFromProto(const pb::ParallelConfig& p);

void StatsToProto(const planner::PlanStats& stats, int num_buckets, pb::PlanStats* out);

// The plan's fields of one op (workers, pieces, tensor, box, bytes, route, sender_quantized,
// wire_bytes: 0 in the plan reads as `bytes`); the slicer adds index, bucket, nccl and staging.
void OpToProto(const planner::TransferOp& op, pb::TransferOp* out);

}  // namespace wb::convert
