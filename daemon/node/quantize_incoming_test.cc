#include "daemon/node/quantize_incoming.h"

#include <cstring>
#include <random>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/digest/digest.h"
#include "daemon/quantize.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "planner/validate.h"

namespace wb::daemon::node {
namespace {

uint16_t Bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);
}

// A [rows, 64] row-major piece of `tensor` at byte `at`, quantised as `dtype` with `block` and
// `scale_dtype` scales at `scale_at` (NVFP4: the global scale at `global_at`; -1 = none).
planner::Piece QuantPiece(int32_t tensor, int64_t rows, int64_t at, planner::DType dtype, std::vector<int64_t> block,
                          planner::DType scale_dtype, int64_t scale_at, int64_t global_at = -1) {
  planner::Piece p;
  p.tensor = tensor;
  p.box = {{0, 0}, {rows, 64}};
  p.offset_bytes = at;
  p.strides = {64, 1};
  planner::Quantization q;
  q.dtype = dtype;
  q.scale_dtype = scale_dtype;
  q.block = std::move(block);
  q.scale_offset_bytes = scale_at;
  q.global_scale_offset_bytes = global_at;
  p.quant = q;
  return p;
}

// NVFP4 groups: pieces naming one global scale share it (the largest magnitude over all of them),
// a piece naming its own keeps its own; every byte equals QuantizePiece given that group's scale.
TEST(QuantizeIncomingTest, Nvfp4PiecesSharingAGlobalScaleUseTheGroupsLargestMagnitude) {
  planner::Inventory inv;
  inv.tensors.push_back({"q", {32, 64}, planner::DType::kBF16});
  inv.tensors.push_back({"k", {16, 64}, planner::DType::kBF16});
  inv.tensors.push_back({"o", {32, 64}, planner::DType::kBF16});
  // q and k share the global scale at 4096 (as a fused qkv_proj's pieces do); o has its own at 4100.
  planner::WorkerLayout live;
  const int64_t scales = 3072;
  auto nv = [](int32_t tensor, int64_t rows, int64_t at, int64_t scale_at, int64_t global_at) {
    return QuantPiece(tensor, rows, at, planner::DType::kF4E2M1, {1, 16}, planner::DType::kF8E4M3, scale_at, global_at);
  };
  live.pieces.push_back(nv(0, 32, 0, scales, 4096));
  live.pieces.push_back(nv(1, 16, 32 * 32, scales + 128, 4096));
  live.pieces.push_back(nv(2, 32, 48 * 32, scales + 192, 4100));
  live.buffers.push_back({4104});
  ASSERT_TRUE(planner::ValidateLayout(inv, live, planner::Role::kRollout, "r").ok())
      << planner::ValidateLayout(inv, live, planner::Role::kRollout, "r");
  const planner::WorkerLayout shadow = planner::StagingLayout(inv, live);
  StagedBytes staging(1);
  staging[0].host.assign(static_cast<size_t>(shadow.buffers[0].size_bytes), 0);
  // q small (|x| <= 0.05), k large (up to 3): q's scales depend on k's magnitude through the group.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> small(-0.05f, 0.05f), large(-3.0f, 3.0f);
  for (size_t k = 0; k < 3; ++k) {
    const planner::Piece& sp = shadow.pieces[k];
    uint16_t* x = reinterpret_cast<uint16_t*>(staging[0].host.data() + sp.offset_bytes);
    for (int64_t i = 0; i < planner::BoxVolume(sp.box); ++i) x[i] = Bf16(k == 1 ? large(rng) : small(rng));
  }
  std::vector<uint8_t> before = staging[0].host;
  QuantizeTarget t;
  t.worker = "r";
  t.live = &live;
  t.shadow = &shadow;
  t.staging = &staging;
  auto r = QuantizeStaging(inv, {t}, 1, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->pieces, 3);

  // The references, from the shadows left as they were.
  const float q_amax = std::max(ShadowAbsMax(inv, live.pieces[0], before.data() + shadow.pieces[0].offset_bytes),
                                ShadowAbsMax(inv, live.pieces[1], before.data() + shadow.pieces[1].offset_bytes));
  const float o_amax = ShadowAbsMax(inv, live.pieces[2], before.data() + shadow.pieces[2].offset_bytes);
  ASSERT_GT(q_amax, 1.0f);
  ASSERT_LE(o_amax, 0.05f);
  std::vector<uint8_t> want = before;
  for (size_t k = 0; k < 3; ++k) {
    const float g = NvFp4GlobalScale(k < 2 ? q_amax : o_amax);
    std::memcpy(want.data() + live.pieces[k].quant->global_scale_offset_bytes, &g, 4);
    ASSERT_TRUE(QuantizePiece(inv, live.pieces[k], before.data() + shadow.pieces[k].offset_bytes, want.data(), want.data(), g).ok());
  }
  float got_g;
  std::memcpy(&got_g, staging[0].host.data() + 4096, 4);
  EXPECT_EQ(got_g, q_amax / 2688.0f);
  std::memcpy(&got_g, staging[0].host.data() + 4100, 4);
  EXPECT_EQ(got_g, o_amax / 2688.0f);
  // Elements, scales and global scales (the shadows past 4104 are left as they landed).
  for (int64_t i = 0; i < 4104; ++i) ASSERT_EQ(staging[0].host[static_cast<size_t>(i)], want[static_cast<size_t>(i)]) << "byte " << i;
  // Not what q alone would give: its own magnitude would choose other block scales.
  std::vector<uint8_t> alone = before;
  ASSERT_TRUE(QuantizePiece(inv, live.pieces[0], before.data() + shadow.pieces[0].offset_bytes, alone.data(), alone.data()).ok());
  EXPECT_NE(std::memcmp(alone.data() + scales, want.data() + scales, 128), 0);
}

