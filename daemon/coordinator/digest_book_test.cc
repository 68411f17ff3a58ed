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

}  // namespace
}  // namespace wb::daemon
