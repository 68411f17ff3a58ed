#include "planner/fragments.h"

#include "gtest/gtest.h"
#include "planner/box.h"

namespace wb::planner {
namespace {

void Add(Problem& p, Role role, std::vector<Box> boxes) {
  Worker w;
  w.id = absl::StrCat(role == Role::kTrainer ? "t" : "r", p.workers.size());
  w.role = role;
  w.node = static_cast<int>(p.workers.size());
  for (Box& b : boxes) {
    Piece pc;
    pc.tensor = 0;
    pc.box = std::move(b);
    w.layout.pieces.push_back(pc);
  }
  p.workers.push_back(std::move(w));
}

Problem Tensor(int64_t r, int64_t c) {
  Problem p;
  p.inventory.tensors.push_back(TensorSpec{"w", {r, c}, DType::kBF16});
  return p;
}

TEST(FragmentsTest, RowSplitAgainstColumnSplitGivesFourQuadrants) {
  Problem p = Tensor(8, 6);
  Add(p, Role::kTrainer, {Box{{0, 0}, {4, 6}}});
  Add(p, Role::kTrainer, {Box{{4, 0}, {8, 6}}});
  Add(p, Role::kRollout, {Box{{0, 0}, {8, 3}}});
  Add(p, Role::kRollout, {Box{{0, 3}, {8, 6}}});
  auto fs = BuildFragments(p, {});
  ASSERT_TRUE(fs.ok()) << fs.status();
  ASSERT_EQ(fs->fragments.size(), 4u);
  int64_t total = 0;
  for (const Fragment& f : fs->fragments) {
    EXPECT_EQ(f.src_end - f.src_begin, 1u);
    EXPECT_EQ(f.dst_end - f.dst_begin, 1u);
    EXPECT_EQ(BoxVolume(f.box), 12);
    total += f.bytes;
  }
  EXPECT_EQ(total, 8 * 6 * 2);
  EXPECT_EQ(fs->total_dst_bytes, 8 * 6 * 2);
}

TEST(FragmentsTest, IdenticalReplicasMergeIntoOneFragment) {
  Problem p = Tensor(64, 64);
  for (int i = 0; i < 3; ++i) Add(p, Role::kTrainer, {FullBox({64, 64})});
  for (int i = 0; i < 5; ++i) Add(p, Role::kRollout, {FullBox({64, 64})});
  auto fs = BuildFragments(p, {});
  ASSERT_TRUE(fs.ok());
  ASSERT_EQ(fs->fragments.size(), 1u);
  EXPECT_EQ(fs->fragments[0].src_end - fs->fragments[0].src_begin, 3u);
  EXPECT_EQ(fs->fragments[0].dst_end - fs->fragments[0].dst_begin, 5u);
}

TEST(FragmentsTest, FlatShardsMergeBackIntoFewBoxes) {
  // FSDP: 3 flat shards of a [10, 7] tensor; one rollout needs everything. Each shard's boxes
  // (partial row, full rows, partial row) stay separate fragments but full rows merge.
  Problem p = Tensor(10, 7);
  const std::vector<int64_t> cuts = {0, 24, 47, 70};
  for (int i = 0; i < 3; ++i) Add(p, Role::kTrainer, FlatRangeToBoxes({10, 7}, cuts[i], cuts[i + 1]));
  Add(p, Role::kRollout, {FullBox({10, 7})});
  auto fs = BuildFragments(p, {});
  ASSERT_TRUE(fs.ok()) << fs.status();
  int64_t total = 0;
  for (const Fragment& f : fs->fragments) total += BoxVolume(f.box);
  EXPECT_EQ(total, 70);
  EXPECT_LE(fs->fragments.size(), 7u);  // at most the source boxes
}

TEST(FragmentsTest, SplitsLargeFragmentsAlongFirstDim) {
  Problem p = Tensor(100, 10);
  Add(p, Role::kTrainer, {FullBox({100, 10})});
  Add(p, Role::kRollout, {FullBox({100, 10})});
  FragmentOptions o;
  o.max_fragment_bytes = 500;  // 2000 bytes total -> 4 chunks of 25 rows
  auto fs = BuildFragments(p, o);
  ASSERT_TRUE(fs.ok());
  ASSERT_EQ(fs->fragments.size(), 4u);
  EXPECT_EQ(fs->fragments[1].box.begin[0], 25);
  EXPECT_EQ(fs->fragments[1].box.end[0], 50);
  EXPECT_EQ(fs->fragments[1].bytes, 500);
}

TEST(FragmentsTest, MissingSourceNamesTensorAndBox) {
  Problem p = Tensor(4, 4);
  Add(p, Role::kTrainer, {Box{{0, 0}, {4, 2}}});
  Add(p, Role::kRollout, {FullBox({4, 4})});
  auto fs = BuildFragments(p, {});
  ASSERT_FALSE(fs.ok());
  EXPECT_EQ(fs.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(fs.status().message().find("tensor w box [0:4, 2:4]"), std::string::npos) << fs.status();
}

}  // namespace
}  // namespace wb::planner
