// Randomized property test: random trainer layouts (TP/PP/DP splits with uneven cuts, interleaved
// multi-piece shards, expert-like 2-level splits, FSDP flat ranges), random rollout layouts (TP
// splits, replicated heads, expert parallel, transposed strides, replicas), random placement
// (packed, colocated, scattered), random bandwidths, budgets and split grains. For every strategy
// the plan is checked element by element (plan_checker.h); the weightbridge plan must also be
// redundancy-free and respect the staging budget, and no plan that copies same-node bytes inside
// the node may beat the lower bound.

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/cost_model.h"
#include "planner/fingerprint.h"
#include "planner/packed_layout.h"
#include "planner/plan_checker.h"
#include "planner/planner.h"
#include "planner/quantized.h"

namespace wb::planner {
namespace {

using Rng = std::mt19937_64;

int64_t U(Rng& rng, int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }

// k sorted cut points splitting [0, n) into k (possibly uneven, never empty when k <= n) ranges.
std::vector<int64_t> Cuts(Rng& rng, int64_t n, int64_t k, bool even) {
  k = std::max<int64_t>(1, std::min(k, n));
  std::vector<int64_t> c = {0};
  if (even) {
    for (int64_t i = 1; i < k; ++i) c.push_back(n * i / k);
  } else {
    std::vector<int64_t> all;
    for (int64_t i = 1; i < n; ++i) all.push_back(i);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(k - 1);
    std::sort(all.begin(), all.end());
    c.insert(c.end(), all.begin(), all.end());
  }
  c.push_back(n);
  return c;
}

Box Slice(const std::vector<int64_t>& shape, size_t dim, int64_t b, int64_t e) {
  Box box = FullBox(shape);
  if (!shape.empty()) {
    box.begin[dim] = b;
    box.end[dim] = e;
  }
  return box;
}

void AddPiece(const Problem& p, WorkerLayout& l, int t, const Box& box, bool transposed) {
  Piece pc;
  pc.tensor = t;
  pc.box = box;
  std::vector<int64_t> ext;
  for (size_t d = 0; d < box.begin.size(); ++d) ext.push_back(box.end[d] - box.begin[d]);
  pc.strides = ContiguousStrides(ext);
  if (transposed && ext.size() == 2) pc.strides = {1, ext[0]};
  if (l.buffers.empty()) l.buffers.push_back(BufferInfo{0});
  pc.offset_bytes = l.buffers[0].size_bytes;
  l.buffers[0].size_bytes += BoxVolume(box) * DTypeSize(p.inventory.tensors[t].dtype);
  l.pieces.push_back(std::move(pc));
}

// Splits `box` along dim 0 into 1..3 consecutive pieces (like an interleaved fused shard).
void AddMaybeSplit(Rng& rng, const Problem& p, WorkerLayout& l, int t, const Box& box, bool transposed) {
  if (box.begin.empty() || box.end[0] - box.begin[0] < 2 || U(rng, 0, 2) != 0) {
    AddPiece(p, l, t, box, transposed);
    return;
  }
  const int64_t mid = U(rng, box.begin[0] + 1, box.end[0] - 1);
  Box a = box, b = box;
  a.end[0] = mid;
  b.begin[0] = mid;
  AddPiece(p, l, t, a, transposed);
  AddPiece(p, l, t, b, transposed);
}

Problem RandomProblem(Rng& rng) {
  Problem p;
  p.inventory.architecture = "Random";
  const int nt = static_cast<int>(U(rng, 1, 6));
  for (int t = 0; t < nt; ++t) {
    TensorSpec ts;
    ts.name = absl::StrCat("t", t);
    const int rank = static_cast<int>(U(rng, 0, 10) == 0 ? 0 : U(rng, 1, 3));
    for (int d = 0; d < rank; ++d) ts.shape.push_back(U(rng, 1, d == 0 ? 12 : 7));
    ts.dtype = U(rng, 0, 1) ? DType::kBF16 : DType::kF32;
    p.inventory.tensors.push_back(ts);
  }
  const auto& T = p.inventory.tensors;

  // Trainers: rank = tp_r + tp*(dp_r + dp*pp_r).
  const int tp = static_cast<int>(U(rng, 1, 4)), pp = static_cast<int>(U(rng, 1, 3)),
            dp = static_cast<int>(U(rng, 1, 3));
  std::vector<WorkerLayout> trainers(tp * pp * dp);
  for (int t = 0; t < nt; ++t) {
    const auto& shape = T[t].shape;
    const int stage = static_cast<int>(U(rng, 0, pp - 1));
    const int mode = shape.empty() ? 1 : static_cast<int>(U(rng, 0, 3));
    const size_t dim = shape.empty() ? 0 : U(rng, 0, shape.size() - 1);
    const std::vector<int64_t> tcuts = shape.empty() ? std::vector<int64_t>{} : Cuts(rng, shape[dim], tp, U(rng, 0, 1));
    const int group = tp * dp;
    std::vector<int64_t> flat;
    if (mode == 2) flat = Cuts(rng, BoxVolume(FullBox(shape)), group, U(rng, 0, 1));
    // Expert-like: dim-0 ranges over `ep` groups, each split along the last dim by `etp`.
    int ep = 1, etp = 1;
    std::vector<int64_t> ecuts, icuts;
    if (mode == 3) {
      ep = static_cast<int>(U(rng, 1, group));
      while (group % ep) --ep;
      etp = static_cast<int>(group / ep);
      etp = static_cast<int>(std::min<int64_t>(etp, shape.back()));
      while ((group / ep) % etp) --etp;
      ecuts = Cuts(rng, shape[0], ep, true);
      icuts = Cuts(rng, shape.back(), etp, true);
    }
    for (int dr = 0; dr < dp; ++dr) {
      for (int tr = 0; tr < tp; ++tr) {
        WorkerLayout& l = trainers[tr + tp * (dr + dp * stage)];
        const int local = tr + tp * dr;
        switch (mode) {
          case 0:
            if (static_cast<size_t>(tr + 1) < tcuts.size()) {
              AddMaybeSplit(rng, p, l, t, Slice(shape, dim, tcuts[tr], tcuts[tr + 1]), false);
            }
            break;
          case 1:
            AddPiece(p, l, t, FullBox(shape), false);
            break;
          case 2:
            if (static_cast<size_t>(local + 1) < flat.size()) {
              for (const Box& b : FlatRangeToBoxes(shape, flat[local], flat[local + 1])) AddPiece(p, l, t, b, false);
            }
            break;
          case 3: {
            const int er = (local / etp) % ep, ir = local % etp;
            if (static_cast<size_t>(er + 1) < ecuts.size() && static_cast<size_t>(ir + 1) < icuts.size()) {
              Box b = Slice(shape, 0, ecuts[er], ecuts[er + 1]);
              b.begin.back() = std::max(b.begin.back(), icuts[ir]);
              b.end.back() = std::min(b.end.back(), icuts[ir + 1]);
              if (shape.size() == 1) {
                b = Slice(shape, 0, std::max(ecuts[er], icuts[ir]), std::min(ecuts[er + 1], icuts[ir + 1]));
              }
              if (!BoxEmpty(b)) AddPiece(p, l, t, b, false);
            }
            break;
          }
        }
      }
    }
  }

  // Rollouts: replica-major, rank = replica*otp + tp_rank.
  const int otp = static_cast<int>(U(rng, 1, 4)), replicas = static_cast<int>(U(rng, 1, 3));
  std::vector<WorkerLayout> rollouts(otp * replicas);
  const bool transposed_engine = U(rng, 0, 3) == 0;
  for (int t = 0; t < nt; ++t) {
    const auto& shape = T[t].shape;
    const int mode = shape.empty() ? 1 : static_cast<int>(U(rng, 0, 2));
    const size_t dim = shape.empty() ? 0 : U(rng, 0, shape.size() - 1);
    // Fewer chunks than ranks: neighbouring ranks share a chunk (replicated KV heads).
    const int64_t chunks = U(rng, 0, 2) == 0 ? U(rng, 1, otp) : otp;
    const std::vector<int64_t> cuts = shape.empty() ? std::vector<int64_t>{} : Cuts(rng, shape[dim], chunks, U(rng, 0, 1));
    const int64_t real_chunks = static_cast<int64_t>(cuts.size()) - 1;
    for (int r = 0; r < replicas; ++r) {
      for (int k = 0; k < otp; ++k) {
        WorkerLayout& l = rollouts[r * otp + k];
        if (mode == 1) {
          AddPiece(p, l, t, FullBox(shape), transposed_engine);
        } else {
          const int64_t c = static_cast<int64_t>(k) * real_chunks / otp;
          AddMaybeSplit(rng, p, l, t, Slice(shape, dim, cuts[c], cuts[c + 1]), transposed_engine);
        }
      }
    }
  }

  // Placement.
  const int gpn = static_cast<int>(1 << U(rng, 0, 3));
  const int placement = static_cast<int>(U(rng, 0, 4));  // 0-2 packed, 3 colocated, 4 scattered
  p.topology.colocated = placement == 3;
  const int ntr = static_cast<int>(trainers.size()), nro = static_cast<int>(rollouts.size());
  std::vector<std::pair<int, int>> slots;
  const int first_rollout = placement == 3 ? 0 : (ntr + gpn - 1) / gpn * gpn;
  for (int i = 0; i < ntr; ++i) slots.emplace_back(i / gpn, i % gpn);
  for (int i = 0; i < nro; ++i) slots.emplace_back((first_rollout + i) / gpn, (first_rollout + i) % gpn);
  if (placement == 4) {
    std::vector<int> ids(ntr + nro);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int>(i);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (size_t i = 0; i < ids.size(); ++i) slots[i] = {ids[i] / gpn, ids[i] % gpn};
  }
  for (int i = 0; i < ntr; ++i) {
    Worker w;
    w.id = absl::StrCat("trainer/", i);
    w.role = Role::kTrainer;
    w.node = slots[i].first;
    w.gpu = slots[i].second;
    w.layout = std::move(trainers[i]);
    p.workers.push_back(std::move(w));
  }
  for (int i = 0; i < nro; ++i) {
    Worker w;
    w.id = absl::StrCat("rollout/", i / otp, "/", i % otp);
    w.role = Role::kRollout;
    w.node = slots[ntr + i].first;
    w.gpu = slots[ntr + i].second;
    w.layout = std::move(rollouts[i]);
    p.workers.push_back(std::move(w));
  }
  // Interleave worker order sometimes: MakePlan must not assume trainers come first.
  if (U(rng, 0, 2) == 0) std::shuffle(p.workers.begin(), p.workers.end(), rng);
  p.topology.nic_GBps_per_gpu = static_cast<double>(U(rng, 10, 100));
  p.topology.intra_node_GBps = static_cast<double>(U(rng, 50, 500));
  p.staging_budget_bytes = U(rng, 0, 1) ? U(rng, 16, 2048) : (int64_t{2} << 30);
  return p;
}

// Makes some rollout tensors quantised (random block and format; only where every rollout piece of
// the tensor lies on the block grid, as ValidateLayout requires), sometimes one rollout worker in
// a different format (so sender-side quantisation must fall back for the fragments they share).
void QuantizeSomeRollouts(Rng& rng, Problem& p) {
  static constexpr DType kElem[] = {DType::kF8E4M3, DType::kF8E4M3, DType::kI4};
  static constexpr DType kScale[] = {DType::kF32, DType::kE8M0, DType::kBF16};
  for (size_t t = 0; t < p.inventory.tensors.size(); ++t) {
    const auto& shape = p.inventory.tensors[t].shape;
    if (shape.empty() || U(rng, 0, 2) == 0) continue;
    Quantization q;
    const int f = static_cast<int>(U(rng, 0, 2));
    q.dtype = kElem[f];
    q.scale_dtype = kScale[f];
    for (size_t d = 0; d < shape.size(); ++d) q.block.push_back(int64_t{1} << U(rng, 0, 2));
    Quantization other = q;
    other.block.back() = q.block.back() == 1 ? 2 : 1;
    if (q.dtype == DType::kI4) {  // pairs along the last dim (CheckInt4Packing)
      if (shape.back() % 2 != 0) continue;
      q.block.back() = 2 * U(rng, 1, 2);
      other.block.back() = q.block.back() == 2 ? 4 : 2;
    }
    int32_t odd_worker = U(rng, 0, 3) == 0 ? static_cast<int32_t>(U(rng, 0, p.workers.size() - 1)) : -1;
    bool aligned = true;
    for (const Worker& w : p.workers) {
      for (const Piece& pc : w.layout.pieces) {
        if (w.role == Role::kRollout && pc.tensor == static_cast<int32_t>(t)) {
          aligned &= BoxOnBlockGrid(pc.box, shape, q.block) && BoxOnBlockGrid(pc.box, shape, other.block);
        }
      }
    }
    if (!aligned) continue;
    for (size_t w = 0; w < p.workers.size(); ++w) {
      if (p.workers[w].role != Role::kRollout) continue;
      for (Piece& pc : p.workers[w].layout.pieces) {
        if (pc.tensor == static_cast<int32_t>(t)) pc.quant = static_cast<int32_t>(w) == odd_worker ? other : q;
      }
    }
  }
}

// What the generator exercised, over all problems of a test.
struct Seen {
  int with_relays = 0, with_same_gpu = 0, sender_quantized = 0, receiver_quantized = 0, quantized_relays = 0;
};

// Plans `p` with every strategy and checks each plan element by element (plan_checker.h): complete,
// the makespan its loads give, the lower bound (which no plan that copies same-node bytes inside the
// node beats), and for weightbridge no redundancy and a deterministic fingerprint.
void CheckAllStrategies(const Problem& p, const PlanOptions& opt, const std::string& ctx, Seen& seen) {
  const double lb = LowerBound(p, opt.sender_quantization);
  ASSERT_GE(lb, 0) << ctx;
  for (Strategy s : {Strategy::kWeightBridge, Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast,
                     Strategy::kP2PNoDedup}) {
    auto plan = MakePlanWithOptions(p, s, opt);
    ASSERT_TRUE(plan.ok()) << ctx << " " << StrategyName(s) << ": " << plan.status();
    CheckOptions co;
    co.require_no_redundancy = s == Strategy::kWeightBridge;
    co.allow_staging = s == Strategy::kRank0Broadcast;
    co.check_budget = true;
    const absl::Status st = CheckPlanElementwise(p, *plan, co);
    ASSERT_TRUE(st.ok()) << ctx << " " << StrategyName(s) << ": " << st;
    EXPECT_TRUE(plan->stats.complete) << ctx;
    EXPECT_NEAR(plan->stats.makespan_s, PredictMakespan(p, *plan), 1e-12) << ctx;
    EXPECT_NEAR(plan->stats.lower_bound_s, lb, 1e-12 + 1e-9 * lb) << ctx;
    if (s == Strategy::kWeightBridge || s == Strategy::kP2PNoDedup) {
      // Both copy same-node bytes inside the node, so the bound applies.
      EXPECT_GE(plan->stats.makespan_s, lb * (1 - 1e-9)) << ctx << " " << StrategyName(s);
    }
    if (s == Strategy::kWeightBridge) {
      EXPECT_EQ(plan->stats.redundant_bytes, 0) << ctx;
      for (const Bucket& b : plan->buckets) {
        for (const TransferOp& op : b.ops) {
          seen.with_relays += op.route == Route::kInterNode && p.workers[op.src_worker].role == Role::kRollout;
          seen.with_same_gpu += op.route == Route::kSameGpu;
          seen.sender_quantized += op.sender_quantized;
          seen.quantized_relays += op.sender_quantized && p.workers[op.src_worker].role == Role::kRollout;
          seen.receiver_quantized += !op.sender_quantized && op.dst_piece >= 0 &&
                                     p.workers[op.dst_worker].layout.pieces[op.dst_piece].quant.has_value();
        }
      }
      auto again = MakePlanWithOptions(p, s, opt);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ(again->fingerprint, plan->fingerprint) << ctx;
    }
    // The coordinator keeps layouts packed (planner/packed_layout.h) and plans from them unpacked:
    // the same problem, so the same plan, op for op (Fingerprint covers every op field).
    Problem repacked = p;
    for (Worker& w : repacked.workers) {
      absl::StatusOr<PackedLayout> packed = PackedLayout::Pack(w.layout);
      ASSERT_TRUE(packed.ok()) << ctx << ": " << packed.status();
      w.layout = packed->Unpack();
    }
    ASSERT_EQ(ProblemFingerprint(repacked), ProblemFingerprint(p)) << ctx;
    auto from_packed = MakePlanWithOptions(repacked, s, opt);
    ASSERT_TRUE(from_packed.ok()) << ctx << " " << StrategyName(s) << ": " << from_packed.status();
    EXPECT_EQ(Fingerprint(repacked, *from_packed), Fingerprint(p, *plan)) << ctx << " " << StrategyName(s);
    EXPECT_EQ(from_packed->fingerprint, plan->fingerprint) << ctx << " " << StrategyName(s);
    EXPECT_EQ(from_packed->stats.makespan_s, plan->stats.makespan_s) << ctx << " " << StrategyName(s);
  }
}

TEST(PlanPropertyTest, RandomLayoutsGiveCorrectPlans) {
  Rng rng(20260512);
  int checked = 0;
  Seen seen;
  for (int iter = 0; iter < 1000; ++iter) {
    Problem p = RandomProblem(rng);
    PlanOptions opt;
    opt.max_fragment_bytes = U(rng, 0, 1) ? -1 : U(rng, 8, 256);
    // Its own generator, so the problems above stay those of earlier versions of this test.
    Rng qrng(static_cast<uint64_t>(iter) * 7919 + 17);
    if (U(qrng, 0, 1) == 0) QuantizeSomeRollouts(qrng, p);
    opt.sender_quantization = U(qrng, 0, 2) != 0;
    const std::string ctx = absl::StrCat("iteration ", iter, opt.sender_quantization ? " (sender quantisation)" : "");
    ASSERT_NO_FATAL_FAILURE(CheckAllStrategies(p, opt, ctx, seen));
    ++checked;
  }
  EXPECT_EQ(checked, 1000);
  // The generator must actually exercise cross-node relays and colocated copies.
  EXPECT_GT(seen.with_relays, 0);
  EXPECT_GT(seen.with_same_gpu, 0);
  // ... and sender-side quantisation, its relays and its fallback.
  EXPECT_GT(seen.sender_quantized, 0);
  EXPECT_GT(seen.quantized_relays, 0);
  EXPECT_GT(seen.receiver_quantized, 0);
}

// Aliased trainer pieces (ValidateLayout accepts them; a hostile or sloppy trainer may register the
// same box several times): some trainers get 1-3 extra copies of random pieces, each either at the
// same buffer place (an alias) or at a new place at the end of the buffer, inserted before or after
// the original; sometimes a second trainer worker on the same GPU holds a copy of a trainer's whole
// layout. The same properties hold, and a trainer never sends from a piece when one of its
// lower-indexed pieces has the same box (one GPU, one choice: planner/fragments.h).
void DuplicateSomeTrainerPieces(Rng& rng, Problem& p) {
  const size_t workers = p.workers.size();
  for (size_t w = 0; w < workers; ++w) {
    if (p.workers[w].role != Role::kTrainer || U(rng, 0, 1) == 0) continue;
    WorkerLayout& l = p.workers[w].layout;
    const size_t n = l.pieces.size();
    for (size_t i = 0; i < n; ++i) {
      if (U(rng, 0, 2) != 0) continue;
      const int64_t copies = U(rng, 1, 3);
      for (int64_t c = 0; c < copies; ++c) {
        Piece d = l.pieces[i];
        if (U(rng, 0, 1) == 0) {  // a second place in the buffer (contiguous: the box's bytes)
          d.offset_bytes = l.buffers[d.buffer].size_bytes;
          l.buffers[d.buffer].size_bytes += BoxVolume(d.box) * DTypeSize(p.inventory.tensors[d.tensor].dtype);
        }
        const size_t at = static_cast<size_t>(U(rng, 0, static_cast<int64_t>(l.pieces.size())));
        l.pieces.insert(l.pieces.begin() + at, std::move(d));
      }
    }
    if (U(rng, 0, 3) == 0) {
      Worker twin = p.workers[w];
      twin.id += "/twin";
      p.workers.push_back(std::move(twin));
    }
  }
}

TEST(PlanPropertyTest, AliasedTrainerPiecesGiveCorrectPlans) {
  Rng rng(20261206);
  int checked = 0, aliased_problems = 0;
  int64_t from_aliased = 0;  // ops sent from a trainer piece that has a copy
  Seen seen;
  for (int iter = 0; iter < 1000; ++iter) {
    Problem p = RandomProblem(rng);
    DuplicateSomeTrainerPieces(rng, p);
    PlanOptions opt;
    opt.max_fragment_bytes = U(rng, 0, 1) ? -1 : U(rng, 8, 256);
    if (U(rng, 0, 1) == 0) QuantizeSomeRollouts(rng, p);
    opt.sender_quantization = U(rng, 0, 2) != 0;
    const std::string ctx = absl::StrCat("aliased iteration ", iter);
    // Per trainer piece: does a lower-indexed piece of the same worker have the same box (a later
    // copy), does any other piece (has a copy)?
    bool any = false;
    std::vector<std::vector<uint8_t>> later_copy(p.workers.size()), has_copy(p.workers.size());
    for (size_t w = 0; w < p.workers.size(); ++w) {
      const auto& pcs = p.workers[w].layout.pieces;
      later_copy[w].assign(pcs.size(), 0);
      has_copy[w].assign(pcs.size(), 0);
      if (p.workers[w].role != Role::kTrainer) continue;
      for (size_t j = 0; j < pcs.size(); ++j) {
        for (size_t i = 0; i < j; ++i) {
          if (pcs[i].tensor == pcs[j].tensor && pcs[i].box.begin == pcs[j].box.begin &&
              pcs[i].box.end == pcs[j].box.end) {
            later_copy[w][j] = has_copy[w][j] = has_copy[w][i] = 1;
          }
        }
        any |= later_copy[w][j] != 0;
      }
    }
    aliased_problems += any;
    ASSERT_NO_FATAL_FAILURE(CheckAllStrategies(p, opt, ctx, seen));
    for (Strategy s : {Strategy::kWeightBridge, Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast,
                       Strategy::kP2PNoDedup}) {
      auto plan = MakePlanWithOptions(p, s, opt);
      ASSERT_TRUE(plan.ok());
      for (const Bucket& b : plan->buckets) {
        for (const TransferOp& op : b.ops) {
          if (op.src_piece < 0 || p.workers[op.src_worker].role != Role::kTrainer) continue;
          from_aliased += has_copy[op.src_worker][op.src_piece];
          EXPECT_FALSE(later_copy[op.src_worker][op.src_piece])
              << ctx << " " << StrategyName(s) << ": sends from " << p.workers[op.src_worker].id << " piece "
              << op.src_piece << ", a copy of a lower-indexed piece";
        }
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, 1000);
  EXPECT_GT(aliased_problems, 250);
  EXPECT_GT(from_aliased, 0);
  EXPECT_GT(seen.with_relays, 0);
  EXPECT_GT(seen.with_same_gpu, 0);
  EXPECT_GT(seen.sender_quantized, 0);
}

// Catch-up problems (PlanOptions::quantized_sources): some rollouts of a random problem, quantised
// or not, become sources (ROLE_TRAINER keeping their pieces' quantisation), sometimes without the
// original trainers. Every plan is element-wise correct, and a quantised source piece only ever
// serves copies of its quantised bytes in its own format (plan_checker.h); a problem whose late
// rollouts need a form no source holds fails FAILED_PRECONDITION (so does one no source covers).
TEST(PlanPropertyTest, CatchUpsFromQuantisedSourcesGiveCorrectPlans) {
  Rng rng(20261207);
  int planned = 0, refused = 0, copies = 0;
  for (int iter = 0; iter < 600; ++iter) {
    Problem p = RandomProblem(rng);
    QuantizeSomeRollouts(rng, p);
    Problem q = p;
    q.workers.clear();
    const bool keep_trainers = U(rng, 0, 2) == 0;
    int sources = 0;
    for (const Worker& w : p.workers) {
      if (w.role == Role::kTrainer) {
        if (keep_trainers) q.workers.push_back(w);
        continue;
      }
      Worker c = w;
      if (U(rng, 0, 1) == 0) {
        c.role = Role::kTrainer;
        ++sources;
      }
      q.workers.push_back(std::move(c));
    }
    if (sources == 0) continue;
    PlanOptions opt;
    opt.quantized_sources = true;
    opt.max_fragment_bytes = U(rng, 0, 1) ? -1 : U(rng, 8, 256);
    const std::string ctx = absl::StrCat("iteration ", iter);
    auto plan = MakePlanWithOptions(q, Strategy::kWeightBridge, opt);
    if (!plan.ok()) {
      ASSERT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition) << ctx << ": " << plan.status();
      ++refused;
      continue;
    }
    CheckOptions co;
    co.require_no_redundancy = true;
    co.check_budget = true;
    const absl::Status st = CheckPlanElementwise(q, *plan, co);
    ASSERT_TRUE(st.ok()) << ctx << ": " << st;
    EXPECT_GE(plan->stats.makespan_s, plan->stats.lower_bound_s * (1 - 1e-9)) << ctx;
    for (const Bucket& b : plan->buckets) {
      for (const TransferOp& op : b.ops) {
        const Worker& sw = q.workers[op.src_worker];
        copies += sw.role == Role::kTrainer && op.src_piece >= 0 && sw.layout.pieces[op.src_piece].quant.has_value();
      }
    }
    ++planned;
  }
  // The generator must exercise plans, refusals and copies of quantised sources' bytes.
  EXPECT_GT(planned, 50);
  EXPECT_GT(refused, 0);
  EXPECT_GT(copies, 0);
}

}  // namespace
}  // namespace wb::planner