// NVFP4 across the TP ranks of one engine on this node: each rank names its own global scale slots
// (a fused q/k slot, an o slot), and slots holding parts of one canonical tensor share one scale -
// the largest magnitude over the whole tensors, as ModelOpt exports weight_scale_2 and vLLM holds
// it on every rank. A rank alone (its peer elsewhere) gets its part's magnitude, counted partial.
TEST(QuantizeIncomingTest, Nvfp4RanksOfOneEngineShareTheWholeTensorsGlobalScale) {
  planner::Inventory inv;
  inv.tensors.push_back({"q", {32, 64}, planner::DType::kBF16});
  inv.tensors.push_back({"k", {16, 64}, planner::DType::kBF16});
  inv.tensors.push_back({"o", {32, 64}, planner::DType::kBF16});
  // Rank r: q rows [16r, 16r + 16), k rows [8r, 8r + 8) sharing the slot at 1440; o rows
  // [16r, 16r + 16) with its own at 1444.
  auto nv = [](int32_t tensor, int64_t begin, int64_t rows, int64_t at, int64_t scale_at, int64_t global_at) {
    planner::Piece p = QuantPiece(tensor, rows, at, planner::DType::kF4E2M1, {1, 16}, planner::DType::kF8E4M3, scale_at, global_at);
    p.box = {{begin, 0}, {begin + rows, 64}};
    return p;
  };
  planner::WorkerLayout live[2], shadow[2];
  StagedBytes staging[2];
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int r = 0; r < 2; ++r) {
    live[r].pieces = {nv(0, 16 * r, 16, 0, 1280, 1440), nv(1, 8 * r, 8, 512, 1344, 1440), nv(2, 16 * r, 16, 768, 1376, 1444)};
    live[r].buffers = {{1448}};
    ASSERT_TRUE(planner::ValidateLayout(inv, live[r], planner::Role::kRollout, "r").ok())
        << planner::ValidateLayout(inv, live[r], planner::Role::kRollout, "r");
    shadow[r] = planner::StagingLayout(inv, live[r]);
    staging[r].resize(1);
    staging[r][0].host.assign(static_cast<size_t>(shadow[r].buffers[0].size_bytes), 0);
    // The largest magnitudes lie on rank 1 (k: 3, o: 0.5); rank 0 holds small values only.
    const float mag[3] = {0.05f, r == 1 ? 3.0f : 0.05f, r == 1 ? 0.5f : 0.02f};
    for (size_t k = 0; k < 3; ++k) {
      uint16_t* x = reinterpret_cast<uint16_t*>(staging[r][0].host.data() + shadow[r].pieces[k].offset_bytes);
      for (int64_t i = 0; i < planner::BoxVolume(shadow[r].pieces[k].box); ++i) x[i] = Bf16(u(rng) * mag[k]);
    }
  }
  const StagedBytes before[2] = {staging[0], staging[1]};
  auto target = [&](int r, StagedBytes* s) {
    QuantizeTarget t;
    t.worker = absl::StrCat("r", r);
    t.live = &live[r];
    t.shadow = &shadow[r];
    t.staging = s;
    return t;
  };
  // The whole tensors' magnitudes, over both ranks' shadows.
  auto amax_of = [&](std::initializer_list<size_t> pieces) {
    float a = 0;
    for (int r = 0; r < 2; ++r) {
      for (size_t k : pieces) a = std::max(a, ShadowAbsMax(inv, live[r].pieces[k], before[r][0].host.data() + shadow[r].pieces[k].offset_bytes));
    }
    return a;
  };
  const float qk = NvFp4GlobalScale(amax_of({0, 1})), o = NvFp4GlobalScale(amax_of({2}));
  ASSERT_GT(qk, o);

  auto both = QuantizeStaging(inv, {target(0, &staging[0]), target(1, &staging[1])}, 1, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->global_scales, 2);
  EXPECT_EQ(both->partial_global_scales, 0);
  for (int r = 0; r < 2; ++r) {
    std::vector<uint8_t> want = before[r][0].host;
    for (size_t k = 0; k < 3; ++k) {
      const float g = k < 2 ? qk : o;
      std::memcpy(want.data() + live[r].pieces[k].quant->global_scale_offset_bytes, &g, 4);
      ASSERT_TRUE(QuantizePiece(inv, live[r].pieces[k], before[r][0].host.data() + shadow[r].pieces[k].offset_bytes, want.data(),
                                want.data(), g).ok());
    }
    for (int64_t i = 0; i < 1448; ++i) ASSERT_EQ(staging[r][0].host[static_cast<size_t>(i)], want[static_cast<size_t>(i)]) << "rank " << r << " byte " << i;
  }

  // Rank 0 alone: its own parts' magnitudes, both scales partial.
  StagedBytes alone = before[0];
  auto one = QuantizeStaging(inv, {target(0, &alone)}, 1, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->global_scales, 2);
  EXPECT_EQ(one->partial_global_scales, 2);
  float got;
  std::memcpy(&got, alone[0].host.data() + 1440, 4);
  EXPECT_EQ(got, NvFp4GlobalScale(std::max(ShadowAbsMax(inv, live[0].pieces[0], before[0][0].host.data() + shadow[0].pieces[0].offset_bytes),
                                           ShadowAbsMax(inv, live[0].pieces[1], before[0][0].host.data() + shadow[0].pieces[1].offset_bytes))));
  EXPECT_LT(got, qk);

  // The two ranks on two nodes, each with its own IncomingQuantization, exchanging their parts'
  // magnitudes as the coordinator's ExchangeMagnitudes does (every node's parts, merged; both
  // wait): each rank gets the whole tensors' scales, byte for byte what one node holding both
  // ranks wrote.
  struct Rendezvous {
    absl::Mutex mu;
    std::map<int32_t, std::pair<float, std::vector<planner::Box>>> merged ABSL_GUARDED_BY(mu);
    int reported ABSL_GUARDED_BY(mu) = 0;
    std::vector<bool> waited ABSL_GUARDED_BY(mu);
  } rv;
  auto exchange = [&](const std::vector<MagnitudePart>& parts, bool wait) -> absl::StatusOr<std::map<int32_t, TensorMagnitude>> {
    absl::MutexLock l(&rv.mu);
    for (const MagnitudePart& p : parts) {
      auto& [amax, boxes] = rv.merged[p.tensor];
      amax = std::max(amax, p.amax);
      boxes.insert(boxes.end(), p.boxes.begin(), p.boxes.end());
    }
    ++rv.reported;
    rv.waited.push_back(wait);
    auto all = [&rv]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(rv.mu) { return rv.reported == 2; };
    if (!rv.mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(30))) return absl::DeadlineExceededError("the other node");
    std::map<int32_t, TensorMagnitude> out;
    for (const auto& [t, m] : rv.merged) out[t] = {m.first, planner::BoxesCover(m.second, inv.tensors[static_cast<size_t>(t)].shape)};
    return out;
  };
  StagedBytes apart[2] = {before[0], before[1]};
  absl::StatusOr<QuantizeResult> results[2];
  {
    std::vector<std::thread> nodes;
    for (int r = 0; r < 2; ++r) {
      nodes.emplace_back([&, r] {
        IncomingOptions o;
        o.exchange = exchange;
        auto q = IncomingQuantization::Start(inv, {target(r, &apart[r])}, 1, absl::Now() + absl::Seconds(30), o);
        results[r] = q.ok() ? (*q)->Finish() : absl::StatusOr<QuantizeResult>(q.status());
      });
    }
    for (std::thread& t : nodes) t.join();
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    EXPECT_EQ(results[r]->global_scales, 2);
    EXPECT_EQ(results[r]->partial_global_scales, 0) << "rank " << r;
    EXPECT_EQ(results[r]->exchanged_tensors, 3);
    for (int64_t i = 0; i < 1448; ++i) {
      ASSERT_EQ(apart[r][0].host[static_cast<size_t>(i)], staging[r][0].host[static_cast<size_t>(i)]) << "rank " << r << " byte " << i;
    }
  }
  {
    absl::MutexLock l(&rv.mu);
    EXPECT_EQ(rv.waited, (std::vector<bool>{true, true}));
  }

  // A failed exchange fails the version (nothing is guessed); an empty answer (a coordinator that
  // keeps no magnitudes) leaves the part's own, counted partial.
  {
    IncomingOptions o;
    o.exchange = [](const std::vector<MagnitudePart>&, bool) -> absl::StatusOr<std::map<int32_t, TensorMagnitude>> {
      return absl::AbortedError("version 1 aborted: node n1 went away");
    };
    StagedBytes s = before[0];
    auto q = IncomingQuantization::Start(inv, {target(0, &s)}, 1, absl::Now() + absl::Seconds(30), o);
    ASSERT_TRUE(q.ok()) << q.status();
    absl::StatusOr<QuantizeResult> r = (*q)->Finish();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
    EXPECT_NE(r.status().message().find("NVFP4 magnitudes"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("n1 went away"), std::string::npos) << r.status();
  }
  {
    IncomingOptions o;
    o.exchange = [](const std::vector<MagnitudePart>& parts, bool wait) -> absl::StatusOr<std::map<int32_t, TensorMagnitude>> {
      EXPECT_TRUE(wait);
      EXPECT_EQ(parts.size(), 3u);
      return std::map<int32_t, TensorMagnitude>{};
    };
    StagedBytes s = before[0];
    auto q = IncomingQuantization::Start(inv, {target(0, &s)}, 1, absl::Now() + absl::Seconds(30), o);
    ASSERT_TRUE(q.ok()) << q.status();
    absl::StatusOr<QuantizeResult> r = (*q)->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->partial_global_scales, 2);
    EXPECT_EQ(s[0].host, alone[0].host);
  }
  // Both ranks on one node: nothing partial, the exchange only reports (does not wait).
  {
    IncomingOptions o;
    bool waited = true;
    o.exchange = [&waited](const std::vector<MagnitudePart>& parts, bool wait) -> absl::StatusOr<std::map<int32_t, TensorMagnitude>> {
      waited = wait;
      EXPECT_EQ(parts.size(), 3u);
      for (const MagnitudePart& p : parts) EXPECT_EQ(p.boxes.size(), 2u) << p.tensor;  // one box per rank
      return std::map<int32_t, TensorMagnitude>{};
    };
    StagedBytes s0 = before[0], s1 = before[1];
    auto q = IncomingQuantization::Start(inv, {target(0, &s0), target(1, &s1)}, 1, absl::Now() + absl::Seconds(30), o);
    ASSERT_TRUE(q.ok()) << q.status();
    absl::StatusOr<QuantizeResult> r = (*q)->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(waited);
    EXPECT_EQ(r->partial_global_scales, 0);
    EXPECT_EQ(s0[0].host, staging[0][0].host);
    EXPECT_EQ(s1[0].host, staging[1][0].host);
  }
}

