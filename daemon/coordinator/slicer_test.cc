// The pure slicer: which ops and layouts each node's slice carries.
#include "daemon/coordinator/slicer.h"

#include "gtest/gtest.h"

namespace wb::daemon {
namespace {

planner::WorkerLayout OnePieceLayout() {
  planner::WorkerLayout l;
  planner::Piece p;
  p.tensor = 0;
  p.box = {{0, 0}, {4, 4}};
  p.strides = {4, 1};
  l.pieces.push_back(p);
  l.buffers.push_back({});
  return l;
}

std::shared_ptr<const planner::PackedLayout> OnePiece() { return *planner::PackedLayout::PackShared(OnePieceLayout()); }

std::shared_ptr<const pb::ResolvedLayout> Proto(const std::string& tag) {
  auto p = std::make_shared<pb::ResolvedLayout>();
  pb::BufferSpec* b = p->add_buffers();
  b->set_shm_name(tag);
  b->set_size_bytes(32);
  return p;
}

SliceInput Input() {
  SliceInput in;
  in.model_id = "m";
  in.epoch = 7;
  in.mode = pb::MODE_UNSPECIFIED;
  auto inv = std::make_shared<planner::Inventory>();
  inv->tensors.push_back({"w", {4, 4}, planner::DType::kBF16});
  in.inventory = inv;
  in.workers = {{"t0", "a", planner::Role::kTrainer, 0, OnePiece(), Proto("t0")},
                {"r0", "b", planner::Role::kRollout, 0, OnePiece(), Proto("r0")},
                {"r1", "a", planner::Role::kRollout, 1, OnePiece(), Proto("r1")},
                {"r2", "c", planner::Role::kRollout, 0, OnePiece(), Proto("r2")}};
  in.nodes["a"] = {"a:1", {{"host_tcp", "ia"}}};
  in.nodes["b"] = {"b:1", {}};
  in.nodes["c"] = {"c:1", {}};
  return in;
}

planner::TransferOp Op(int src, int dst, int64_t bytes, planner::Route route) {
  planner::TransferOp op;
  op.src_worker = src;
  op.dst_worker = dst;
  op.src_piece = 0;
  op.dst_piece = 0;
  op.tensor = 0;
  op.box = {{0, 0}, {4, 4}};
  op.bytes = bytes;
  op.route = route;
  return op;
}

TEST(SlicerTest, EachNodeGetsItsOpsAndTheLayoutsItNeeds) {
  planner::Plan plan;
  plan.fingerprint = "f";
  plan.buckets.resize(2);
  plan.buckets[0].ops = {Op(0, 1, 32, planner::Route::kInterNode), Op(0, 2, 32, planner::Route::kIntraNode)};
  plan.buckets[1].ops = {Op(1, 3, 32, planner::Route::kInterNode)};  // relay b -> c
  auto slices = SlicePlan(plan, Input());
  ASSERT_TRUE(slices.ok()) << slices.status();
  ASSERT_EQ(slices->by_node.size(), 3u);
  EXPECT_EQ(slices->total_bytes, 96u);
  const pb::PlanSlice& a = slices->by_node.at("a");
  const pb::PlanSlice& b = slices->by_node.at("b");
  const pb::PlanSlice& c = slices->by_node.at("c");
  // a: both ops of bucket 0 (it sends them); b: the op it receives and the relay it sends; c: the relay.
  ASSERT_EQ(a.ops_size(), 2);
  ASSERT_EQ(b.ops_size(), 2);
  ASSERT_EQ(c.ops_size(), 1);
  EXPECT_EQ(a.ops(0).index(), 0u);
  EXPECT_EQ(a.ops(1).index(), 1u);
  EXPECT_EQ(b.ops(1).index(), 2u);
  EXPECT_EQ(b.ops(1).bucket(), 1u);
  EXPECT_EQ(c.ops(0).src_worker(), 1u);
  for (const pb::PlanSlice* s : {&a, &b, &c}) {
    EXPECT_EQ(s->plan_epoch(), 7u);
    EXPECT_EQ(s->mode(), pb::MODE_SYNC) << "unspecified mode is sync";
    EXPECT_EQ(s->total_bytes(), 96u);
    EXPECT_EQ(s->tensors_size(), 1);
    ASSERT_EQ(s->workers_size(), 4) << "every worker is listed in every slice";
  }
  // Layouts: a node's own workers and the peers of its ops, nobody else's.
  EXPECT_TRUE(c.workers(3).has_layout());   // its own r2
  EXPECT_TRUE(c.workers(1).has_layout());   // r0 relays to it
  EXPECT_FALSE(c.workers(0).has_layout());  // t0: no op with c
  EXPECT_FALSE(c.workers(2).has_layout());  // r1: no op with c
  EXPECT_FALSE(b.workers(2).has_layout());  // r1 sits on a, no op with b
  EXPECT_TRUE(b.workers(0).has_layout());
  EXPECT_EQ(b.workers(0).data_address(), "a:1");
  EXPECT_EQ(b.workers(0).transport_instances().at("host_tcp"), "ia");
  // Two steps give the same slices.
  auto ops = SliceOps(plan, Input());
  ASSERT_TRUE(ops.ok());
  EXPECT_EQ(ops->by_node.at("b").workers_size(), 0) << "SliceOps leaves the header out";
  const SliceInput in = Input();
  for (auto& [n, s] : ops->by_node) {
    FillSliceHeader(plan, in, *ops, n, &s);
    EXPECT_EQ(s.SerializeAsString(), slices->by_node.at(n).SerializeAsString()) << n;
  }
}

// Lossless deltas (TransferOp.delta): cross-node host ops from a trainer on a node that sends
// deltas, into boxes relays read only after the delta tail (across nodes: TransferOp.after_deltas);
// never same-node, relays, nor when the source node or the slice has them off.
TEST(SlicerTest, DeltaOpsAreCrossNodeTrainerToNonRelayingRolloutFromADeltaNode) {
  planner::Plan plan;
  plan.fingerprint = "f";
  plan.buckets.resize(2);
  plan.buckets[0].ops = {Op(0, 1, 32, planner::Route::kInterNode), Op(0, 2, 32, planner::Route::kIntraNode),
                         Op(0, 3, 32, planner::Route::kInterNode)};
  auto deltas = [&](const SliceInput& in) {
    auto slices = SlicePlan(plan, in);
    EXPECT_TRUE(slices.ok()) << slices.status();
    std::vector<bool> out;
    for (const pb::TransferOp& op : slices->by_node.at("a").ops()) out.push_back(op.delta());
    return out;
  };
  SliceInput in = Input();
  EXPECT_EQ(deltas(in), (std::vector<bool>{false, false, false})) << "node a does not send deltas";
  in.nodes["a"].sends_deltas = true;
  EXPECT_EQ(deltas(in), (std::vector<bool>{true, false, true}));
  // The receiver's slice says the same (both ends derive the same delta slots).
  EXPECT_TRUE(SlicePlan(plan, in)->by_node.at("b").ops(0).delta());
  plan.buckets[1].ops = {Op(1, 3, 32, planner::Route::kInterNode)};  // r0 relays to r2 (across nodes) now
  EXPECT_EQ(deltas(in), (std::vector<bool>{true, false, true})) << "the relay runs after the deltas on both nodes";
  EXPECT_FALSE(SlicePlan(plan, in)->by_node.at("b").ops(1).delta()) << "relays go full";
  EXPECT_TRUE(SlicePlan(plan, in)->by_node.at("b").ops(1).after_deltas());
  EXPECT_TRUE(SlicePlan(plan, in)->by_node.at("c").ops(1).after_deltas()) << "both nodes of the relay see the flag";
  EXPECT_FALSE(SlicePlan(plan, in)->by_node.at("b").ops(0).after_deltas());
  plan.buckets.push_back({});
  plan.buckets[2].ops = {Op(3, 2, 32, planner::Route::kInterNode)};  // r2 relays on to r1 (node a's 4th op): r2's box is read
  EXPECT_EQ(deltas(in), (std::vector<bool>{false, false, true, false})) << "a relay into a box some op reads runs in its bucket";
  EXPECT_FALSE(SlicePlan(plan, in)->by_node.at("b").ops(1).after_deltas());
  // A relay of other rows of r0 leaves the op into rows 0-1 of r0 a delta.
  plan.buckets[0].ops[0].box = {{0, 0}, {2, 4}};
  plan.buckets[1].ops[0].box = {{2, 0}, {4, 4}};
  EXPECT_EQ(deltas(in), (std::vector<bool>{true, false, true, false})) << "only boxes such a relay reads go full";
  plan.buckets[1].ops[0].box = {{1, 0}, {3, 4}};
  EXPECT_EQ(deltas(in), (std::vector<bool>{false, false, true, false})) << "overlapping the relayed rows";
  in.deltas = false;  // a catch-up slice
  EXPECT_EQ(deltas(in), (std::vector<bool>{false, false, false, false}));
}

// Same-node relays between host pieces into a piece no op reads run after the receiving node's
// delta tail (left to the commit, or in the bucket's after-deltas route: daemon/node/exec_plan.h),
// i.e. after every delta into their source was decoded and checked: the op into the relayed box
// may be a delta, in every mode. A relay across nodes, out of a piece some op reads, or into GPU
// memory reads in its bucket and keeps the boxes it reads full. Relays themselves go full.
TEST(SlicerTest, BoxesRelayedAfterTheDeltaTailMayBeDeltas) {
  SliceInput in = Input();
  in.mode = pb::MODE_SYNC;
  in.nodes["a"].sends_deltas = true;
  in.workers.push_back({"r3", "b", planner::Role::kRollout, 1, OnePiece(), Proto("r3")});  // next to r0
  planner::Plan plan;
  plan.fingerprint = "f";
  plan.buckets.resize(2);
  plan.buckets[0].ops = {Op(0, 1, 32, planner::Route::kInterNode)};  // t0 (a) -> r0 (b)
  plan.buckets[1].ops = {Op(1, 4, 32, planner::Route::kIntraNode)};  // r0 -> r3, r3's whole piece
  auto delta_of = [&](const SliceInput& input) {
    auto slices = SlicePlan(plan, input);
    EXPECT_TRUE(slices.ok()) << slices.status();
    std::vector<bool> out;
    for (const pb::TransferOp& op : slices->by_node.at("b").ops()) out.push_back(op.delta());
    return out;
  };
  EXPECT_EQ(delta_of(in), (std::vector<bool>{true, false})) << "the relay reads decoded bytes; the relay goes full";
  SliceInput other = in;
  other.mode = pb::MODE_ONE_STEP_OFF;  // no relays at the commit: after the deltas in its bucket
  EXPECT_EQ(delta_of(other), (std::vector<bool>{true, false}));
  other = in;
  auto cuda = std::make_shared<pb::ResolvedLayout>(*Proto("r3"));
  cuda->mutable_buffers(0)->mutable_cuda_ipc_handle();
  other.workers[4].layout_proto = cuda;  // r3's piece on a GPU: a CUDA copy in its bucket
  EXPECT_EQ(delta_of(other), (std::vector<bool>{false, false}));
  plan.buckets[1].ops[0].box = {{0, 0}, {2, 4}};  // the relay fills half of r3's piece
  plan.buckets[1].ops[0].bytes = 16;
  EXPECT_EQ(delta_of(in), (std::vector<bool>{true, false})) << "a piece filled in part: after the deltas too";
  plan.buckets[1].ops[0].box = {{0, 0}, {4, 4}};
  plan.buckets[1].ops[0].bytes = 32;
  plan.buckets.push_back({});
  plan.buckets[2].ops = {Op(4, 3, 32, planner::Route::kInterNode)};  // r3 relays on to r2 (c)
  EXPECT_EQ(delta_of(in), (std::vector<bool>{false, false, false})) << "a relay into a piece some op reads runs in its bucket";
}

// Quantised rollouts: an op the sending node quantises (sender_quantized) may be a delta of the
// quantised bytes; an op into a receiver-quantised piece may be a delta of the canonical bytes
// (into its shadow, against the shadow the receiving node keeps in its committed staging) when
// that node decodes in place (keeps_shadows); an op into an unquantised piece of a quantised
// rollout may be a delta. With the scales in GPU memory none of the quantised piece's ops may (the
// node quantises into host staging and copies them over).
TEST(SlicerTest, QuantisedPiecesAndUnquantisedPiecesOfQuantisedRolloutsMayBeDeltas) {
  SliceInput in = Input();
  in.nodes["a"].sends_deltas = true;
  in.nodes["b"].keeps_shadows = true;
  planner::WorkerLayout q = OnePieceLayout();
  planner::Piece norm = q.pieces[0];
  planner::Quantization quant;
  quant.block = {4, 4};
  quant.scale_offset_bytes = 16;
  q.pieces[0].quant = quant;
  q.pieces.push_back(norm);                                 // an unquantised piece of the same rollout
  in.workers[1].layout = *planner::PackedLayout::PackShared(q);  // r0 (b)
  planner::Plan plan;
  plan.fingerprint = "f";
  plan.buckets.resize(1);
  planner::TransferOp sq = Op(0, 1, 32, planner::Route::kInterNode);
  sq.sender_quantized = true;
  planner::TransferOp rq = Op(0, 1, 32, planner::Route::kInterNode);  // receiver-quantised
  planner::TransferOp un = Op(0, 1, 32, planner::Route::kInterNode);
  un.dst_piece = 1;
  plan.buckets[0].ops = {sq, rq, un};
  auto slices = SlicePlan(plan, in);
  ASSERT_TRUE(slices.ok()) << slices.status();
  std::vector<bool> delta;
  for (const pb::TransferOp& op : slices->by_node.at("b").ops()) delta.push_back(op.delta());
  EXPECT_EQ(delta, (std::vector<bool>{true, true, true}));

  in.nodes["b"].keeps_shadows = false;  // its only base would be live weights: no shadows there
  slices = SlicePlan(plan, in);
  ASSERT_TRUE(slices.ok()) << slices.status();
  delta.clear();
  for (const pb::TransferOp& op : slices->by_node.at("b").ops()) delta.push_back(op.delta());
  EXPECT_EQ(delta, (std::vector<bool>{true, false, true})) << "receiver-quantised: full without kept shadows";
  in.nodes["b"].keeps_shadows = true;

  // The scales in a second buffer, on a GPU.
  q.pieces[0].quant->scale_buffer = 1;
  q.pieces[0].quant->scale_offset_bytes = 0;
  q.buffers.push_back({});
  in.workers[1].layout = *planner::PackedLayout::PackShared(q);
  auto proto = std::make_shared<pb::ResolvedLayout>(*in.workers[1].layout_proto);
  pb::BufferSpec* gpu = proto->add_buffers();
  gpu->set_size_bytes(32);
  gpu->set_cuda_ipc_handle(std::string(64, '\0'));
  in.workers[1].layout_proto = proto;
  slices = SlicePlan(plan, in);
  ASSERT_TRUE(slices.ok()) << slices.status();
  delta.clear();
  for (const pb::TransferOp& op : slices->by_node.at("b").ops()) delta.push_back(op.delta());
  EXPECT_EQ(delta, (std::vector<bool>{false, false, true})) << "the scales on a GPU: the quantised piece's ops go full";
}

// A worker's pieces as the coordinator keeps them (stored_pieces.h) travel in the slices of the
// nodes that must know its layout, after its buffers, with their tensor names.
TEST(SlicerTest, StoredPiecesTravelInTheSlicesAfterTheBuffers) {
  SliceInput in = Input();
  google::protobuf::RepeatedPtrField<pb::Piece> pieces;
  pb::Piece* p = pieces.Add();
  p->set_tensor("w");
  for (int d = 0; d < 2; ++d) {
    p->mutable_box()->add_begin(0);
    p->mutable_box()->add_end(4);
  }
  p->add_strides(4);
  p->add_strides(1);
  p->set_offset_bytes(8);
  auto stored = StoredPieces::Make(pieces, *in.workers[1].layout, in.inventory);
  ASSERT_TRUE(stored.ok()) << stored.status();
  in.workers[1].layout_pieces = *stored;  // r0 (b)
  planner::Plan plan;
  plan.fingerprint = "f";
  plan.buckets.resize(1);
  plan.buckets[0].ops = {Op(0, 1, 32, planner::Route::kInterNode)};  // t0 (a) -> r0 (b)
  auto slices = SlicePlan(plan, in);
  ASSERT_TRUE(slices.ok()) << slices.status();
  for (const char* node : {"a", "b"}) {
    const pb::ResolvedLayout& l = slices->by_node.at(node).workers(1).layout();
    ASSERT_EQ(l.buffers_size(), 1) << node;
    EXPECT_EQ(l.buffers(0).shm_name(), "r0") << node;
    ASSERT_EQ(l.pieces_size(), 1) << node;
    EXPECT_EQ(l.pieces(0).SerializeAsString(), pieces[0].SerializeAsString()) << node;
    EXPECT_EQ(l.pieces(0).tensor(), "w") << node;
  }
  EXPECT_FALSE(slices->by_node.at("c").workers(1).has_layout()) << "c has no op with r0";
}

TEST(SlicerTest, StagedReadWithoutAGatherIsAnInternalErrorNamingTheTensor) {
  planner::Plan plan;
  plan.buckets.resize(1);
  planner::TransferOp op = Op(0, 1, 32, planner::Route::kInterNode);
  op.src_piece = -1;  // reads the rank-0 gather staging, which nothing filled
  plan.buckets[0].ops = {op};
  auto slices = SlicePlan(plan, Input());
  ASSERT_FALSE(slices.ok());
  EXPECT_EQ(slices.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(slices.status().message().find("staged tensor w"), std::string::npos) << slices.status();
}

}  // namespace
}  // namespace wb::daemon
