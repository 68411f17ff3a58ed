#include "daemon/coordinator/certify_boxes.h"

#include <optional>

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// Tensor 0 [8, 4] and tensor 1 [4]. Source s0 (node n0) holds tensor 0 whole and tensor 1
// quantised; source s1 (node n1) holds rows 0..4 of tensor 0; late rollout l0 (node n2).
struct Fixture {
  SliceInput in;
  planner::Plan plan;
  std::map<std::string, pb::PlanSlice> by_node{{"n0", {}}, {"n1", {}}, {"n2", {}}};
  Fixture() {
    auto s0 = std::make_shared<planner::WorkerLayout>();
    s0->pieces.push_back({0, planner::Box{{0, 0}, {8, 4}}, 0, 0, {4, 1}, std::nullopt});
    planner::Piece q{1, planner::Box{{0}, {4}}, 0, 64, {1}, std::nullopt};
    q.quant = planner::Quantization{planner::DType::kF8E4M3, {2}, 0, 128, planner::DType::kF32, -1};
    auto inv = std::make_shared<planner::Inventory>();
    inv->tensors.push_back({"t0", {8, 4}, planner::DType::kBF16});
    inv->tensors.push_back({"t1", {4}, planner::DType::kBF16});
    in.inventory = inv;
    s0->pieces.push_back(q);
    auto s1 = std::make_shared<planner::WorkerLayout>();
    s1->pieces.push_back({0, planner::Box{{0, 0}, {4, 4}}, 0, 0, {4, 1}, std::nullopt});
    in.workers = {{"s0", "n0", planner::Role::kTrainer, -1, *planner::PackedLayout::PackShared(*s0), nullptr},
                  {"s1", "n1", planner::Role::kTrainer, -1, *planner::PackedLayout::PackShared(*s1), nullptr},
                  {"l0", "n2", planner::Role::kRollout, -1, nullptr, nullptr}};
    planner::Bucket b;
    b.ops.push_back(Op(0, 2, 0, planner::Box{{4, 0}, {6, 4}}));  // rows 4..6 from s0
    b.ops.push_back(Op(1, 2, 0, planner::Box{{0, 0}, {2, 4}}));  // rows 0..2 from s1
    b.ops.push_back(Op(0, 2, 1, planner::Box{{0}, {4}}));        // tensor 1 from s0 (quantised)
    plan.buckets.push_back(b);
  }
  static planner::TransferOp Op(int32_t src, int32_t dst, int32_t tensor, planner::Box box) {
    planner::TransferOp op;
    op.src_worker = src;
    op.dst_worker = dst;
    op.src_piece = tensor;
    op.dst_piece = 0;
    op.tensor = tensor;
    op.box = std::move(box);
    return op;
  }
};

TEST(CertifyBoxesTest, LandedBoxesTheCatchUpReadsGoToTheirSourcesNode) {
  Fixture f;
  std::map<std::string, std::vector<LandedBox>> landed;
  landed["s0"] = {{0, planner::Box{{0, 0}, {4, 4}}, 11, 3, false},   // not read by the catch-up
                  {0, planner::Box{{4, 0}, {8, 4}}, 12, 4, false},   // read (rows 4..6)
                  {1, planner::Box{{0}, {4}}, 13, 5, false}};        // in a quantised piece: never
  landed["s1"] = {{0, planner::Box{{0, 0}, {4, 4}}, 21, 7, true}};
  landed["l0"] = {{0, planner::Box{{0, 0}, {8, 4}}, 31, 9, false}};  // not a source
  const CertifyCount n = AddCertifyBoxes(f.plan, f.in, landed, &f.by_node);
  EXPECT_EQ(n.boxes, 2);
  EXPECT_EQ(n.sources, 2);
  EXPECT_EQ(n.uncovered_sources, 0);
  ASSERT_EQ(f.by_node["n0"].certify_size(), 1);
  const pb::CertifyBox& c0 = f.by_node["n0"].certify(0);
  EXPECT_EQ(c0.worker(), 0u);
  EXPECT_EQ(c0.piece(), 0);
  EXPECT_EQ(c0.tensor(), 0);
  EXPECT_EQ(c0.box().begin(0), 4);
  EXPECT_EQ(c0.box().end(0), 8);
  EXPECT_EQ(c0.digest(), 12u);
  EXPECT_EQ(c0.version_op(), 4u);
  EXPECT_FALSE(c0.from_catch_up());
  ASSERT_EQ(f.by_node["n1"].certify_size(), 1);
  EXPECT_EQ(f.by_node["n1"].certify(0).worker(), 1u);
  EXPECT_EQ(f.by_node["n1"].certify(0).digest(), 21u);
  EXPECT_TRUE(f.by_node["n1"].certify(0).from_catch_up());
  EXPECT_EQ(f.by_node["n2"].certify_size(), 0);
}

