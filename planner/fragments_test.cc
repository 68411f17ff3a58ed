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

Problem F32Tensor(int64_t n) {
  Problem p;
  p.inventory.tensors.push_back(TensorSpec{"w", {n, n}, DType::kF32});
  return p;
}

// One-element boxes on the diagonal every 4 elements: 2 grid breakpoints each per dim.
std::vector<Box> Diagonal(int64_t count) {
  std::vector<Box> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(Box{{4 * i, 4 * i}, {4 * i + 1, 4 * i + 1}});
  return out;
}

TEST(FragmentsTest, DuplicateSourceBoxesCostOneWalkAndStayAlternativeSenders) {
  // Security review, variant A: the diagonal makes a 2049 x 2049-cell grid and 32768 copies of the
  // full box on one trainer would each walk all of it (~3 min before grouping). Grouped: one walk.
  Problem p = F32Tensor(4096);
  std::vector<Box> hostile = Diagonal(1024);
  for (int i = 0; i < 32768; ++i) hostile.push_back(FullBox({4096, 4096}));
  Add(p, Role::kTrainer, hostile);
  Add(p, Role::kTrainer, {FullBox({4096, 4096}), FullBox({4096, 4096})});  // another worker, twice
  Add(p, Role::kRollout, {FullBox({4096, 4096})});
  auto fs = BuildFragments(p, {});
  ASSERT_TRUE(fs.ok()) << fs.status();
  EXPECT_LT(fs->work, int64_t{3} * 2049 * 2049 + 64 * 1024 * 1024);
  int64_t total = 0;
  for (const Fragment& f : fs->fragments) {
    total += BoxVolume(f.box);
    // Each worker once (its lowest full-box piece, or its diagonal piece), in worker order.
    ASSERT_EQ(f.src_end - f.src_begin, BoxVolume(f.box) == 1 && f.box.begin[0] % 4 == 0 ? 3u : 2u)
        << BoxToString(f.box);
    const PieceRef a = fs->refs[f.src_begin];
    const PieceRef b = fs->refs[f.src_end - 1];
    EXPECT_EQ(a.worker, 0);
    EXPECT_EQ(b.worker, 1);
    EXPECT_EQ(b.piece, 0);
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      const PieceRef r = fs->refs[k];
      EXPECT_TRUE(BoxContains(p.workers[r.worker].layout.pieces[r.piece].box, f.box));
      if (r.worker == 0 && r.piece >= 1024) {
        EXPECT_EQ(r.piece, 1024);  // the first full-box copy
      }
    }
    ASSERT_EQ(f.dst_end - f.dst_begin, 1u);
  }
  EXPECT_EQ(total, int64_t{4096} * 4096);
}

TEST(FragmentsTest, DistinctOverlappingSourceBoxesExhaustTheWorkBudget) {
  // 1024 distinct boxes that each cover nearly all 2049 x 3073 cells: ~6.4e9 cells to walk (the
  // old code walked them, seconds to minutes). Charged before walking: an error at once.
  Problem p = F32Tensor(4096);
  std::vector<Box> hostile = Diagonal(1024);
  for (int64_t k = 0; k < 1024; ++k) hostile.push_back(Box{{0, 0}, {4096, 4096 - 2 * k - 2}});
  hostile.push_back(FullBox({4096, 4096}));
  Add(p, Role::kTrainer, hostile);
  Add(p, Role::kRollout, {FullBox({4096, 4096})});
  auto fs = BuildFragments(p, {});
  ASSERT_FALSE(fs.ok());
  EXPECT_EQ(fs.status().code(), absl::StatusCode::kResourceExhausted) << fs.status();
  EXPECT_NE(fs.status().message().find("tensor w (largest box: worker t0 piece "), std::string::npos) << fs.status();
  EXPECT_NE(fs.status().message().find(absl::StrCat("work budget of ", FragmentWorkBudget(2050))), std::string::npos)
      << fs.status();
}

TEST(FragmentsTest, ManyCandidateHoldersPerFragmentExhaustTheWorkBudget) {
  // Row strips and column strips: every cell is its own fragment (4M) and each row has 2048 + 1
  // candidate groups: ~1.7e10 holder tests, counted as they happen.
  Problem p = F32Tensor(2048);
  std::vector<Box> hostile;
  for (int64_t i = 0; i < 2048; ++i) {
    hostile.push_back(Box{{i, 0}, {i + 1, 2048}});
    hostile.push_back(Box{{0, i}, {2048, i + 1}});
  }
  Add(p, Role::kTrainer, hostile);
  Add(p, Role::kRollout, {FullBox({2048, 2048})});
  auto fs = BuildFragments(p, {});
  ASSERT_FALSE(fs.ok());
  EXPECT_EQ(fs.status().code(), absl::StatusCode::kResourceExhausted) << fs.status();
  EXPECT_NE(fs.status().message().find("tensor w: testing the candidate holders"), std::string::npos) << fs.status();
}

TEST(FragmentsTest, WorkBudgetOptionAndSmallProblemsStayFarBelowIt) {
  Problem p = Tensor(64, 64);
  for (int i = 0; i < 4; ++i) Add(p, Role::kTrainer, {Box{{16 * i, 0}, {16 * i + 16, 64}}});
  for (int i = 0; i < 8; ++i) Add(p, Role::kRollout, {Box{{0, 8 * i}, {64, 8 * i + 8}}});
  auto fs = BuildFragments(p, {});
  ASSERT_TRUE(fs.ok()) << fs.status();
  EXPECT_GT(fs->work, 0);
  EXPECT_LT(fs->work, 1000);
  FragmentOptions tight;
  tight.work_budget = fs->work - 1;
  EXPECT_EQ(BuildFragments(p, tight).status().code(), absl::StatusCode::kResourceExhausted);
  tight.work_budget = fs->work;
  EXPECT_TRUE(BuildFragments(p, tight).ok());
}

}  // namespace
}  // namespace wb::planner
