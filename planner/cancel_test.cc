// Cancelling a plan (planner/cancel.h, PlanOptions::cancel; docs/planner.md "Cancelling a plan"),
// and DecideSenderQuantization's demotions, linear however long their chain.
//
// No timing: the check is called a deterministic number of times for a given problem (it is polled
// every kCancelPollUnits units of metered work), so "stops early" is "the check that said stop was
// the last one called, and the error names where the planner was, before its end".
#include "planner/cancel.h"

#include <map>
#include <random>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/fragments.h"
#include "planner/planner.h"
#include "planner/quantized.h"
#include "planner/sender_quant.h"

namespace wb::planner {
namespace {

void AddWorker(Problem& p, Role role, int node, int gpu, const std::vector<std::pair<int, Box>>& pieces,
               const std::optional<Quantization>& quant = std::nullopt) {
  Worker w;
  w.id = absl::StrCat(role == Role::kTrainer ? "trainer/" : "rollout/", p.workers.size());
  w.role = role;
  w.node = node;
  w.gpu = gpu;
  int64_t off = 0;
  for (const auto& [t, box] : pieces) {
    Piece pc;
    pc.tensor = t;
    pc.box = box;
    pc.offset_bytes = off;
    std::vector<int64_t> shape;
    for (size_t d = 0; d < box.begin.size(); ++d) shape.push_back(box.end[d] - box.begin[d]);
    pc.strides = ContiguousStrides(shape);
    pc.quant = quant;
    off += BoxVolume(box) * DTypeSize(p.inventory.tensors[t].dtype);
    w.layout.pieces.push_back(pc);
  }
  w.layout.buffers.push_back(BufferInfo{off});
  p.workers.push_back(std::move(w));
}

Quantization Mx(int64_t rows, int64_t cols) {
  Quantization q;
  q.dtype = DType::kF8E4M3;
  q.scale_dtype = DType::kF32;
  q.block = {rows, cols};
  return q;
}

// Big enough that every phase does many polls' worth of work: 128 tensors of 1024 x 256 bf16,
// 8 trainers (row eighths, 2 nodes), 16 rollout replicas of tp4 (column quarters) on 8 nodes, fp8
// 1x32 rollouts, an 8 KiB staging budget (fragments split into 2 KiB chunks of 16 rows): 32768
// fragments, 524288 ops.
Problem BigProblem() {
  Problem p;
  p.inventory.architecture = "Big";
  constexpr int kTensors = 128;
  constexpr int64_t kRows = 1024, kCols = 256;
  for (int t = 0; t < kTensors; ++t) p.inventory.tensors.push_back({absl::StrCat("t", t), {kRows, kCols}, DType::kBF16});
  for (int tr = 0; tr < 8; ++tr) {
    std::vector<std::pair<int, Box>> pieces;
    for (int t = 0; t < kTensors; ++t) pieces.push_back({t, Box{{tr * kRows / 8, 0}, {(tr + 1) * kRows / 8, kCols}}});
    AddWorker(p, Role::kTrainer, tr / 4, tr % 4, pieces);
  }
  for (int rep = 0; rep < 16; ++rep) {
    for (int tp = 0; tp < 4; ++tp) {
      std::vector<std::pair<int, Box>> pieces;
      for (int t = 0; t < kTensors; ++t) pieces.push_back({t, Box{{0, tp * kCols / 4}, {kRows, (tp + 1) * kCols / 4}}});
      AddWorker(p, Role::kRollout, 2 + rep / 2, (rep % 2) * 4 + tp, pieces, Mx(1, 32));
    }
  }
  p.staging_budget_bytes = 8 << 10;
  return p;
}

// The check's calls, and a stop on call `stop_at` (0: never) with `code`.
struct Check {
  int64_t calls = 0;
  int64_t stop_at = 0;
  absl::StatusCode code = absl::StatusCode::kCancelled;
  CancelCheck Fn() {
    return [this]() -> absl::Status {
      ++calls;
      if (stop_at > 0 && calls >= stop_at) return absl::Status(code, "stop asked by the test");
      return absl::OkStatus();
    };
  }
};

PlanOptions WithCheck(Check& c, bool sender_quantization) {
  PlanOptions o;
  o.sender_quantization = sender_quantization;
  o.cancel = c.Fn();
  return o;
}

// The phase of a stop message: what follows "(planner stopped " up to its progress (":") or its end.
std::string PhaseOf(absl::string_view message) {
  const size_t at = message.find("(planner stopped ");
  if (at == absl::string_view::npos) return "";
  const absl::string_view rest = message.substr(at + 17);
  return std::string(rest.substr(0, rest.find_first_of(":)")));
}

// A check that never says stop changes nothing: same plan, same fingerprint, every strategy, with
// and without sender-side quantisation; and the big problem polls many times in every phase.
TEST(CancelTest, AnUncancelledPlanIsTheSamePlan) {
  const Problem p = BigProblem();
  for (bool sq : {false, true}) {
    for (Strategy s : {Strategy::kWeightBridge, Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast, Strategy::kP2PNoDedup}) {
      PlanOptions plain;
      plain.sender_quantization = sq;
      absl::StatusOr<Plan> a = MakePlanWithOptions(p, s, plain);
      Check c;
      absl::StatusOr<Plan> b = MakePlanWithOptions(p, s, WithCheck(c, sq));
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      EXPECT_EQ(a->fingerprint, b->fingerprint) << StrategyName(s) << " sq " << sq;
      EXPECT_EQ(a->stats.num_ops, b->stats.num_ops);
      EXPECT_GT(c.calls, 50) << "the check is polled as the work goes (" << StrategyName(s) << ")";
      if (s == Strategy::kWeightBridge && sq) {
        EXPECT_GT(a->stats.sender_quantized_bytes, 0);
        EXPECT_EQ(a->stats.num_ops, 524288);
      }
    }
  }
}

// A stop on the k-th call ends the plan at that call, with the check's code and message and the
// phase and progress: the check is not called again, and the plan is not returned. Over a sample
// of k, every phase is hit: before planning, fragments, sender-side quantisation, the reserve, the
// ops (load balancing and bucketing), the end.
TEST(CancelTest, AStopEndsThePlanAtOnceInEveryPhase) {
  const Problem p = BigProblem();
  Check all;
  ASSERT_TRUE(MakePlanWithOptions(p, Strategy::kWeightBridge, WithCheck(all, true)).ok());
  const int64_t polls = all.calls;
  ASSERT_GT(polls, 50);
  std::set<int64_t> ks = {1, 2, polls - 1, polls};
  for (int64_t k = 1; k <= polls; k += std::max<int64_t>(polls / 29, 1)) ks.insert(k);
  std::map<std::string, int> phases;
  for (int64_t k : ks) {
    Check c;
    c.stop_at = k;
    absl::StatusOr<Plan> plan = MakePlanWithOptions(p, Strategy::kWeightBridge, WithCheck(c, true));
    ASSERT_FALSE(plan.ok()) << "stop at poll " << k << " of " << polls;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(c.calls, k) << "stopped at the poll that said so: " << plan.status();
    EXPECT_TRUE(absl::StartsWith(plan.status().message(), "stop asked by the test (planner stopped ")) << plan.status();
    ++phases[PhaseOf(plan.status().message())];
  }
  std::string seen;
  for (const auto& [phase, n] : phases) absl::StrAppend(&seen, phase, " x", n, "; ");
  for (const char* phase : {"before planning", "building fragments", "deciding sender-side quantisation",
                            "reserving sender egress", "building the weightbridge ops", "before the plan's stats and fingerprint"}) {
    EXPECT_GT(phases[phase], 0) << phase << " never stopped; phases: " << seen;
  }
  EXPECT_GT(phases["building the weightbridge ops"], phases["building fragments"]) << seen;

  // The progress: a stop in the middle of the ops names the fragment and the ops built so far.
  Check mid;
  mid.stop_at = polls - polls / 4;
  absl::StatusOr<Plan> plan = MakePlanWithOptions(p, Strategy::kWeightBridge, WithCheck(mid, true));
  ASSERT_EQ(PhaseOf(plan.status().message()), "building the weightbridge ops") << plan.status();
  EXPECT_NE(plan.status().message().find(" ops built)"), std::string::npos) << plan.status();
  EXPECT_NE(plan.status().message().find(": fragment "), std::string::npos) << plan.status();
}

// Every strategy's op building polls (the baselines too), and the check's code is kept: a
// deadline read from the caller's clock is DEADLINE_EXCEEDED.
TEST(CancelTest, EveryStrategyStopsAndTheCheckKeepsItsCode) {
  const Problem p = BigProblem();
  for (Strategy s : {Strategy::kWeightBridge, Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast, Strategy::kP2PNoDedup}) {
    Check all;
    ASSERT_TRUE(MakePlanWithOptions(p, s, WithCheck(all, false)).ok());
    Check c;
    c.stop_at = all.calls - 2;  // in the ops: most of the work
    c.code = absl::StatusCode::kDeadlineExceeded;
    absl::StatusOr<Plan> plan = MakePlanWithOptions(p, s, WithCheck(c, false));
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(PhaseOf(plan.status().message()), absl::StrCat("building the ", StrategyName(s), " ops")) << plan.status();
    EXPECT_EQ(c.calls, all.calls - 2);
  }
}

// A check asked before the plan starts stops it at once: one call.
TEST(CancelTest, ACheckThatSaysStopAtOnceStopsBeforeAnyWork) {
  const Problem p = BigProblem();
  Check c;
  c.stop_at = 1;
  absl::StatusOr<Plan> plan = MakePlanWithOptions(p, Strategy::kWeightBridge, WithCheck(c, true));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(plan.status().message(), "stop asked by the test (planner stopped before planning)");
  EXPECT_EQ(c.calls, 1);
}

// ---- DecideSenderQuantization: demotions propagate through an index, not repeated passes ----

// The decision as it was made before (whole passes over every fragment until nothing changes): the
// reference the index-driven one must match exactly.
SenderQuantization ReferenceDecision(const Problem& p, const FragmentSet& fs) {
  const size_t nf = fs.fragments.size();
  SenderQuantization out;
  out.quantized.assign(nf, 0);
  out.wire_bytes.resize(nf);
  out.format.assign(nf, nullptr);
  for (size_t i = 0; i < nf; ++i) out.wire_bytes[i] = fs.fragments[i].bytes;
  std::vector<size_t> base(p.workers.size() + 1, 0);
  for (size_t w = 0; w < p.workers.size(); ++w) base[w + 1] = base[w] + p.workers[w].layout.pieces.size();
  std::vector<uint8_t> eligible(base.back(), 0);
  for (size_t w = 0; w < p.workers.size(); ++w) {
    if (p.workers[w].role != Role::kRollout) continue;
    for (size_t i = 0; i < p.workers[w].layout.pieces.size(); ++i) {
      const Piece& pc = p.workers[w].layout.pieces[i];
      eligible[base[w] + i] = pc.quant.has_value() && SenderCanQuantize(*pc.quant) &&
                              QuantizedBoxBytes(pc.box, *pc.quant) < BoxVolume(pc.box) * DTypeSize(p.inventory.tensors[pc.tensor].dtype);
    }
  }
  auto piece_of = [&](PieceRef r) -> const Piece& { return p.workers[r.worker].layout.pieces[r.piece]; };
  auto flag = [&](PieceRef r) -> uint8_t& { return eligible[base[r.worker] + r.piece]; };
  bool changed = true;
  while (changed) {
    changed = false;
    for (size_t i = 0; i < nf; ++i) {
      const Fragment& f = fs.fragments[i];
      if (f.dst_begin == f.dst_end) continue;
      const Piece& first = piece_of(fs.refs[f.dst_begin]);
      bool ok = true;
      for (uint32_t k = f.dst_begin; k < f.dst_end && ok; ++k) {
        ok = flag(fs.refs[k]) != 0 && SameQuantFormat(*piece_of(fs.refs[k]).quant, *first.quant);
      }
      ok = ok && BoxOnBlockGrid(f.box, p.inventory.tensors[f.tensor].shape, first.quant->block);
      if (ok) continue;
      for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) {
        changed |= flag(fs.refs[k]) != 0;
        flag(fs.refs[k]) = 0;
      }
    }
  }
  for (size_t i = 0; i < nf; ++i) {
    const Fragment& f = fs.fragments[i];
    if (f.dst_begin == f.dst_end || !flag(fs.refs[f.dst_begin])) continue;
    out.quantized[i] = 1;
    out.format[i] = &*piece_of(fs.refs[f.dst_begin]).quant;
    out.wire_bytes[i] = QuantizedBoxBytes(f.box, *out.format[i]);
  }
  return out;
}

// A chain of overlapping rollout pieces: piece i holds rows [i, i + 2) of one n+1-row tensor (pieces
// alternate between two rollout GPUs), so row r's fragment has needers i = r - 1 and r, and a piece
// that cannot be sender-quantised demotes its neighbour, which demotes the next, ... The repeated
// passes walked back one link per pass (n passes over n fragments); `bad` pieces are unquantised
// (or, with `other_format`, in another format), the rest fp8 1x32.
Problem Chain(int64_t n, const std::vector<int64_t>& bad, bool other_format) {
  Problem p;
  p.inventory.architecture = "Chain";
  p.inventory.tensors.push_back({"w", {n + 1, 32}, DType::kBF16});
  AddWorker(p, Role::kTrainer, 0, 0, {{0, FullBox({n + 1, 32})}});
  AddWorker(p, Role::kRollout, 1, 0, {});
  AddWorker(p, Role::kRollout, 1, 1, {});
  for (int64_t i = 0; i < n; ++i) {
    Worker& w = p.workers[1 + i % 2];
    Piece pc;
    pc.tensor = 0;
    pc.box = Box{{i, 0}, {i + 2, 32}};
    pc.offset_bytes = w.layout.buffers[0].size_bytes;
    pc.strides = {32, 1};
    pc.quant = Mx(1, 32);
    for (int64_t b : bad) {
      if (b == i) pc.quant = other_format ? std::optional<Quantization>(Mx(2, 32)) : std::nullopt;
    }
    w.layout.buffers[0].size_bytes += 2 * 32 * 2;
    w.layout.pieces.push_back(pc);
  }
  return p;
}

TEST(SenderQuantDecisionTest, AChainOfDemotionsGivesWhatThePassesGave) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 40; ++round) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 600);
    std::vector<int64_t> bad;
    const int nbad = static_cast<int>(rng() % 4);  // 0: nothing demoted
    for (int b = 0; b < nbad; ++b) bad.push_back(static_cast<int64_t>(rng() % n));
    const Problem p = Chain(n, bad, rng() % 2 == 0);
    absl::StatusOr<FragmentSet> fs = BuildFragments(p, {});
    ASSERT_TRUE(fs.ok()) << fs.status();
    const SenderQuantization want = ReferenceDecision(p, *fs);
    const SenderQuantization got = DecideSenderQuantization(p, *fs, true);
    EXPECT_EQ(got.quantized, want.quantized) << "round " << round << " n " << n;
    EXPECT_EQ(got.wire_bytes, want.wire_bytes) << "round " << round;
    EXPECT_EQ(got.format, want.format) << "round " << round;
    int64_t quantized = 0;
    for (uint8_t q : got.quantized) quantized += q;
    if (bad.empty()) {
      EXPECT_EQ(quantized, static_cast<int64_t>(fs->fragments.size())) << "nothing to demote";
    } else {
      EXPECT_EQ(quantized, 0) << "a chain links every piece: one bad piece demotes all";
    }
  }
}

