#pragma once
// The pieces of a worker's resolved layout as the coordinator keeps them (docs/security.md, the
// size probe's entry): not as parsed protos (~370 bytes per piece, and a heap copy of the tensor
// name in each), but as one byte string, each piece serialized without its tensor name and the
// name kept as the tensor's index in the model's inventory (the names are the model's, shared by
// every piece and every rank: interned there). Slices and the plan cache key read the pieces back
// exactly as they were resolved (the same bytes, so the same slices and the same cache keys as
// when the parsed protos were kept); the planner reads planner::PackedLayout, kept beside this.
//
// Immutable once made; shared (shared_ptr) between the model registry and plan snapshots, read
// outside the coordinator's lock.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/packed_layout.h"
#include "planner/types.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

class StoredPieces {
 public:
  // `pieces` as resolved: each names a tensor of `inventory` (the conversion to `layout` checked
  // that; `layout` is the same pieces in the planner's form, whose tensor indices are the names'
  // interned form). A piece whose name is not its planner piece's tensor is kept with its name
  // (not expected; the bytes stay exact either way).
  static absl::StatusOr<std::shared_ptr<const StoredPieces>> Make(
      const google::protobuf::RepeatedPtrField<::weightbridge::v1::Piece>& pieces, const planner::PackedLayout& layout,
      std::shared_ptr<const planner::Inventory> inventory);

  int size() const { return count_; }
  // Bytes held (the encoded pieces), for what the coordinator keeps per piece.
  size_t bytes() const { return encoded_.size(); }

  // Appends the pieces to `out->pieces` as they were resolved. INTERNAL only if the bytes this
  // process encoded do not parse (they always do: a defect).
  absl::Status AppendTo(::weightbridge::v1::ResolvedLayout* out) const;
  // Appends what a ResolvedLayout holding only these pieces serializes to (so a ResolvedLayout's
  // buffers serialized followed by this is that whole layout serialized: field 1 before field 2).
  void AppendSerialized(std::string* out) const;

  // The same pieces (byte for byte as resolved), given the same inventory.
  bool operator==(const StoredPieces& other) const {
    return count_ == other.count_ && inventory_ == other.inventory_ && encoded_ == other.encoded_;
  }

 private:
  StoredPieces() = default;

  // Per piece: varint(tensor index + 1, or 0 when the name is kept in the piece's bytes),
  // varint(length), the piece's serialized bytes less its tensor field.
  std::string encoded_;
  int count_ = 0;
  std::shared_ptr<const planner::Inventory> inventory_;
};

}  // namespace wb::daemon