// IncomingQuantization: a piece is quantised once every op listed for it landed, not before; an
// NVFP4 group once all its pieces' ops landed; Finish quantises the rest. Every byte equals what
// QuantizeStaging writes after the fact.
class IncomingQuantizationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    inv_.tensors.push_back({"a", {64, 64}, planner::DType::kBF16});  // fp8 block 32x32: its own piece
    inv_.tensors.push_back({"q", {32, 64}, planner::DType::kBF16});  // NVFP4, q and k share a global scale
    inv_.tensors.push_back({"k", {32, 64}, planner::DType::kBF16});
    inv_.tensors.push_back({"b", {32, 64}, planner::DType::kBF16});  // fp8, no ops listed: waits for Finish
    auto fp8 = [](int32_t tensor, int64_t rows, int64_t at, int64_t scale_at) {
      return QuantPiece(tensor, rows, at, planner::DType::kF8E4M3, {32, 32}, planner::DType::kF32, scale_at);
    };
    auto nv = [](int32_t tensor, int64_t at, int64_t scale_at) {
      return QuantPiece(tensor, 32, at, planner::DType::kF4E2M1, {1, 16}, planner::DType::kF8E4M3, scale_at, 8192);
    };
    // Elements: a 0..4095, q 4096..5119, k 5120..6143, b 6144..8191; scales from 8192 on.
    live_.pieces.push_back(fp8(0, 64, 0, 8208));
    live_.pieces.push_back(nv(1, 4096, 8240));
    live_.pieces.push_back(nv(2, 5120, 8368));
    live_.pieces.push_back(fp8(3, 32, 6144, 8496));
    live_.buffers.push_back({8512});
    ASSERT_TRUE(planner::ValidateLayout(inv_, live_, planner::Role::kRollout, "r").ok())
        << planner::ValidateLayout(inv_, live_, planner::Role::kRollout, "r");
    shadow_ = planner::StagingLayout(inv_, live_);
    staging_.resize(1);
    staging_[0].host.assign(static_cast<size_t>(shadow_.buffers[0].size_bytes), 0);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> x(-2.0f, 2.0f);
    for (size_t k = 0; k < live_.pieces.size(); ++k) {
      const planner::Piece& sp = shadow_.pieces[k];
      uint16_t* e = reinterpret_cast<uint16_t*>(staging_[0].host.data() + sp.offset_bytes);
      for (int64_t i = 0; i < planner::BoxVolume(sp.box); ++i) e[i] = Bf16(x(rng) * (k == 2 ? 3.0f : 1.0f));
    }
  }

  QuantizeTarget Target(StagedBytes* staging) {
    QuantizeTarget t;
    t.worker = "r";
    t.live = &live_;
    t.shadow = &shadow_;
    t.staging = staging;
    t.landing = {{0, {10, 11}}, {1, {12}}, {2, {13, 14}}};  // piece 3 (b) has none
    return t;
  }
  // The bytes before any shadow: elements, scales, the global scale.
  std::vector<uint8_t> Placed(const StagedBytes& s) const { return {s[0].host.begin(), s[0].host.begin() + 8512}; }

  planner::Inventory inv_;
  planner::WorkerLayout live_, shadow_;
  StagedBytes staging_;
};

