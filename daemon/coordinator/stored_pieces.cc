#include "daemon/coordinator/stored_pieces.h"

#include "absl/strings/str_cat.h"

namespace wb::daemon {
namespace {

namespace pb = ::weightbridge::v1;

// Protobuf wire tags: Piece.tensor (field 1) and ResolvedLayout.pieces (field 2), both
// length-delimited (wire type 2).
constexpr char kTensorTag = (1 << 3) | 2;
constexpr char kPiecesTag = (2 << 3) | 2;

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Reads a varint of encoded_ at *at (bytes this class wrote: always complete).
uint64_t GetVarint(const std::string& s, size_t* at) {
  uint64_t v = 0;
  for (int shift = 0; *at < s.size(); shift += 7) {
    const auto b = static_cast<uint8_t>(s[(*at)++]);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) break;
  }
  return v;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const StoredPieces>> StoredPieces::Make(const google::protobuf::RepeatedPtrField<pb::Piece>& pieces,
                                                                       const planner::PackedLayout& layout,
                                                                       std::shared_ptr<const planner::Inventory> inventory) {
  if (static_cast<size_t>(pieces.size()) != layout.num_pieces() || inventory == nullptr) {
    return absl::InternalError(absl::StrCat("stored layout: ", pieces.size(), " pieces resolved, ", layout.num_pieces(),
                                            " in the planner's form", inventory == nullptr ? ", no inventory" : ""));
  }
  std::shared_ptr<StoredPieces> out(new StoredPieces());
  out->count_ = pieces.size();
  std::string piece_bytes;
  for (int i = 0; i < pieces.size(); ++i) {
    const pb::Piece& p = pieces[i];
    piece_bytes.clear();
    if (!p.SerializeToString(&piece_bytes)) return absl::InternalError(absl::StrCat("stored layout: piece ", i, " does not serialize"));
    // A parsed message serializes its fields in field-number order (unknown fields last), so a
    // piece with a name starts with it: field 1, its length, the name. Kept without it, the name
    // comes back from the inventory.
    const int32_t t = layout.tensor(static_cast<size_t>(i));
    const std::string& name = p.tensor();
    size_t skip = 0;
    if (!name.empty() && t >= 0 && static_cast<size_t>(t) < inventory->tensors.size() && inventory->tensors[t].name == name) {
      std::string prefix(1, kTensorTag);
      PutVarint(name.size(), &prefix);
      prefix += name;
      if (piece_bytes.compare(0, prefix.size(), prefix) == 0) skip = prefix.size();
    }
    PutVarint(skip > 0 ? static_cast<uint64_t>(t) + 1 : 0, &out->encoded_);
    PutVarint(piece_bytes.size() - skip, &out->encoded_);
    out->encoded_.append(piece_bytes, skip, std::string::npos);
  }
  out->encoded_.shrink_to_fit();
  out->inventory_ = std::move(inventory);
  return std::shared_ptr<const StoredPieces>(std::move(out));
}

absl::Status StoredPieces::AppendTo(pb::ResolvedLayout* out) const {
  out->mutable_pieces()->Reserve(out->pieces_size() + count_);
  size_t at = 0;
  for (int i = 0; i < count_; ++i) {
    const uint64_t tensor = GetVarint(encoded_, &at);
    const uint64_t len = GetVarint(encoded_, &at);
    pb::Piece* p = out->add_pieces();
    if (at + len > encoded_.size() || !p->ParseFromArray(encoded_.data() + at, static_cast<int>(len))) {
      return absl::InternalError(absl::StrCat("stored layout: piece ", i, " of ", count_, " does not parse"));
    }
    at += len;
    if (tensor > 0) p->set_tensor(inventory_->tensors[tensor - 1].name);
  }
  return absl::OkStatus();
}

void StoredPieces::AppendSerialized(std::string* out) const {
  size_t at = 0;
  for (int i = 0; i < count_; ++i) {
    const uint64_t tensor = GetVarint(encoded_, &at);
    const uint64_t len = GetVarint(encoded_, &at);
    const std::string* name = tensor > 0 ? &inventory_->tensors[tensor - 1].name : nullptr;
    const uint64_t piece_len = len + (name != nullptr ? 1 + VarintSize(name->size()) + name->size() : 0);
    out->push_back(kPiecesTag);
    PutVarint(piece_len, out);
    if (name != nullptr) {
      out->push_back(kTensorTag);
      PutVarint(name->size(), out);
      out->append(*name);
    }
    out->append(encoded_, at, len);
    at += len;
  }
}

}  // namespace wb::daemon
