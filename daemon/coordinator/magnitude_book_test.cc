// MagnitudeBook: NVFP4 magnitudes of a version, reported per node and merged per tensor.
#include "daemon/coordinator/magnitude_book.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

std::shared_ptr<const planner::Inventory> Inv() {
  auto inv = std::make_shared<planner::Inventory>();
  inv->tensors.push_back({"q", {64, 32}, planner::DType::kBF16});
  inv->tensors.push_back({"k", {16, 32}, planner::DType::kBF16});
  return inv;
}

pb::ExchangeMagnitudesRequest Report(const std::string& node, const std::string& tensor, float amax, int64_t row0, int64_t row1, int64_t cols) {
  pb::ExchangeMagnitudesRequest r;
  r.set_node_id(node);
  r.set_model_id("m");
  r.set_version(3);
  pb::TensorMagnitude* t = r.add_parts();
  t->set_tensor(tensor);
  t->set_amax(amax);
  pb::Box* b = t->add_boxes();
  b->add_begin(row0);
  b->add_begin(0);
  b->add_end(row1);
  b->add_end(cols);
  return r;
}

std::map<std::string, pb::TensorMagnitude> Answer(const MagnitudeBook& book, const planner::Inventory& inv) {
  pb::ExchangeMagnitudesResponse resp;
  MagnitudeBook::Answer(*book.Snapshot(), inv, &resp);
  std::map<std::string, pb::TensorMagnitude> out;
  for (const pb::TensorMagnitude& t : resp.tensors()) out[t.tensor()] = t;
  return out;
}

TEST(MagnitudeBookTest, TwoNodesHalvesGiveTheWholeTensorsMagnitude) {
  auto inv = Inv();
  MagnitudeBook book("m", 3, {"n0", "n1"}, inv);
  EXPECT_FALSE(book.complete());
  ASSERT_TRUE(book.Add(Report("n0", "q", 2.5f, 0, 32, 32)).ok());
  EXPECT_EQ(book.missing(), std::vector<std::string>{"n1"});
  // Half of q only so far: its magnitude is the half's, and not whole.
  auto half = Answer(book, *inv);
  EXPECT_FLOAT_EQ(half["q"].amax(), 2.5f);
  EXPECT_FALSE(half["q"].whole());
  ASSERT_TRUE(book.Add(Report("n1", "q", 7.0f, 32, 64, 32)).ok());
  EXPECT_TRUE(book.complete());
  auto all = Answer(book, *inv);
  EXPECT_FLOAT_EQ(all["q"].amax(), 7.0f);
  EXPECT_TRUE(all["q"].whole());
  EXPECT_EQ(all.count("k"), 0u);  // nobody reported k
  // The earlier snapshot is untouched by later reports (copy-on-write).
  EXPECT_FLOAT_EQ(half["q"].amax(), 2.5f);
}

TEST(MagnitudeBookTest, SnapshotIsNotChangedByALaterReport) {
  auto inv = Inv();
  MagnitudeBook book("m", 3, {"n0", "n1"}, inv);
  ASSERT_TRUE(book.Add(Report("n0", "q", 1.0f, 0, 32, 32)).ok());
  std::shared_ptr<const MagnitudeBook::Parts> snap = book.Snapshot();
  ASSERT_TRUE(book.Add(Report("n1", "q", 9.0f, 32, 64, 32)).ok());
  EXPECT_FLOAT_EQ(snap->at(0).amax, 1.0f);
  EXPECT_EQ(snap->at(0).boxes.size(), 1u);
  EXPECT_FLOAT_EQ(book.Snapshot()->at(0).amax, 9.0f);
}

TEST(MagnitudeBookTest, NanSticksAndARetriedReportChangesNothing) {
  auto inv = Inv();
  MagnitudeBook book("m", 3, {"n0", "n1"}, inv);
  ASSERT_TRUE(book.Add(Report("n0", "k", std::numeric_limits<float>::quiet_NaN(), 0, 8, 32)).ok());
  ASSERT_TRUE(book.Add(Report("n1", "k", 3.0f, 8, 16, 32)).ok());
  ASSERT_TRUE(book.Add(Report("n1", "k", 3.0f, 8, 16, 32)).ok());  // the same call again
  auto a = Answer(book, *inv);
  EXPECT_TRUE(std::isnan(a["k"].amax()));
  EXPECT_TRUE(a["k"].whole());
  EXPECT_EQ(book.Snapshot()->at(1).boxes.size(), 2u);
}

TEST(MagnitudeBookTest, OverlappingPartsOfTwoEnginesCoverOnlyWhatTheyHold) {
  auto inv = Inv();
  MagnitudeBook book("m", 3, {"n0", "n1"}, inv);
  // Two engines' rank 0 (the same rows) on two nodes: the bottom half is nobody's.
  ASSERT_TRUE(book.Add(Report("n0", "q", 1.0f, 0, 32, 32)).ok());
  ASSERT_TRUE(book.Add(Report("n1", "q", 1.0f, 0, 32, 32)).ok());
  EXPECT_TRUE(book.complete());
  EXPECT_FALSE(Answer(book, *inv)["q"].whole());
}

TEST(MagnitudeBookTest, RefusesStrangersUnknownTensorsAndBadBoxesWithoutRecordingAnything) {
  auto inv = Inv();
  MagnitudeBook book("m", 3, {"n0"}, inv);
  absl::Status s = book.Add(Report("n9", "q", 1.0f, 0, 32, 32));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("n9"), std::string::npos) << s;
  pb::ExchangeMagnitudesRequest two = Report("n0", "q", 4.0f, 0, 32, 32);
  *two.add_parts() = Report("n0", "nope", 1.0f, 0, 1, 1).parts(0);
  s = book.Add(two);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("nope"), std::string::npos) << s;
  s = book.Add(Report("n0", "q", 1.0f, 0, 65, 32));  // past the rows
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = book.Add(Report("n0", "q", 1.0f, 8, 8, 32));  // empty
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  pb::ExchangeMagnitudesRequest rank = Report("n0", "q", 1.0f, 0, 8, 32);
  rank.mutable_parts(0)->mutable_boxes(0)->add_begin(0);
  rank.mutable_parts(0)->mutable_boxes(0)->add_end(1);
  s = book.Add(rank);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_FALSE(book.complete());
  EXPECT_TRUE(book.Snapshot()->empty());  // q of the refused two-part report was not recorded
}

TEST(MagnitudeBookTest, NodesAreThoseWithNvfp4RolloutPieces) {
  planner::WorkerLayout plain, fp8, nvfp4;
  plain.pieces.push_back({});
  planner::Piece p;
  p.quant = planner::Quantization{};
  fp8.pieces.push_back(p);
  p.quant->dtype = planner::DType::kF4E2M1;
  p.quant->global_scale_offset_bytes = 0;
  nvfp4.pieces = {fp8.pieces[0], p};
  std::set<std::string> nodes = MagnitudeNodes({{"n0", true, &plain}, {"n1", true, &fp8}, {"n2", true, &nvfp4}, {"n3", false, &nvfp4},
                                                {"n4", true, nullptr}});
  EXPECT_EQ(nodes, (std::set<std::string>{"n2"}));
}

}  // namespace
}  // namespace wb::daemon
