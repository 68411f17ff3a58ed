// Sender-side quantisation (issue 17.1): the bytes a sending node quantises into its q region and
// the executor's copies land in a rollout's staging are bit for bit what the receiving node's own
// quantiser (daemon/quantize.h over the canonical shadow) writes there, for each format; a relay
// forwards them unchanged; both nodes compute the same q offsets.
#include "daemon/node/quantize_outgoing.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "absl/synchronization/notification.h"

#include "daemon/quantize.h"
#include "gtest/gtest.h"
#include "planner/box.h"
#include "planner/quantized.h"

namespace wb::daemon::node {
namespace {

using planner::DType;

// dst (region `dst`) <- src (region `src`) per a CopyOp's strided refs, element by element.
void ApplyCopy(const transport::CopyOp& c, const uint8_t* src, uint8_t* dst) {
  const size_t rank = c.shape.size();
  std::vector<int64_t> idx(rank, 0);
  int64_t n = 1;
  for (int64_t d : c.shape) n *= d;
  for (int64_t k = 0; k < n; ++k) {
    int64_t so = c.src.offset_bytes, dof = c.dst.offset_bytes;
    for (size_t d = 0; d < rank; ++d) {
      so += idx[d] * c.src.strides[d] * c.element_size;
      dof += idx[d] * c.dst.strides[d] * c.element_size;
    }
    std::memcpy(dst + dof, src + so, static_cast<size_t>(c.element_size));
    for (size_t d = rank; d-- > 0;) {
      if (++idx[d] < c.shape[d]) break;
      idx[d] = 0;
    }
  }
}

struct Format {
  const char* name;
  DType dtype;
  std::vector<int64_t> block;
  DType scale_dtype;
};

// Param: the format, and whether the trainers' rows are padded in their buffers (the chunks'
// source rows are then gathered into scratch rather than quantised in place).
class QuantizeOutgoingTest : public testing::TestWithParam<std::tuple<Format, bool>> {
 protected:
  static constexpr int64_t kRows = 512, kCols = 384;

  const Format& Fmt() const { return std::get<0>(GetParam()); }
  int64_t Pitch() const { return std::get<1>(GetParam()) ? kCols + 32 : kCols; }  // trainer row stride (elements)

  void SetUp() override {
    const Format& f = Fmt();
    inventory_.tensors.push_back({"model.layers.0.mlp.down_proj.weight", {kRows, kCols}, DType::kBF16});
    // Two trainers on n0, each half the rows (whole 128-row blocks); two rollouts on n1 holding
    // the tensor quantised, r1 fed by a relay from r0.
    for (int t = 0; t < 2; ++t) {
      planner::WorkerLayout l;
      l.buffers.push_back({kRows / 2 * Pitch() * 2});
      planner::Piece p;
      p.tensor = 0;
      p.box = {{t * kRows / 2, 0}, {(t + 1) * kRows / 2, kCols}};
      p.strides = {Pitch(), 1};
      l.pieces.push_back(p);
      trainers_.push_back(l);
      std::vector<uint8_t> bytes(static_cast<size_t>(l.buffers[0].size_bytes));
      std::mt19937 rng(7 + t);
      std::normal_distribution<float> dist(0.0f, 0.02f);
      for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
        const uint16_t h = FloatToBF16(dist(rng) * ((i / 2) % 97 == 0 ? 50.0f : 1.0f));
        std::memcpy(&bytes[i], &h, 2);
      }
      source_.push_back(std::move(bytes));
    }
    planner::Piece q;
    q.tensor = 0;
    q.box = {{0, 0}, {kRows, kCols}};
    q.strides = {kCols, 1};
    q.quant = planner::Quantization{f.dtype, f.block, 0, 0, f.scale_dtype};
    const int64_t elements = f.dtype == DType::kI4 ? kRows * kCols / 2 : kRows * kCols;
    q.quant->scale_offset_bytes = elements;
    live_.pieces.push_back(q);
    live_.buffers.push_back({elements + planner::ScaleCount(q) * planner::ScaleElementSize(*q.quant)});
    staging_ = planner::StagingLayout(inventory_, live_);

