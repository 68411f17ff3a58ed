#include "planner/validate.h"

#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/inventory.h"
#include "planner/presets.h"

namespace wb::planner {
namespace {

std::string ReadTestdata(const std::string& name) {
  std::ifstream f("planner/testdata/" + name);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Inventory Small() {
  Inventory inv;
  inv.tensors.push_back({"a.weight", {8, 6}, DType::kBF16});
  inv.tensors.push_back({"b.bias", {10}, DType::kF32});
  return inv;
}

Piece P(int32_t t, Box box, int64_t off, std::vector<int64_t> strides, int32_t buffer = 0) {
  Piece p;
  p.tensor = t;
  p.box = std::move(box);
  p.offset_bytes = off;
  p.strides = std::move(strides);
  p.buffer = buffer;
  return p;
}

void ExpectError(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(needle), std::string::npos) << "missing `" << needle << "` in: " << s;
}

TEST(ValidateLayout, AcceptsFusedAndTransposedPieces) {
  Inventory inv = Small();
  WorkerLayout l;
  l.buffers = {{1024}};
  // a rows [0,4) contiguous; a rows [4,8) transposed (local [6,4], column-major w.r.t. canonical).
  l.pieces.push_back(P(0, {{0, 0}, {4, 6}}, 0, {6, 1}));
  l.pieces.push_back(P(0, {{4, 0}, {8, 6}}, 48, {1, 4}));
  l.pieces.push_back(P(1, {{0}, {10}}, 96, {1}));
  EXPECT_TRUE(ValidateLayout(inv, l, Role::kRollout, "rollout/0").ok());
}

TEST(ValidateLayout, InterleavedStridedPiecesThatDoNotOverlap) {
  Inventory inv = Small();
  WorkerLayout l;
  l.buffers = {{96}};
  // Local [6, 8] (transposed a): columns 0..3 from rows [0,4), columns 4..7 from rows [4,8).
  l.pieces.push_back(P(0, {{0, 0}, {4, 6}}, 0, {1, 8}));
  l.pieces.push_back(P(0, {{4, 0}, {8, 6}}, 8, {1, 8}));
  EXPECT_TRUE(ValidateLayout(inv, l, Role::kRollout, "r").ok());
  l.pieces[1].offset_bytes = 6;  // now column 3 of both
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "overlaps");
  EXPECT_TRUE(ValidateLayout(inv, l, Role::kTrainer, "t").ok());  // sources may share bytes
}

TEST(ValidateLayout, Errors) {
  Inventory inv = Small();
  auto one = [&](Piece p, int64_t buf = 1024) {
    WorkerLayout l;
    l.buffers = {{buf}};
    l.pieces.push_back(std::move(p));
    return ValidateLayout(inv, l, Role::kRollout, "rollout/r1/2");
  };
  ExpectError(one(P(0, {{0, 0}, {9, 6}}, 0, {6, 1})), "box outside");
  ExpectError(one(P(0, {{0, 0}, {9, 6}}, 0, {6, 1})), "a.weight");
  ExpectError(one(P(0, {{0, 0}, {9, 6}}, 0, {6, 1})), "[0:9, 0:6]");
  ExpectError(one(P(0, {{0, 0}, {9, 6}}, 0, {6, 1})), "rollout/r1/2");
  ExpectError(one(P(0, {{0}, {8}}, 0, {1})), "rank mismatch");
  ExpectError(one(P(0, {{0, 0}, {8, 6}}, 0, {6})), "rank mismatch");
  ExpectError(one(P(2, {{0}, {8}}, 0, {1})), "no such tensor");
  ExpectError(one(P(0, {{0, 0}, {8, 6}}, 0, {6, -1})), "negative stride");
  ExpectError(one(P(0, {{0, 0}, {8, 6}}, 0, {3, 1})), "alias");
  ExpectError(one(P(0, {{0, 0}, {8, 6}}, 0, {6, 1}), 95), "beyond buffer");  // needs 96 bytes
  EXPECT_TRUE(one(P(0, {{0, 0}, {8, 6}}, 0, {6, 1}), 96).ok());
  ExpectError(one(P(0, {{0, 0}, {8, 6}}, 2, {6, 1}), 96), "beyond buffer");
  ExpectError(one(P(1, {{0}, {10}}, 2, {1})), "multiple of the element size");
  ExpectError(one(P(0, {{0, 0}, {8, 6}}, 0, {6, 1}, 1)), "not registered");
  ExpectError(one(P(0, {{2, 0}, {2, 6}}, 0, {6, 1})), "empty box");

  WorkerLayout l;
  l.buffers = {{1024}};
  l.pieces.push_back(P(0, {{0, 0}, {4, 6}}, 0, {6, 1}));
  l.pieces.push_back(P(1, {{0}, {10}}, 40, {1}));  // starts inside the first piece (48 bytes)
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "r"), "overlaps");
}

