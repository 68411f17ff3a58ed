#include "daemon/coordinator/digest_book.h"

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

// Two ops: op 0 trainer t0 (node n0) -> rollout r0 (node n1), op 1 t0 -> r1 (node n0, same node).
DigestBook Book(DigestBook::Kind kind = DigestBook::Kind::kVersion) {
  auto plan = std::make_shared<planner::Plan>();
  plan->buckets.resize(2);
  planner::TransferOp a;
  a.src_worker = 0;
  a.dst_worker = 1;
  a.tensor = 1;
  a.box = planner::Box{{0, 0}, {4, 8}};
  plan->buckets[0].ops.push_back(a);
  planner::TransferOp b = a;
  b.dst_worker = 2;
  b.box = planner::Box{{4, 0}, {8, 8}};
  plan->buckets[1].ops.push_back(b);
  auto inv = std::make_shared<planner::Inventory>();
  inv->tensors.resize(2);
  inv->tensors[0].name = "model.embed_tokens.weight";
  inv->tensors[1].name = "model.layers.0.mlp.down_proj.weight";
  inv->tensors[1].shape = {8, 8};
  return DigestBook("m", 7, plan, {"t0", "r0", "r1"}, inv, {{"t0", "n0"}, {"r0", "n1"}, {"r1", "n0"}}, kind);
}

pb::ReportDoneRequest Report(const std::string& node, std::vector<std::pair<uint32_t, uint64_t>> src,
                             std::vector<std::pair<uint32_t, uint64_t>> landed) {
  pb::ReportDoneRequest r;
  r.set_node_id(node);
  for (auto [op, d] : src) {
    auto* o = r.add_source_digests();
    o->set_op(op);
    o->set_digest(d);
  }
  for (auto [op, d] : landed) {
    auto* o = r.add_landed_digests();
    o->set_op(op);
    o->set_digest(d);
  }
  return r;
}

TEST(DigestBookTest, MatchingDigestsFromBothNodesVerifyTheVersion) {
  DigestBook book = Book();
  ASSERT_TRUE(book.Add(Report("n0", {{0, 11}, {1, 22}}, {{1, 22}})).ok());
  EXPECT_FALSE(book.Verdict().verified);  // op 0 has no landed digest yet
  ASSERT_TRUE(book.Add(Report("n1", {}, {{0, 11}})).ok());
  DigestVerdict v = book.Verdict();
  EXPECT_TRUE(v.verified);
  EXPECT_EQ(v.ops_verified, 2u);
  EXPECT_EQ(v.ops_total, 2u);
}