    slice_.inventory = &inventory_;
    slice_.workers = {{"trainer/0", "n0", planner::Role::kTrainer},
                      {"trainer/1", "n0", planner::Role::kTrainer},
                      {"rollout/0", "n1", planner::Role::kRollout},
                      {"rollout/1", "n1", planner::Role::kRollout}};
    slice_.layouts = {trainers_[0], trainers_[1], staging_, staging_};
    slice_.live_layouts = {trainers_[0], trainers_[1], live_, live_};
    slice_.quantized = {false, false, true, true};
    slice_.num_buckets = 2;
    for (uint32_t t = 0; t < 2; ++t) {
      SliceOp op;
      op.index = t;
      op.bucket = 0;
      op.src_worker = t;
      op.dst_worker = 2;
      op.src_piece = 0;
      op.dst_piece = 0;
      op.tensor = 0;
      op.box = trainers_[t].pieces[0].box;
      op.bytes = static_cast<uint64_t>(planner::BoxVolume(op.box) * 2);
      op.sender_quantized = true;
      slice_.ops.push_back(op);
    }
    SliceOp relay = slice_.ops[0];
    relay.index = 2;
    relay.bucket = 1;
    relay.src_worker = 2;
    relay.dst_worker = 3;
    relay.box = live_.pieces[0].box;
    relay.bytes = static_cast<uint64_t>(planner::BoxVolume(relay.box) * 2);
    slice_.ops.push_back(relay);
  }

  planner::Inventory inventory_;
  std::vector<planner::WorkerLayout> trainers_;
  std::vector<std::vector<uint8_t>> source_;
  planner::WorkerLayout live_, staging_;
  Slice slice_;

  std::map<std::string, RegionMemory> SourceMemory() {
    std::map<std::string, RegionMemory> memory;
    for (uint32_t t = 0; t < 2; ++t) {
      memory[RegionKey(t, 0)] = RegionMemory{transport::MemoryKind::kHost, source_[t].data(), static_cast<int64_t>(source_[t].size()), -1, {}};
    }
    return memory;
  }
};

TEST_P(QuantizeOutgoingTest, LandsTheBytesTheReceiverWouldHaveQuantised) {
  // Sender n0: its q region for n1 holds the two trainer ops.
  absl::StatusOr<SenderQuant> sq = PlanSenderQuant(slice_, "n0");
  ASSERT_TRUE(sq.ok()) << sq.status();
  ASSERT_EQ(sq->regions.size(), 1u);
  ASSERT_EQ(sq->regions.count(QuantOutKey("n1")), 1u);
  ASSERT_EQ(sq->regions.at(QuantOutKey("n1")).jobs.size(), 2u);
  EXPECT_TRUE(sq->pieces_in.empty());  // n0 holds no rollout
  const std::map<std::string, RegionMemory> memory = SourceMemory();
  // One block row per chunk: every op is cut (128-row blocks: 2 chunks per op; 1-row blocks: 256).
  OutgoingOptions options;
  options.max_threads = 2;
  options.chunk_bytes = 1;
  absl::StatusOr<std::unique_ptr<OutgoingQuantization>> running =
      OutgoingQuantization::Start(inventory_, sq->regions, {}, memory, "m v1", absl::InfiniteFuture(), options);
  ASSERT_TRUE(running.ok()) << running.status();
  ASSERT_TRUE((*running)->WaitAll().ok());
  const OutgoingQuantization::Stats st = (*running)->stats();
  EXPECT_EQ(st.chunks, 2 * (kRows / 2) / Fmt().block[0]);
  EXPECT_EQ(st.gathered_bytes, Pitch() == kCols ? 0 : kRows * kCols * 2);  // contiguous rows are read in place
  absl::StatusOr<OutgoingStaging> out = OutgoingQuantizer(2).Quantize(inventory_, sq->regions, memory, "m v1", absl::InfiniteFuture());
  ASSERT_TRUE(out.ok()) << out.status();
  const OutgoingStaging whole = *out;  // default chunks (one per op here): the same bytes
  out->regions = (*running)->regions();
  out->hold = (*running)->hold();
  EXPECT_EQ(out->ops, 2);
  EXPECT_EQ(out->canonical_bytes, kRows * kCols * 2);
  const uint8_t* q = out->regions.at(QuantOutKey("n1")).base;
  const int64_t q_size = out->regions.at(QuantOutKey("n1")).size;
  ASSERT_EQ(whole.regions.at(QuantOutKey("n1")).size, q_size);
  for (const QuantJob& j : sq->regions.at(QuantOutKey("n1")).jobs) {  // gaps between jobs are alignment, never read
    EXPECT_EQ(std::memcmp(q + j.elements_offset, whole.regions.at(QuantOutKey("n1")).base + j.elements_offset, j.elements_bytes), 0);
    EXPECT_EQ(std::memcmp(q + j.scales_offset, whole.regions.at(QuantOutKey("n1")).base + j.scales_offset, j.scales_bytes), 0);
  }

  // Receiver n1: the executor's copies of its exec plan, from the sender's q region into r0's
  // staging, then the relay r0 -> r1 (same node).
  ExecFacts facts;
  facts.me = "n1";
  for (uint32_t w = 2; w < 4; ++w) facts.kind[RegionKey(w, 0)] = transport::MemoryKind::kHost;
  absl::StatusOr<ExecPlan> plan = MakeExecPlan(slice_, facts);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->quant_out.empty());
  ASSERT_EQ(plan->quant_pieces_in.size(), 2u);
  EXPECT_EQ(plan->quant_pieces_in.at(2), std::set<int32_t>{0});
  std::vector<uint8_t> r0(static_cast<size_t>(staging_.buffers[0].size_bytes), 0), r1 = r0;
  int64_t wire = 0, parts = 0;
  for (const BucketPlan& b : plan->buckets) {
    for (const Route& route : b.routes) {
      for (const RouteOp& op : route.ops) {
        ASSERT_NE(op.part, RouteOp::Part::kCanonical) << op.op_index;
        ++parts;
        wire += op.copy.bytes();
        if (op.op_index < 2) {
          ASSERT_EQ(op.src_key, QuantOutKey("n1"));
          ApplyCopy(op.copy, q, r0.data());
        } else {
          ASSERT_EQ(op.src_key, RegionKey(2, 0));
          ApplyCopy(op.copy, r0.data(), r1.data());
        }
      }
      int64_t route_bytes = 0;
      for (const RouteOp& op : route.ops) route_bytes += op.copy.bytes();
      EXPECT_EQ(route.bytes, route_bytes);  // wire bytes, not canonical
    }
  }
  EXPECT_EQ(parts, 6);
  const int64_t live_bytes = live_.buffers[0].size_bytes;
  EXPECT_EQ(wire, 2 * live_bytes);  // the trainers' ops fill r0 once, the relay r1 once
  EXPECT_EQ(out->wire_bytes, live_bytes);