TEST_F(IncomingQuantizationTest, PiecesAreQuantisedAsTheirOpsLandAndFinishDoesTheRest) {
  StagedBytes reference = staging_;
  QuantizeTarget rt = Target(&reference);
  ASSERT_TRUE(QuantizeStaging(inv_, {rt}, 1, absl::Now() + absl::Seconds(30)).ok());
  const std::vector<uint8_t> want = Placed(reference);
  const std::vector<uint8_t> untouched = Placed(staging_);
  ASSERT_NE(want, untouched);
  auto region = [](const std::vector<uint8_t>& b, int64_t from, int64_t to) { return std::vector<uint8_t>(b.begin() + from, b.begin() + to); };

  absl::Mutex mu;
  std::set<int32_t> done;  // pieces written
  IncomingOptions o;
  o.early_threads = 2;
  o.after_piece = [&](size_t target, int32_t piece) {
    EXPECT_EQ(target, 0u);
    absl::MutexLock l(&mu);
    done.insert(piece);
  };
  auto q = IncomingQuantization::Start(inv_, {Target(&staging_)}, 1, absl::Now() + absl::Seconds(30), o);
  ASSERT_TRUE(q.ok()) << q.status();
  // Waits, with a deadline, until the pieces written are `want_done`; then they must hold the
  // reference's bytes.
  auto wait_for = [&](const std::set<int32_t>& want_done) {
    absl::MutexLock l(&mu);
    auto reached = [&] { return done.size() >= want_done.size(); };
    mu.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(20));
    return done;
  };
  (*q)->OpLanded(10);
  (*q)->OpLanded(99);  // not listed: ignored
  (*q)->OpLanded(12);  // q's ops all landed, k's not: the group waits
  (*q)->OpLanded(13);
  (*q)->OpLanded(11);  // a is complete
  EXPECT_EQ(wait_for({0}), std::set<int32_t>({0})) << "a once its two ops landed; nothing whose ops did not all land";
  EXPECT_EQ(region(Placed(staging_), 0, 4096), region(want, 0, 4096));
  EXPECT_EQ(region(Placed(staging_), 8208, 8240), region(want, 8208, 8240));
  EXPECT_EQ(region(Placed(staging_), 4096, 8208), region(untouched, 4096, 8208)) << "q, k and b still wait";
  (*q)->OpLanded(14);
  (*q)->OpLanded(14);  // repeated: ignored
  EXPECT_EQ(wait_for({0, 1, 2}), std::set<int32_t>({0, 1, 2})) << "q and k together, with the group's global scale";
  EXPECT_EQ(region(Placed(staging_), 4096, 6144), region(want, 4096, 6144));
  EXPECT_EQ(region(Placed(staging_), 8192, 8196), region(want, 8192, 8196));
  EXPECT_EQ(region(Placed(staging_), 8240, 8496), region(want, 8240, 8496));
  EXPECT_EQ(region(Placed(staging_), 6144, 8192), region(untouched, 6144, 8192)) << "b has no ops listed: only Finish quantises it";
  absl::StatusOr<QuantizeResult> r = (*q)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Placed(staging_), want);
  EXPECT_EQ(r->pieces, 4);
  EXPECT_EQ(r->early_pieces, 3);
  EXPECT_EQ(r->ready_pieces, 3);  // b had no ops listed
  EXPECT_GT(r->busy_seconds, 0.0);
}