TEST(DigestBookTest, AMismatchNamesTensorBoxWorkersAndNodes) {
  DigestBook book = Book();
  ASSERT_TRUE(book.Add(Report("n1", {}, {{0, 0xbad}})).ok());
  absl::Status s = book.Add(Report("n0", {{0, 0x600d}, {1, 22}}, {{1, 22}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  const std::string msg(s.message());
  for (const char* part : {"model m version 7", "tensor model.layers.0.mlp.down_proj.weight", "box [0:4, 0:8]", "from worker t0 (node n0)",
                           "to worker r0 (node n1)", "000000000000600d", "0000000000000bad", "previous version stays whole"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << part << " missing in: " << msg;
  }
}

// A catch-up's book (catch_up.cc): the same check, worded as the catch-up that is aborted (the
// committed version is not); a clean catch-up is verified like a version.
TEST(DigestBookTest, ACatchUpMismatchAbortsTheCatchUpNotTheVersion) {
  DigestBook book = Book(DigestBook::Kind::kCatchUp);
  ASSERT_TRUE(book.Add(Report("n0", {{0, 0x600d}, {1, 22}}, {{1, 22}})).ok());
  absl::Status s = book.Add(Report("n1", {}, {{0, 0xbad}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  const std::string msg(s.message());
  for (const char* part : {"in the catch-up of model m version 7", "tensor model.layers.0.mlp.down_proj.weight", "box [0:4, 0:8]",
                           "from worker t0 (node n0)", "to worker r0 (node n1)", "the catch-up is aborted"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << part << " missing in: " << msg;
  }
  EXPECT_EQ(msg.find("previous version"), std::string::npos) << msg;
  DigestBook clean = Book(DigestBook::Kind::kCatchUp);
  ASSERT_TRUE(clean.Add(Report("n0", {{0, 11}, {1, 22}}, {{1, 22}})).ok());
  ASSERT_TRUE(clean.Add(Report("n1", {}, {{0, 11}})).ok());
  EXPECT_TRUE(clean.Verdict().verified);
}

TEST(DigestBookTest, OpsWithoutDigestsLeaveTheVersionUnverifiedNotFailed) {
  // A GPU path: node n1 digests nothing (its staging is device memory).
  DigestBook book = Book();
  ASSERT_TRUE(book.Add(Report("n0", {{0, 11}, {1, 22}}, {{1, 22}})).ok());
  ASSERT_TRUE(book.Add(Report("n1", {}, {})).ok());
  DigestVerdict v = book.Verdict();
  EXPECT_FALSE(v.verified);
  EXPECT_EQ(v.ops_verified, 1u);
}

TEST(DigestBookTest, BadReportsAreRefused) {
  DigestBook book = Book();
  absl::Status s = book.Add(Report("n0", {{5, 1}}, {}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("op 5"), std::string::npos) << s;
  ASSERT_TRUE(book.Add(Report("n0", {{0, 1}}, {})).ok());
  EXPECT_EQ(book.Add(Report("n0", {{0, 2}}, {})).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(book.Add(Report("n0", {{0, 1}}, {})).ok());  // the same digest again is harmless
}

// What landed in each rollout (the record catch-ups certify their sources against): ops whose two
// digests match or whose source digest was not taken; a sender-quantised op's digest is marked as
// covering quantised bytes (it certifies a quantised piece, never canonical bytes); a mismatching
// op and an op into a gather staging are left out.
TEST(DigestBookTest, LandedByWorkerKeepsMatchingOpsAndMarksSenderQuantisedOnes) {
  auto plan = std::make_shared<planner::Plan>();
  plan->buckets.resize(1);
  auto op = [&](int32_t dst, int32_t piece, int64_t row, bool quantized) {
    planner::TransferOp o;
    o.src_worker = 0;
    o.src_piece = 0;
    o.dst_worker = dst;
    o.dst_piece = piece;
    o.tensor = 1;
    o.box = planner::Box{{row, 0}, {row + 4, 8}};
    o.sender_quantized = quantized;
    plan->buckets[0].ops.push_back(o);
  };
  op(1, 0, 0, false);   // op 0: r0, canonical, digests match
  op(1, 1, 4, true);    // op 1: r0, sender-quantised, digests match
  op(2, 0, 0, false);   // op 2: r1, no source digest taken (device memory on the sender)
  op(2, 1, 4, false);   // op 3: r1, digests differ (never recorded)
  op(1, -1, 8, false);  // op 4: into a gather staging
  auto inv = std::make_shared<planner::Inventory>();
  inv->tensors.resize(2);
  DigestBook book("m", 7, plan, {"t0", "r0", "r1"}, inv, {{"t0", "n0"}, {"r0", "n1"}, {"r1", "n1"}});
  ASSERT_TRUE(book.Add(Report("n0", {{0, 10}, {1, 11}, {3, 13}, {4, 14}}, {})).ok());
  EXPECT_FALSE(book.Add(Report("n1", {}, {{0, 10}, {1, 11}, {2, 12}, {3, 99}, {4, 14}})).ok());  // op 3 differs
  const LandedRecord landed = book.LandedByWorker();
  ASSERT_EQ(landed.size(), 2u);
  const std::vector<LandedBox>& r0 = landed.at("r0");
  ASSERT_EQ(r0.size(), 2u);
  EXPECT_EQ(r0[0].op, 0u);
  EXPECT_EQ(r0[0].digest, 10u);
  EXPECT_FALSE(r0[0].quantized);
  EXPECT_EQ(r0[1].op, 1u);
  EXPECT_EQ(r0[1].digest, 11u);
  EXPECT_TRUE(r0[1].quantized);
  EXPECT_EQ(r0[1].box.begin, (std::vector<int64_t>{4, 0}));
  const std::vector<LandedBox>& r1 = landed.at("r1");
  ASSERT_EQ(r1.size(), 1u);
  EXPECT_EQ(r1[0].op, 2u);
  EXPECT_FALSE(r1[0].from_catch_up);
}

// A rollout's node reports the quantised pieces its quantiser wrote (receiver-side quantising):
// kept with what landed, marked quantised and quantised there; a piece of a worker that is not
// the reporting node's, or of no tensor box, is refused.
TEST(DigestBookTest, QuantisedPiecesANodeWroteAreKeptForItsRollouts) {
  DigestBook book = Book();
  pb::ReportDoneRequest r = Report("n1", {}, {});
  pb::QuantizedPieceDigest* q = r.add_quantized_pieces();
  q->set_worker_id("r0");
  q->set_tensor(1);
  for (int64_t b : {0, 0}) q->mutable_box()->add_begin(b);
  for (int64_t e : {8, 8}) q->mutable_box()->add_end(e);
  q->set_digest(0x77);
  ASSERT_TRUE(book.Add(r).ok());
  const LandedRecord landed = book.LandedByWorker();
  ASSERT_EQ(landed.at("r0").size(), 1u);
  const LandedBox& l = landed.at("r0")[0];
  EXPECT_EQ(l.tensor, 1);
  EXPECT_EQ(l.digest, 0x77u);
  EXPECT_TRUE(l.quantized);
  EXPECT_TRUE(l.quantized_here);
  EXPECT_EQ(l.box.end, (std::vector<int64_t>{8, 8}));
  pb::ReportDoneRequest other = r;  // r1 is on n0, not n1
  other.mutable_quantized_pieces(0)->set_worker_id("r1");
  EXPECT_EQ(book.Add(other).code(), absl::StatusCode::kInvalidArgument);
  pb::ReportDoneRequest outside = r;
  outside.mutable_quantized_pieces(0)->mutable_box()->set_end(0, 9);
  EXPECT_EQ(book.Add(outside).code(), absl::StatusCode::kInvalidArgument);
  pb::ReportDoneRequest tensor = r;
  tensor.mutable_quantized_pieces(0)->set_tensor(5);
  EXPECT_EQ(book.Add(tensor).code(), absl::StatusCode::kInvalidArgument);
  // The same report again adds nothing; the same piece with another digest is refused.
  ASSERT_TRUE(book.Add(r).ok());
  EXPECT_EQ(book.LandedByWorker().at("r0").size(), 1u);
  pb::ReportDoneRequest changed = r;
  changed.mutable_quantized_pieces(0)->set_digest(0x78);
  EXPECT_EQ(book.Add(changed).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wb::daemon