  // Reference: the receiver-side path (the whole tensor canonical in the shadow, quantised there).
  std::vector<uint8_t> ref(r0.size(), 0);
  const planner::Piece& shadow = staging_.pieces[0];
  for (int64_t row = 0; row < kRows; ++row) {
    const std::vector<uint8_t>& src = source_[static_cast<size_t>(row / (kRows / 2))];
    std::memcpy(ref.data() + shadow.offset_bytes + row * kCols * 2, src.data() + (row % (kRows / 2)) * Pitch() * 2, kCols * 2);
  }
  ASSERT_TRUE(QuantizePiece(inventory_, live_.pieces[0], ref.data() + shadow.offset_bytes, ref.data(), ref.data()).ok());
  EXPECT_EQ(std::memcmp(r0.data(), ref.data(), static_cast<size_t>(live_bytes)), 0) << Fmt().name;
  EXPECT_EQ(std::memcmp(r1.data(), ref.data(), static_cast<size_t>(live_bytes)), 0) << Fmt().name;

  // Digests (issue 17.4): each side digests the quantised bytes; they match, and a flipped scale
  // byte in staging is seen.
  digest::OpDigests sent, landed;
  std::map<std::string, digest::RegionBytes> n0 = {
      {RegionKey(0, 0), {source_[0].data(), static_cast<int64_t>(source_[0].size())}},
      {RegionKey(1, 0), {source_[1].data(), static_cast<int64_t>(source_[1].size())}},
      {QuantOutKey("n1"), {q, q_size}}};
  std::map<std::string, digest::RegionBytes> n1 = {{RegionKey(2, 0), {r0.data(), static_cast<int64_t>(r0.size())}},
                                                   {RegionKey(3, 0), {r1.data(), static_cast<int64_t>(r1.size())}}};
  ASSERT_TRUE(DigestSenderQuantized(slice_, "n0", n0, 2, absl::InfiniteFuture(), sent).ok());
  ASSERT_TRUE(DigestSenderQuantized(slice_, "n1", n1, 2, absl::InfiniteFuture(), landed).ok());
  ASSERT_EQ(sent.source.size(), 2u);
  ASSERT_EQ(landed.landed.size(), 3u);
  ASSERT_EQ(landed.source.size(), 1u);  // the relay r0 -> r1 reads on n1
  for (uint32_t op : {0u, 1u}) EXPECT_EQ(sent.source.at(op), landed.landed.at(op)) << op;
  EXPECT_EQ(landed.source.at(2), landed.landed.at(2));
  r0[static_cast<size_t>(live_.pieces[0].quant->scale_offset_bytes)] ^= 0x10;  // the first block's scale (op 0's)
  digest::OpDigests flipped;
  ASSERT_TRUE(DigestSenderQuantized(slice_, "n1", n1, 1, absl::InfiniteFuture(), flipped).ok());
  EXPECT_NE(flipped.landed.at(0), sent.source.at(0));
  EXPECT_EQ(flipped.landed.at(1), sent.source.at(1));