// IncomingOptions::digests: each piece in a format senders produce (the fp8 pieces a and b, not the
// NVFP4 q and k) gets the digest of its quantised elements and the scales of its blocks, computed
// independently here from the bytes it wrote (a: elements 0..4095 row-major, its 2x2 float32 scales
// at 8208; b: elements 6144..8191, its 1x2 scales at 8496). None without the option.
TEST_F(IncomingQuantizationTest, DigestsOfThePiecesItWroteInTheFormatsSendersProduce) {
  IncomingOptions o;
  o.digests = true;
  auto q = IncomingQuantization::Start(inv_, {Target(&staging_)}, 1, absl::Now() + absl::Seconds(30), o);
  ASSERT_TRUE(q.ok()) << q.status();
  for (uint32_t op : {10, 11, 12, 13, 14}) (*q)->OpLanded(op);
  absl::StatusOr<QuantizeResult> r = (*q)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  const uint8_t* b = staging_[0].host.data();
  auto expect = [&](int64_t elements_at, std::vector<int64_t> shape, int64_t scales_at, std::vector<int64_t> grid) {
    auto e = digest::BoxDigest({b + elements_at, shape, {shape[1], 1}, 1});
    auto c = digest::BoxDigest({b + scales_at, grid, {grid[1], 1}, 4});
    EXPECT_TRUE(e.ok() && c.ok());
    return digest::QuantizedDigest(*e, *c);
  };
  ASSERT_EQ(r->digests.size(), 2u);
  EXPECT_EQ(r->digests[0].worker, "r");
  EXPECT_EQ(r->digests[0].piece, 0);
  EXPECT_EQ(r->digests[0].tensor, 0);
  EXPECT_EQ(r->digests[0].box.end, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(r->digests[0].digest, expect(0, {64, 64}, 8208, {2, 2}));
  EXPECT_EQ(r->digests[1].piece, 3);
  EXPECT_EQ(r->digests[1].tensor, 3);
  EXPECT_EQ(r->digests[1].digest, expect(6144, {32, 64}, 8496, {1, 2}));
  EXPECT_EQ(r->digest_bytes, 4096 + 16 + 2048 + 8);
  // Without the option: none.
  StagedBytes again = staging_;
  auto plain = IncomingQuantization::Start(inv_, {Target(&again)}, 1, absl::Now() + absl::Seconds(30), IncomingOptions{});
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<QuantizeResult> none = (*plain)->Finish();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->digests.empty());
}

