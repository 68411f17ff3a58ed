// MagnitudeBook: NVFP4 magnitudes of a version, reported per node and merged per tensor; which
// boxes a node holds comes from the plan (MakeMagnitudePlan).
#include "daemon/coordinator/magnitude_book.h"

#include <cmath>
#include <deque>
#include <limits>

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

planner::Inventory Inv() {
  planner::Inventory inv;
  inv.tensors.push_back({"q", {64, 32}, planner::DType::kBF16});
  inv.tensors.push_back({"k", {16, 32}, planner::DType::kBF16});
  return inv;
}

// An NVFP4 piece of `tensor` rows [row0, row1) (global scale slot at 0), or an fp8 one.
// The coordinator's form of a layout (planner/packed_layout.h), kept for the test's process.
const planner::PackedLayout* Packed(const planner::WorkerLayout& l) {
  static std::deque<planner::PackedLayout> kept;
  kept.push_back(*planner::PackedLayout::Pack(l));
  return &kept.back();
}

planner::Piece PieceOf(int32_t tensor, int64_t row0, int64_t row1, bool nvfp4 = true) {
  planner::Piece p;
  p.tensor = tensor;
  p.box = {{row0, 0}, {row1, 32}};
  p.quant = planner::Quantization{};
  if (nvfp4) {
    p.quant->dtype = planner::DType::kF4E2M1;
    p.quant->global_scale_offset_bytes = 0;
  }
  return p;
}

pb::ExchangeMagnitudesRequest Report(const std::string& node, const std::string& tensor, float amax) {
  pb::ExchangeMagnitudesRequest r;
  r.set_node_id(node);
  r.set_model_id("m");
  r.set_version(3);
  pb::TensorMagnitude* t = r.add_parts();
  t->set_tensor(tensor);
  t->set_amax(amax);
  return r;
}

std::map<std::string, pb::TensorMagnitude> Answer(const MagnitudeBook& book, const planner::Inventory& inv) {
  pb::ExchangeMagnitudesResponse resp;
  MagnitudeBook::Answer(book.Snapshot(), inv, &resp);
  std::map<std::string, pb::TensorMagnitude> out;
  for (const pb::TensorMagnitude& t : resp.tensors()) out[t.tensor()] = t;
  return out;
}

// Two ranks of one engine: n0 holds rows 0-31 of q and 0-7 of k, n1 the rest.
struct TwoNodes {
  planner::Inventory inv = Inv();
  planner::WorkerLayout r0, r1;
  std::shared_ptr<const MagnitudePlan> plan;
  TwoNodes() {
    r0.pieces = {PieceOf(0, 0, 32), PieceOf(1, 0, 8)};
    r1.pieces = {PieceOf(0, 32, 64), PieceOf(1, 8, 16)};
    plan = MakeMagnitudePlan({{"n0", true, Packed(r0)}, {"n1", true, Packed(r1)}}, inv);
  }
};

TEST(MagnitudeBookTest, TwoNodesHalvesGiveTheWholeTensorsMagnitude) {
  TwoNodes t;
  MagnitudeBook book("m", 3, t.plan);
  EXPECT_FALSE(book.complete());
  ASSERT_TRUE(book.Add(Report("n0", "q", 2.5f)).ok());
  EXPECT_EQ(book.missing(), std::vector<std::string>{"n1"});
  // Half of q so far: its magnitude is the half's, and not whole.
  auto half = Answer(book, t.inv);
  EXPECT_FLOAT_EQ(half["q"].amax(), 2.5f);
  EXPECT_FALSE(half["q"].whole());
  ASSERT_TRUE(book.Add(Report("n1", "q", 7.0f)).ok());
  EXPECT_TRUE(book.complete());
  auto all = Answer(book, t.inv);
  EXPECT_FLOAT_EQ(all["q"].amax(), 7.0f);
  EXPECT_TRUE(all["q"].whole());
  EXPECT_EQ(all.count("k"), 0u);  // nobody reported k
}

TEST(MagnitudeBookTest, ASnapshotIsNotChangedByALaterReport) {
  TwoNodes t;
  MagnitudeBook book("m", 3, t.plan);
  ASSERT_TRUE(book.Add(Report("n0", "q", 1.0f)).ok());
  const MagnitudeBook::Snap snap = book.Snapshot();
  ASSERT_TRUE(book.Add(Report("n1", "q", 9.0f)).ok());
  EXPECT_FLOAT_EQ(snap.parts->at(0).amax, 1.0f);
  EXPECT_EQ(snap.parts->at(0).nodes.size(), 1u);
  EXPECT_FLOAT_EQ(book.Snapshot().parts->at(0).amax, 9.0f);
}