// The same on random crowded problems: random boxes over a few tensors, random formats and
// unquantised pieces, so demotions cross tensors only through pieces' fragments.
TEST(SenderQuantDecisionTest, RandomProblemsGiveWhatThePassesGave) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 200; ++round) {
    Problem p;
    p.inventory.architecture = "Random";
    const int nt = 1 + static_cast<int>(rng() % 3);
    for (int t = 0; t < nt; ++t) p.inventory.tensors.push_back({absl::StrCat("t", t), {64, 64}, DType::kBF16});
    std::vector<std::pair<int, Box>> whole;
    for (int t = 0; t < nt; ++t) whole.push_back({t, FullBox({64, 64})});
    AddWorker(p, Role::kTrainer, 0, 0, whole);
    const int nr = 1 + static_cast<int>(rng() % 5);
    for (int r = 0; r < nr; ++r) {
      std::vector<std::pair<int, Box>> pieces;
      const int np = 1 + static_cast<int>(rng() % 6);
      for (int k = 0; k < np; ++k) {
        const int64_t r0 = static_cast<int64_t>(rng() % 8) * 8, r1 = std::min<int64_t>(64, r0 + 8 * (1 + rng() % 4));
        const int64_t c0 = static_cast<int64_t>(rng() % 2) * 32;
        pieces.push_back({static_cast<int>(rng() % nt), Box{{r0, c0}, {r1, c0 + 32}}});
      }
      AddWorker(p, Role::kRollout, 1, r, pieces, Mx(1, 32));
      for (Piece& pc : p.workers.back().layout.pieces) {
        switch (rng() % 6) {
          case 0: pc.quant.reset(); break;
          case 1: pc.quant = Mx(8, 32); break;
          case 2: pc.quant = Mx(16, 16); break;  // rows of 8 cut its blocks
          default: break;
        }
      }
    }
    absl::StatusOr<FragmentSet> fs = BuildFragments(p, {});
    ASSERT_TRUE(fs.ok()) << fs.status();
    const SenderQuantization want = ReferenceDecision(p, *fs);
    const SenderQuantization got = DecideSenderQuantization(p, *fs, true);
    EXPECT_EQ(got.quantized, want.quantized) << "round " << round;
    EXPECT_EQ(got.wire_bytes, want.wire_bytes) << "round " << round;
    EXPECT_EQ(got.format, want.format) << "round " << round;
  }
}