  // Both nodes place each op at the same q offsets (the sender's jobs, the receiver's copies).
  for (const QuantJob& j : sq->regions.at(QuantOutKey("n1")).jobs) {
    bool found = false;
    for (const Route& route : plan->buckets[0].routes) {
      for (const RouteOp& op : route.ops) {
        if (op.op_index != j.op_index) continue;
        found = true;
        EXPECT_EQ(op.copy.src.offset_bytes, op.part == RouteOp::Part::kElements ? j.elements_offset : j.scales_offset);
      }
    }
    EXPECT_TRUE(found) << j.op_index;
  }
}

TEST_P(QuantizeOutgoingTest, DeviceSourceAndOffGridBoxAreRefused) {
  absl::StatusOr<SenderQuant> sq = PlanSenderQuant(slice_, "n0");
  ASSERT_TRUE(sq.ok()) << sq.status();
  std::map<std::string, RegionMemory> memory;
  memory[RegionKey(0, 0)] = RegionMemory{transport::MemoryKind::kCuda, nullptr, static_cast<int64_t>(source_[0].size()), 0, {}};
  memory[RegionKey(1, 0)] = RegionMemory{transport::MemoryKind::kHost, source_[1].data(), static_cast<int64_t>(source_[1].size()), -1, {}};
  absl::StatusOr<OutgoingStaging> out = OutgoingQuantizer().Quantize(inventory_, sq->regions, memory, "m v1", absl::InfiniteFuture());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition) << out.status();
  EXPECT_NE(out.status().message().find("w0.b0"), std::string::npos) << out.status();

  Slice bad = slice_;
  bad.ops[0].box.end[0] = 64;  // half a 128-row block (fp8_block128); mx / int4 blocks are 1 row: cut a column group
  bad.ops[0].box.end[1] = Fmt().block[1] == 128 ? kCols : 16;
  absl::StatusOr<SenderQuant> refused = PlanSenderQuant(bad, "n0");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("whole blocks"), std::string::npos) << refused.status();
}

TEST_P(QuantizeOutgoingTest, EachBucketIsReadyAsSoonAsItsOwnChunksAre) {
  absl::StatusOr<SenderQuant> sq = PlanSenderQuant(slice_, "n0");
  ASSERT_TRUE(sq.ok()) << sq.status();
  const std::map<std::string, RegionMemory> memory = SourceMemory();
  absl::StatusOr<OutgoingStaging> whole = OutgoingQuantizer(1).Quantize(inventory_, sq->regions, memory, "m v1", absl::InfiniteFuture());
  ASSERT_TRUE(whole.ok()) << whole.status();
  // Op 1 is read in bucket 0, op 0 in bucket 2: op 1's chunks go first. Bucket 2's chunks block
  // until the test lets them go, so WaitBucket(0) (and 1, which has none) can only return OK if it
  // waits for bucket 0's chunks alone.
  absl::Notification release;
  absl::Mutex mu;
  std::vector<uint32_t> order;
  OutgoingOptions options;
  options.max_threads = 1;
  options.chunk_bytes = 1;
  options.before_chunk = [&](uint32_t bucket) {
    {
      absl::MutexLock l(&mu);
      order.push_back(bucket);
    }
    if (bucket == 2) release.WaitForNotification();
  };
  auto running = OutgoingQuantization::Start(inventory_, sq->regions, {{0, 2}, {1, 0}}, memory, "m v1", absl::InfiniteFuture(), options);
  ASSERT_TRUE(running.ok()) << running.status();
  ASSERT_TRUE((*running)->WaitBucket(0).ok());
  ASSERT_TRUE((*running)->WaitBucket(1).ok());
  const std::string key = QuantOutKey("n1");
  const QuantJob& op1 = sq->regions.at(key).jobs[1];
  ASSERT_EQ(op1.op_index, 1u);
  const uint8_t* q = (*running)->regions().at(key).base;
  EXPECT_EQ(std::memcmp(q + op1.elements_offset, whole->regions.at(key).base + op1.elements_offset, op1.elements_bytes), 0);
  EXPECT_EQ(std::memcmp(q + op1.scales_offset, whole->regions.at(key).base + op1.scales_offset, op1.scales_bytes), 0);
  release.Notify();
  ASSERT_TRUE((*running)->WaitBucket(2).ok());
  const QuantJob& op0 = sq->regions.at(key).jobs[0];
  EXPECT_EQ(std::memcmp(q + op0.elements_offset, whole->regions.at(key).base + op0.elements_offset, op0.elements_bytes), 0);
  absl::MutexLock l(&mu);
  ASSERT_FALSE(order.empty());
  EXPECT_TRUE(std::is_sorted(order.begin(), order.end()));
  EXPECT_EQ(order.front(), 0u);
  EXPECT_EQ(order.back(), 2u);
}