// --quantize_early_threads=-1: nothing before Finish, whatever landed; the same bytes after it.
TEST_F(IncomingQuantizationTest, NoEarlyThreadsQuantisesEverythingInFinish) {
  StagedBytes reference = staging_;
  ASSERT_TRUE(QuantizeStaging(inv_, {Target(&reference)}, 1, absl::Now() + absl::Seconds(30)).ok());
  IncomingOptions o;
  o.early_threads = -1;
  auto q = IncomingQuantization::Start(inv_, {Target(&staging_)}, 1, absl::Now() + absl::Seconds(30), o);
  ASSERT_TRUE(q.ok()) << q.status();
  for (uint32_t op : {10, 11, 12, 13, 14}) (*q)->OpLanded(op);
  absl::StatusOr<QuantizeResult> r = (*q)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->early_pieces, 0);
  EXPECT_EQ(r->ready_pieces, 3);  // ready, but no thread may start before Finish
  EXPECT_EQ(r->pieces, 4);
  EXPECT_EQ(Placed(staging_), Placed(reference));
}

TEST_F(IncomingQuantizationTest, PastTheDeadlineFinishSaysSoAndAnAbandonedRunJoinsItsThreads) {
  {
    auto q = IncomingQuantization::Start(inv_, {Target(&staging_)}, 3, absl::Now() - absl::Seconds(1));
    ASSERT_TRUE(q.ok()) << q.status();
    absl::StatusOr<QuantizeResult> r = (*q)->Finish();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
    EXPECT_NE(r.status().message().find("version 3"), std::string::npos) << r.status();
  }
  // An aborted version drops its quantiser before Finish, with pieces queued and ops pending.
  auto q = IncomingQuantization::Start(inv_, {Target(&staging_)}, 4, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(q.ok()) << q.status();
  (*q)->OpLanded(10);
  (*q)->OpLanded(11);
  q->reset();  // joins: no thread may outlive the staging it writes
}

TEST_F(IncomingQuantizationTest, StagingThatCannotHoldAPieceIsRefusedNamingTheRolloutAndTensor) {
  StagedBytes small(1);
  small[0].host.assign(4000, 0);
  auto q = IncomingQuantization::Start(inv_, {Target(&small)}, 1, absl::Now() + absl::Seconds(30));
  ASSERT_FALSE(q.ok());
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(q.status().message().find("rollout r"), std::string::npos) << q.status();
  EXPECT_NE(q.status().message().find("tensor a"), std::string::npos) << q.status();
}

}  // namespace
}  // namespace wb::daemon::node