// A landed box the catch-up reads but that no piece of the source holds whole (s1 holds rows 0..4;
// the record says 1..6) certifies nothing: the source's node could not check it against one piece.
TEST(CertifyBoxesTest, ALandedBoxNoPieceHoldsWholeCertifiesNothing) {
  Fixture f;
  std::map<std::string, std::vector<LandedBox>> landed;
  landed["s1"] = {{0, planner::Box{{1, 0}, {6, 4}}, 21, 7, false}};
  const CertifyCount n = AddCertifyBoxes(f.plan, f.in, landed, &f.by_node);
  EXPECT_EQ(n.boxes, 0);
  EXPECT_EQ(f.by_node["n1"].certify_size(), 0);
  landed["s1"] = {{0, planner::Box{{1, 0}, {4, 4}}, 21, 7, false}};  // inside it: certified
  EXPECT_EQ(AddCertifyBoxes(f.plan, f.in, landed, &f.by_node).boxes, 1);
}

TEST(CertifyBoxesTest, ASourceWithoutARecordIsCountedAndGetsNothing) {
  Fixture f;
  std::map<std::string, std::vector<LandedBox>> landed;
  landed["s1"] = {{0, planner::Box{{0, 0}, {4, 4}}, 21, 7, false}};
  const CertifyCount n = AddCertifyBoxes(f.plan, f.in, landed, &f.by_node);
  EXPECT_EQ(n.boxes, 1);
  EXPECT_EQ(n.uncovered_sources, 1);
  EXPECT_EQ(f.by_node["n0"].certify_size(), 0);
}

// A sender-quantised landing (its digest covers quantised elements and scales) certifies the
// quantised piece the catch-up reads, marked as such; it never certifies an unquantised piece of
// the same box, and a canonical digest never a quantised piece.
TEST(CertifyBoxesTest, ASenderQuantisedLandingCertifiesTheQuantisedPieceOnly) {
  Fixture f;
  std::map<std::string, std::vector<LandedBox>> landed;
  landed["s0"] = {{1, planner::Box{{0}, {4}}, 13, 5, false, true},        // quantised piece 1
                  {0, planner::Box{{4, 0}, {8, 4}}, 14, 6, false, true}};  // piece 0 is unquantised: not this form
  const CertifyCount n = AddCertifyBoxes(f.plan, f.in, landed, &f.by_node);
  EXPECT_EQ(n.boxes, 1);
  ASSERT_EQ(f.by_node["n0"].certify_size(), 1);
  const pb::CertifyBox& c = f.by_node["n0"].certify(0);
  EXPECT_EQ(c.piece(), 1);
  EXPECT_EQ(c.tensor(), 1);
  EXPECT_EQ(c.digest(), 13u);
  EXPECT_TRUE(c.quantized());
  EXPECT_FALSE(c.quantized_here());
}

// What a rollout's node quantised itself (quantized_here) reaches the slice marked so; a quantised
// record off the piece's block grid, or on a format no sender produces, certifies nothing (the
// source's node would refuse it and fail the catch-up instead of naming a stale source).
TEST(CertifyBoxesTest, QuantisedRecordsTheSourceCannotCheckAreLeftOut) {
  Fixture f;
  std::map<std::string, std::vector<LandedBox>> landed;
  landed["s0"] = {{1, planner::Box{{0}, {4}}, 13, 0, false, true, true}};
  ASSERT_EQ(AddCertifyBoxes(f.plan, f.in, landed, &f.by_node).boxes, 1);
  EXPECT_TRUE(f.by_node["n0"].certify(0).quantized_here());
  Fixture off_grid;
  landed["s0"] = {{1, planner::Box{{1}, {3}}, 13, 0, false, true, true}};
  EXPECT_EQ(AddCertifyBoxes(off_grid.plan, off_grid.in, landed, &off_grid.by_node).boxes, 0);
  Fixture nvfp4;
  planner::WorkerLayout layout = nvfp4.in.workers[0].layout->Unpack();
  layout.pieces[1].quant->dtype = planner::DType::kF4E2M1;
  layout.pieces[1].quant->scale_dtype = planner::DType::kF8E4M3;
  nvfp4.in.workers[0].layout = *planner::PackedLayout::PackShared(layout);
  landed["s0"] = {{1, planner::Box{{0}, {4}}, 13, 0, false, true, true}};
  EXPECT_EQ(AddCertifyBoxes(nvfp4.plan, nvfp4.in, landed, &nvfp4.by_node).boxes, 0);
}

}  // namespace
}  // namespace wb::daemon