Worker W(std::string id, Role role, std::vector<Piece> pieces) {
  Worker w;
  w.id = std::move(id);
  w.role = role;
  w.layout.buffers = {{1 << 20}};
  w.layout.pieces = std::move(pieces);
  return w;
}

// Found by tests/fuzz/fuzz_validate_layout: the farthest byte of a piece was computed in int64 without
// overflow checks, so a huge offset or stride wrapped negative and passed the buffer-bounds check (the
// daemon would then copy far outside the worker's buffer).
TEST(ValidateLayout, HugeOffsetsAndStridesDoNotWrapAround) {
  Inventory inv;
  inv.tensors.push_back({"w", {3, 3}, DType::kF32});
  WorkerLayout l;
  l.buffers = {{1024}};
  l.pieces.push_back(P(0, {{0, 0}, {1, 1}}, std::numeric_limits<int64_t>::max() / 4 * 4, {3, 1}));
  ExpectError(ValidateLayout(inv, l, Role::kTrainer, "trainer/0"), "overflows");
  l.pieces[0] = P(0, {{0, 0}, {3, 3}}, 0, {1, (int64_t{1} << 62) / 3});
  ExpectError(ValidateLayout(inv, l, Role::kRollout, "rollout/0"), "overflows");
  l.pieces[0] = P(0, {{0, 0}, {3, 3}}, 0, {3, 1});
  EXPECT_TRUE(ValidateLayout(inv, l, Role::kRollout, "rollout/0").ok());
  // A tensor whose element count does not fit int64 (its box volume overflowed).
  inv.tensors[0].shape = {int64_t{1} << 40, int64_t{1} << 40};
  l.pieces[0] = P(0, {{0, 0}, {int64_t{1} << 40, int64_t{1} << 40}}, 0, {int64_t{1} << 40, 1});
  ExpectError(ValidateLayout(inv, l, Role::kTrainer, "trainer/0"), "more than 2^62 elements");
}

TEST(ValidateCoverage, UnionOfSourcesAndMissingElements) {
  Inventory inv = Small();
  Worker s0 = W("trainer/0", Role::kTrainer, {P(0, {{0, 0}, {8, 3}}, 0, {3, 1})});
  Worker s1 = W("trainer/1", Role::kTrainer, {P(0, {{0, 3}, {5, 6}}, 0, {3, 1}), P(1, {{0}, {10}}, 0, {1})});
  Worker d = W("rollout/0", Role::kRollout, {P(0, {{2, 1}, {5, 5}}, 0, {4, 1})});  // needs s0 and s1
  EXPECT_TRUE(ValidateCoverage(inv, {&s0, &s1}, {&d}).ok());
  Worker d2 = W("rollout/1", Role::kRollout, {P(0, {{4, 1}, {7, 5}}, 0, {4, 1})});  // rows 5,6 cols 3,4 missing
  absl::Status s = ValidateCoverage(inv, {&s0, &s1}, {&d, &d2});
  ExpectError(s, "rollout/1");
  ExpectError(s, "a.weight");
  ExpectError(s, "[4:7, 1:5]");
  ExpectError(s, "[5:7, 3:5]");
  Worker d3 = W("rollout/2", Role::kRollout, {P(1, {{0}, {10}}, 0, {1})});
  ExpectError(ValidateCoverage(inv, {&s0}, {&d3}), "b.bias");
}

Worker Boxes(const std::string& id, Role role, int32_t tensor, const std::vector<Box>& boxes) {
  std::vector<Piece> pieces;
  for (const Box& b : boxes) pieces.push_back(P(tensor, b, 0, {b.end[1] - b.begin[1], 1}));
  return W(id, role, std::move(pieces));
}

TEST(ValidateCoverage, DiagonalSourcesAreRefusedAtOnce) {
  // Security review, variant B: 16384 one-element sources on the diagonal of [65536, 65536], the
  // destination holding it all (box subtraction took 24 s). Their boundaries form 32769^2 cells.
  Inventory inv;
  inv.tensors.push_back({"big", {65536, 65536}, DType::kF32});
  std::vector<Box> diag;
  for (int64_t i = 0; i < 16384; ++i) diag.push_back(Box{{4 * i, 4 * i}, {4 * i + 1, 4 * i + 1}});
  Worker s = Boxes("trainer/0", Role::kTrainer, 0, diag);
  Worker d = Boxes("rollout/0", Role::kRollout, 0, {FullBox({65536, 65536})});
  absl::Status st = ValidateCoverage(inv, {&s}, {&d});
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("tensor `big`"), std::string::npos) << st;
}