TEST_P(QuantizeOutgoingTest, AChunkPastTheDeadlineFailsTheWait) {
  absl::StatusOr<SenderQuant> sq = PlanSenderQuant(slice_, "n0");
  ASSERT_TRUE(sq.ok()) << sq.status();
  auto running = OutgoingQuantization::Start(inventory_, sq->regions, {}, SourceMemory(), "m v1", absl::Now() - absl::Seconds(1));
  ASSERT_TRUE(running.ok()) << running.status();
  absl::Status s = (*running)->WaitBucket(0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("m v1: sender-side quantisation"), std::string::npos) << s;
}

TEST_P(QuantizeOutgoingTest, QStagingIsChargedToTheNodesBudgetAndRefusedOverIt) {
  absl::StatusOr<SenderQuant> sq = PlanSenderQuant(slice_, "n0");
  ASSERT_TRUE(sq.ok()) << sq.status();
  const int64_t q_bytes = sq->regions.at(QuantOutKey("n1")).size;
  // Room for incoming staging already charged, not for the q region as well.
  std::shared_ptr<StagingBudget> budget = StagingBudget::Create("n0", q_bytes + 1000);
  absl::StatusOr<std::shared_ptr<StagingBudget::Charge>> incoming = budget->Reserve(1001, "m v1 incoming");
  ASSERT_TRUE(incoming.ok()) << incoming.status();
  OutgoingOptions options;
  options.budget = budget.get();
  int allocations = 0;
  options.allocate = [&](int64_t size, const std::string&) -> absl::StatusOr<QStaging> {
    ++allocations;
    auto mem = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(size));
    return QStaging{mem->data(), mem};
  };
  auto refused = OutgoingQuantization::Start(inventory_, sq->regions, {}, SourceMemory(), "m v1", absl::InfiniteFuture(), options);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("--staging_budget_bytes"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("m v1 outgoing quantised staging"), std::string::npos) << refused.status();
  EXPECT_EQ(allocations, 0);  // refused before anything was allocated
  EXPECT_EQ(budget->in_use(), 1001);

  incoming->reset();  // the budget has room now: charged while the q memory lives, released after
  auto running = OutgoingQuantization::Start(inventory_, sq->regions, {}, SourceMemory(), "m v1", absl::InfiniteFuture(), options);
  ASSERT_TRUE(running.ok()) << running.status();
  EXPECT_EQ(allocations, 1);
  EXPECT_EQ(budget->in_use(), q_bytes);
  ASSERT_TRUE((*running)->WaitAll().ok());
  std::shared_ptr<void> hold = (*running)->hold();
  running->reset();
  EXPECT_EQ(budget->in_use(), q_bytes);  // a transport may still read it
  hold.reset();
  EXPECT_EQ(budget->in_use(), 0);
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizeOutgoingTest,
                         testing::Combine(testing::Values(Format{"fp8_block128", DType::kF8E4M3, {128, 128}, DType::kF32},
                                                          Format{"mxfp8", DType::kF8E4M3, {1, 32}, DType::kE8M0},
                                                          Format{"w4a16_g32", DType::kI4, {1, 32}, DType::kBF16}),
                                          testing::Bool()),
                         [](const testing::TestParamInfo<std::tuple<Format, bool>>& i) {
                           return std::string(std::get<0>(i.param).name) + (std::get<1>(i.param) ? "_padded_rows" : "_contiguous_rows");
                         });

}  // namespace
}  // namespace wb::daemon::node
