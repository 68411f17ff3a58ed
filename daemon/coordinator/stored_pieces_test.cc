// The coordinator's stored form of a worker's resolved pieces: what it gives back is byte for byte
// what was resolved, and it keeps each tensor name once per model, not once per piece.
#include "daemon/coordinator/stored_pieces.h"

#include "daemon/convert.h"
#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

namespace pb = ::weightbridge::v1;

const std::string kLongName = "model.layers.17.mlp.experts.123.gate_up_proj.weight";

std::shared_ptr<const planner::Inventory> TwoTensors() {
  auto inv = std::make_shared<planner::Inventory>();
  inv->tensors.push_back({kLongName, {1024, 8}, planner::DType::kBF16});
  inv->tensors.push_back({"w", {4, 256}, planner::DType::kBF16});
  return inv;
}

// `n` one-row pieces of the long-named tensor, then a quantised piece of "w" with an NVFP4 global
// scale, buffer ids 7 and 9.
pb::ResolvedLayout Resolved(int n) {
  pb::ResolvedLayout l;
  for (uint32_t id : {7u, 9u}) {
    pb::BufferSpec* b = l.add_buffers();
    b->set_buffer_id(id);
    b->set_size_bytes(1 << 20);
    b->set_shm_name("/wb-test");
  }
  for (int i = 0; i < n; ++i) {
    pb::Piece* p = l.add_pieces();
    p->set_tensor(kLongName);
    p->mutable_box()->add_begin(i);
    p->mutable_box()->add_begin(0);
    p->mutable_box()->add_end(i + 1);
    p->mutable_box()->add_end(8);
    p->set_buffer_id(7);
    p->set_offset_bytes(static_cast<uint64_t>(i) * 16);
    p->add_strides(8);
    p->add_strides(1);
  }
  pb::Piece* q = l.add_pieces();
  q->set_tensor("w");
  q->mutable_box()->add_begin(0);
  q->mutable_box()->add_begin(0);
  q->mutable_box()->add_end(4);
  q->mutable_box()->add_end(256);
  q->set_buffer_id(9);
  q->add_strides(128);
  q->add_strides(1);
  q->set_quant_dtype(pb::DTYPE_F4_E2M1);
  q->add_quant_block(1);
  q->add_quant_block(16);
  q->set_scale_buffer_id(9);
  q->set_scale_offset_bytes(512);
  q->set_quant_scale_dtype(pb::DTYPE_F8_E4M3);
  q->set_quant_global_scale_offset(0);
  return l;
}

std::string PiecesOnly(const pb::ResolvedLayout& l) {
  pb::ResolvedLayout p;
  *p.mutable_pieces() = l.pieces();
  return p.SerializeAsString();
}

TEST(StoredPiecesTest, GivesBackTheResolvedPiecesByteForByte) {
  auto inv = TwoTensors();
  const pb::ResolvedLayout resolved = Resolved(100);
  absl::StatusOr<planner::WorkerLayout> layout = LayoutFromProto(resolved, *inv);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto stored = StoredPieces::Make(resolved.pieces(), *planner::PackedLayout::Pack(*layout), inv);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ((*stored)->size(), 101);

  // Into a slice's layout after its buffers: the whole resolved layout.
  pb::ResolvedLayout back;
  *back.mutable_buffers() = resolved.buffers();
  ASSERT_TRUE((*stored)->AppendTo(&back).ok());
  EXPECT_EQ(back.SerializeAsString(), resolved.SerializeAsString());
  EXPECT_EQ(back.pieces(0).tensor(), kLongName);
  EXPECT_EQ(back.pieces(100).tensor(), "w");
  EXPECT_TRUE(back.pieces(100).has_quant_global_scale_offset());

  // Serialized (the plan cache key): the buffers' bytes then these are the whole layout's bytes.
  std::string bytes;
  (*stored)->AppendSerialized(&bytes);
  EXPECT_EQ(bytes, PiecesOnly(resolved));
  pb::ResolvedLayout buffers;
  *buffers.mutable_buffers() = resolved.buffers();
  EXPECT_EQ(buffers.SerializeAsString() + bytes, resolved.SerializeAsString());
}

TEST(StoredPiecesTest, KeepsTensorNamesOncePerModelNotOncePerPiece) {
  auto inv = TwoTensors();
  const int n = 10000;
  const pb::ResolvedLayout resolved = Resolved(n);
  absl::StatusOr<planner::WorkerLayout> layout = LayoutFromProto(resolved, *inv);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto stored = StoredPieces::Make(resolved.pieces(), *planner::PackedLayout::Pack(*layout), inv);
  ASSERT_TRUE(stored.ok()) << stored.status();
  const size_t serialized = PiecesOnly(resolved).size();
  // Each of the n pieces would carry the 51-byte name (53 with its tag and length); kept, each
  // costs its tensor index instead (1 byte here) and nothing else beyond the serialized piece.
  const size_t names = static_cast<size_t>(n) * (kLongName.size() + 2);
  EXPECT_LE((*stored)->bytes(), serialized - names + static_cast<size_t>(n)) << "serialized " << serialized;
  EXPECT_LT((*stored)->bytes() * 3, serialized) << "the name dominates each piece: a third or less is kept";
}

TEST(StoredPiecesTest, APieceNotNamedAsItsPlannerTensorKeepsItsNameAndStaysExact) {
  auto inv = TwoTensors();
  const pb::ResolvedLayout resolved = Resolved(3);
  absl::StatusOr<planner::WorkerLayout> layout = LayoutFromProto(resolved, *inv);
  ASSERT_TRUE(layout.ok()) << layout.status();
  layout->pieces[1].tensor = 1;  // not the name's tensor: its name is kept in its bytes
  auto stored = StoredPieces::Make(resolved.pieces(), *planner::PackedLayout::Pack(*layout), inv);
  ASSERT_TRUE(stored.ok()) << stored.status();
  pb::ResolvedLayout back;
  ASSERT_TRUE((*stored)->AppendTo(&back).ok());
  EXPECT_EQ(back.SerializeAsString(), PiecesOnly(resolved));
  std::string bytes;
  (*stored)->AppendSerialized(&bytes);
  EXPECT_EQ(bytes, PiecesOnly(resolved));

  layout->pieces.pop_back();
  EXPECT_EQ(StoredPieces::Make(resolved.pieces(), *planner::PackedLayout::Pack(*layout), inv).status().code(), absl::StatusCode::kInternal);
}

TEST(StoredPiecesTest, EqualOnlyForTheSamePiecesOfTheSameModel) {
  auto inv = TwoTensors();
  pb::ResolvedLayout resolved = Resolved(3);
  absl::StatusOr<planner::WorkerLayout> layout = LayoutFromProto(resolved, *inv);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto a = StoredPieces::Make(resolved.pieces(), *planner::PackedLayout::Pack(*layout), inv);
  auto b = StoredPieces::Make(resolved.pieces(), *planner::PackedLayout::Pack(*layout), inv);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(**a == **b);
  auto other_model = StoredPieces::Make(resolved.pieces(), *planner::PackedLayout::Pack(*layout), TwoTensors());
  ASSERT_TRUE(other_model.ok());
  EXPECT_FALSE(**a == **other_model);
  resolved.mutable_pieces(2)->set_offset_bytes(48);
  auto moved = StoredPieces::Make(resolved.pieces(), *planner::PackedLayout::Pack(*layout), inv);
  ASSERT_TRUE(moved.ok());
  EXPECT_FALSE(**a == **moved);
}

}  // namespace
}  // namespace wb::daemon