TEST(ValidateCoverage, OverlappingSourceBoxesPastTheWorkBudgetAreRefused) {
  // 2047 diagonal sources make 4095^2 cells; 64 distinct boxes each covering nearly all of them
  // would walk ~1e9 cells, past the budget: refused before walking, naming the largest box.
  Inventory inv;
  inv.tensors.push_back({"w", {8192, 8192}, DType::kF32});
  std::vector<Box> boxes;
  for (int64_t i = 0; i < 2047; ++i) boxes.push_back(Box{{4 * i, 4 * i}, {4 * i + 1, 4 * i + 1}});
  for (int64_t k = 0; k < 64; ++k) boxes.push_back(Box{{0, 0}, {8192, 8192 - 4 * k}});
  Worker s = Boxes("trainer/0", Role::kTrainer, 0, boxes);
  Worker d = Boxes("rollout/0", Role::kRollout, 0, {FullBox({8192, 8192})});
  absl::Status st = ValidateCoverage(inv, {&s}, {&d});
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("tensor `w` (largest source box: worker `trainer/0` piece 2047"), std::string::npos) << st;
  EXPECT_NE(st.message().find(absl::StrCat("work budget of ", CoverageWorkBudget(2047 + 64 + 1))), std::string::npos) << st;
  // The same boxes once each (one big box): a few cells per source, accepted.
  boxes.resize(2048);
  Worker s1 = Boxes("trainer/0", Role::kTrainer, 0, boxes);
  EXPECT_TRUE(ValidateCoverage(inv, {&s1}, {&d}).ok());
}

TEST(ValidateCoverage, DuplicateBoxesAreCheckedOnceAndTheFirstUncoveredPieceIsNamed) {
  Inventory inv;
  inv.tensors.push_back({"w", {4096, 4096}, DType::kF32});
  std::vector<Box> copies(20000, FullBox({4096, 4096}));
  copies.push_back(Box{{0, 0}, {1, 1}});
  Worker s = Boxes("trainer/0", Role::kTrainer, 0, copies);
  Worker d = Boxes("rollout/0", Role::kRollout, 0, {FullBox({4096, 4096})});
  EXPECT_TRUE(ValidateCoverage(inv, {&s}, {&d}).ok());
  Worker half = Boxes("trainer/1", Role::kTrainer, 0, std::vector<Box>(20000, Box{{0, 0}, {4096, 2048}}));
  Worker d1 = Boxes("rollout/1", Role::kRollout, 0, {Box{{0, 0}, {4096, 1024}}, Box{{1, 1000}, {3, 3000}}});
  absl::Status st = ValidateCoverage(inv, {&half}, {&d, &d1});
  ExpectError(st, "worker `rollout/0` piece 0");
  ExpectError(st, "[0:1, 2048:3000] are held by no source");  // its first uncovered grid cell
  EXPECT_TRUE(ValidateCoverage(inv, {&half}, {&d1}).code() == absl::StatusCode::kInvalidArgument);
  ExpectError(ValidateCoverage(inv, {&half}, {&d1}), "worker `rollout/1` piece 1");
}

TEST(ValidateProblem, KimiK2SpecLayoutsAreValid) {
  auto c = ParseHfConfig(ReadTestdata("kimi-k2.json"));
  ASSERT_TRUE(c.ok());
  Problem problem;
  auto inv = BuildInventory(*c, DType::kBF16);
  ASSERT_TRUE(inv.ok());
  problem.inventory = std::move(*inv);
  ParallelConfig train{.preset = "megatron", .tp = 8, .pp = 8, .dp = 4, .ep = 32, .etp = 1};
  ParallelConfig roll{.preset = "vllm", .tp = 16, .expert_parallel = true, .replicas = 8};
  for (int side = 0; side < 2; ++side) {
    const ParallelConfig& par = side == 0 ? train : roll;
    auto b = PresetBuilder::Create(*c, problem.inventory, par);
    ASSERT_TRUE(b.ok()) << b.status();
    for (int r = 0; r < b->world_size(); ++r) {
      auto l = b->Make(r);
      ASSERT_TRUE(l.ok()) << l.status();
      Worker w;
      w.id = absl::StrCat(par.preset, "/", r);
      w.role = side == 0 ? Role::kTrainer : Role::kRollout;
      w.layout = std::move(l->layout);
      problem.workers.push_back(std::move(w));
    }
  }
  EXPECT_TRUE(ValidateProblem(problem).ok()) << ValidateProblem(problem);
  // Drop one trainer stage's pieces for one expert: coverage must fail and name it.
  for (Worker& w : problem.workers) {
    if (w.role != Role::kTrainer) continue;
    auto& ps = w.layout.pieces;
    ps.erase(std::remove_if(ps.begin(), ps.end(),
                            [&](const Piece& p) {
                              return problem.inventory.tensors[p.tensor].name ==
                                     "model.layers.5.mlp.experts.7.down_proj.weight";
                            }),
             ps.end());
  }
  ExpectError(ValidateProblem(problem), "model.layers.5.mlp.experts.7.down_proj.weight");
}

}  // namespace
}  // namespace wb::planner