// A long chain (the passes would take n^2 = 10^10 fragment checks) is decided at once, and the
// demotions poll the check: a stop there names the phase.
TEST(SenderQuantDecisionTest, ALongChainIsLinearAndItsDemotionsPoll) {
  const int64_t n = 100000;
  const Problem p = Chain(n, {n - 1}, false);
  absl::StatusOr<FragmentSet> fs = BuildFragments(p, {});
  ASSERT_TRUE(fs.ok()) << fs.status();
  const SenderQuantization got = DecideSenderQuantization(p, *fs, true);
  for (uint8_t q : got.quantized) ASSERT_EQ(q, 0);

  Check all;
  const CancelCheck fn = all.Fn();
  CancelPoll poll(&fn);
  ASSERT_TRUE(DecideSenderQuantization(p, *fs, true, &poll).ok());
  ASSERT_GT(all.calls, 10);
  std::set<std::string> where;
  for (int64_t k = 1; k <= all.calls; ++k) {
    Check c;
    c.stop_at = k;
    const CancelCheck stop = c.Fn();
    CancelPoll stopping(&stop);
    absl::StatusOr<SenderQuantization> d = DecideSenderQuantization(p, *fs, true, &stopping);
    ASSERT_EQ(d.status().code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(c.calls, k);
    const std::string m(d.status().message());
    where.insert(m.substr(0, m.find_first_of("0123456789")));
  }
  EXPECT_EQ(where, (std::set<std::string>{
                       "stop asked by the test (planner stopped deciding sender-side quantisation: checking fragment ",
                       "stop asked by the test (planner stopped deciding sender-side quantisation: indexing fragment ",
                       "stop asked by the test (planner stopped deciding sender-side quantisation: demoting the needers of demoted pieces: piece "}));
}

}  // namespace
}  // namespace wb::planner