TEST(MagnitudeBookTest, NanSticksAndARetriedReportChangesNothing) {
  TwoNodes t;
  MagnitudeBook book("m", 3, t.plan);
  ASSERT_TRUE(book.Add(Report("n0", "k", std::numeric_limits<float>::quiet_NaN())).ok());
  ASSERT_TRUE(book.Add(Report("n1", "k", 3.0f)).ok());
  ASSERT_TRUE(book.Add(Report("n1", "k", 3.0f)).ok());  // the same call again
  auto a = Answer(book, t.inv);
  EXPECT_TRUE(std::isnan(a["k"].amax()));
  EXPECT_TRUE(a["k"].whole());
}

// A node that reported the version done without its magnitudes counts as reported: nobody waits
// for it, and what only it held stays partial.
TEST(MagnitudeBookTest, ANodeDoneWithoutMagnitudesLeavesItsPartsOut) {
  TwoNodes t;
  MagnitudeBook book("m", 3, t.plan);
  ASSERT_TRUE(book.Add(Report("n0", "q", 2.0f)).ok());
  book.MarkDone("n1");
  book.MarkDone("n9");  // not in the book: nothing
  EXPECT_TRUE(book.complete());
  auto a = Answer(book, t.inv);
  EXPECT_FLOAT_EQ(a["q"].amax(), 2.0f);
  EXPECT_FALSE(a["q"].whole());
}

// Two engines' rank 0 (the same rows) on two nodes: the bottom half is nobody's.
TEST(MagnitudeBookTest, OverlappingPartsCoverOnlyWhatTheyHold) {
  planner::Inventory inv = Inv();
  planner::WorkerLayout a, b;
  a.pieces = {PieceOf(0, 0, 32)};
  b.pieces = {PieceOf(0, 0, 32)};
  MagnitudeBook book("m", 3, MakeMagnitudePlan({{"n0", true, Packed(a)}, {"n1", true, Packed(b)}}, inv));
  ASSERT_TRUE(book.Add(Report("n0", "q", 1.0f)).ok());
  ASSERT_TRUE(book.Add(Report("n1", "q", 1.0f)).ok());
  EXPECT_TRUE(book.complete());
  EXPECT_FALSE(Answer(book, inv)["q"].whole());
}

// The plan says what a node holds: a stranger, a tensor the node holds no NVFP4 piece of, or an
// unknown one is refused, and nothing of the report is recorded.
TEST(MagnitudeBookTest, RefusesStrangersAndTensorsTheNodeDoesNotHold) {
  planner::Inventory inv = Inv();
  planner::WorkerLayout r0;
  r0.pieces = {PieceOf(0, 0, 64), PieceOf(1, 0, 16, /*nvfp4=*/false)};
  MagnitudeBook book("m", 3, MakeMagnitudePlan({{"n0", true, Packed(r0)}}, inv));
  absl::Status s = book.Add(Report("n9", "q", 1.0f));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("n9"), std::string::npos) << s;
  for (const char* tensor : {"k", "nope"}) {
    pb::ExchangeMagnitudesRequest two = Report("n0", "q", 4.0f);
    *two.add_parts() = Report("n0", tensor, 1.0f).parts(0);
    s = book.Add(two);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(tensor), std::string::npos) << s;
  }
  // A largest magnitude is finite and >= 0 (NaN aside): an infinite one set every other node's
  // global scale to infinity (their blocks quantised to zero), a negative one is no magnitude.
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), -1.0f, -0.0f}) {
    s = book.Add(Report("n0", "q", bad));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s;
    EXPECT_NE(s.message().find("not a finite magnitude"), std::string::npos) << s;
  }
  EXPECT_FALSE(book.complete());
  EXPECT_TRUE(book.Snapshot().parts->empty());  // q of the refused reports was not recorded
}

TEST(MagnitudeBookTest, ThePlanHoldsNodesWithNvfp4RolloutPieces) {
  planner::Inventory inv = Inv();
  planner::WorkerLayout plain, fp8, nvfp4;
  planner::Piece p;
  p.tensor = 0;
  p.box = {{0, 0}, {64, 32}};
  plain.pieces.push_back(p);
  fp8.pieces.push_back(PieceOf(0, 0, 64, false));
  nvfp4.pieces = {PieceOf(1, 0, 16, false), PieceOf(0, 0, 64), PieceOf(0, 0, 8)};
  auto plan = MakeMagnitudePlan({{"n0", true, Packed(plain)}, {"n1", true, Packed(fp8)}, {"n2", true, Packed(nvfp4)}, {"n3", false, Packed(nvfp4)}, {"n4", true, nullptr}}, inv);
  ASSERT_EQ(plan->held.size(), 1u);
  ASSERT_EQ(plan->held.count("n2"), 1u);
  EXPECT_EQ(plan->held.at("n2").size(), 1u);       // q only (k's piece is fp8)
  EXPECT_EQ(plan->held.at("n2").at(0).size(), 2u);  // both of its q pieces
  EXPECT_EQ(plan->index, (std::map<std::string, int32_t>{{"q", 0}}));
}

}  // namespace
}  // namespace wb::daemon
