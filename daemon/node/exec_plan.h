#pragma once
// The executor's plan of one version on one node: a PURE step (no transport calls, no locks, no
// I/O). A node's slice of a plan (plain values, converted from pb::PlanSlice at the edge:
// SliceFromProto) plus the facts the node knows (which memory backs each region key, its nccl
// lanes, which local sync rollouts have host live buffers) -> what the executor does, in order:
// the regions each transport must reach, the channels to set up in the global order, the relays
// left to the commit, and per bucket the batches (routes) with their ops. daemon/node/executor.h
// runs it over transport::Transport.
//
// The rules (each one a test in exec_plan_test.cc):
//  - Mirror batches: per bucket and peer channel, the ops between the two nodes in op-index order;
//    both nodes derive the same batch from their own slices (same ops, same order).
//  - Channel order: channels are set up in ONE global order of node pairs (smaller node id, larger
//    node id, host channel before nccl, GPU on the smaller node, GPU on the larger), so the smallest
//    unfinished channel always has both nodes at it (two-sided connects never wait in a cycle).
//  - Relays at commit (sync mode): a same-node relay from rollout A's host staging into rollout B
//    is left to the commit only when the relays fill a WHOLE piece of B that no op reads, and B is a
//    local sync rollout with host live buffers and no quantised pieces.
//  - Relays after the deltas: a same-node relay (host staging to host staging) whose source box
//    overlaps a box an incoming delta op of this slice writes goes into its bucket's
//    `after_deltas` route, which the executor posts only after the delta tail (every stream
//    decoded and checked, every refused op resent in full), in bucket order. A relay across nodes
//    the coordinator flagged (SliceOp::after_deltas) goes into an after-deltas route of its channel
//    on both nodes, with its own batch tag (AfterDeltasTag). The coordinator marks
//    a box delta only when every relay reading it in a bucket is such a relay into a box no op
//    reads (slicer DeltaOps), so deferring it delays nothing another op reads.
//  - Written regions: rollout incoming staging and the gather staging. A batch that reads one of
//    them (reads_written) is posted only after every batch of the earlier buckets completed; other
//    batches are pipelined.
//  - nccl: each local region is routed over one lane; the node must have that lane; a quantised
//    rollout's buffers (host staging) are never routed over nccl. Buckets with nccl routes keep the
//    barrier; each GPU runs its lane pairs one after another in the global channel order.

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/node/live_copy.h"
#include "planner/types.h"
#include "transport/transport.h"

namespace wb::daemon::node {

// One op of the slice (pb::TransferOp as plain values).
struct SliceOp {
  uint32_t index = 0;
  uint32_t bucket = 0;
  uint32_t src_worker = 0;  // slice worker indices
  uint32_t dst_worker = 0;
  int32_t src_piece = -1;  // -1: the side is the rank-0 gather staging ("g"), at staging_offset / staging_box
  int32_t dst_piece = -1;
  int32_t tensor = 0;
  planner::Box box;
  uint64_t bytes = 0;
  bool nccl = false;
  int nccl_src_device = -1;
  int nccl_dst_device = -1;
  bool has_staging_box = false;
  planner::Box staging_box;
  uint64_t staging_offset = 0;
  // Sender-side quantisation (issue 17.1): the op moves the destination piece's quantised elements
  // and the scales of the box's blocks (SenderQuantCopies), `wire_bytes` in all.
  bool sender_quantized = false;
  uint64_t wire_bytes = 0;
  // Lossless deltas (issue 17.2; pb::TransferOp.delta): may travel as a delta against the version
  // its destination holds (ExecOptions::deltas.base_versions).
  bool delta = false;
  // A relay across nodes out of a box a delta writes (pb::TransferOp.after_deltas): both nodes put
  // it into the bucket's after-deltas route of that channel (Route::after_deltas).
  bool after_deltas = false;
};

struct SliceWorker {
  std::string worker_id;
  std::string node_id;
  planner::Role role = planner::Role::kTrainer;
};

// A catch-up source's box that must still hold the committed version (pb::CertifyBox).
struct CertifyBox {
  uint32_t worker = 0;  // slice worker index
  int32_t piece = -1;
  int32_t tensor = 0;
  planner::Box box;
  uint64_t digest = 0;
  uint64_t version_op = 0;
  bool from_catch_up = false;
  bool quantized = false;  // the digest covers quantised elements and scales (`piece` of live_layouts)
  bool quantized_here = false;  // that digest is what the rollout's node quantised (no op)
};

// A node's slice of a plan. `layouts` are what transfers address (a rollout's staging layout);
// `quantized[i]`: slice worker i holds quantised pieces (its staging is host memory).
struct Slice {
  std::vector<SliceWorker> workers;
  std::vector<planner::WorkerLayout> layouts;
  // Per slice worker its own layout (a rollout's quantised pieces with their scales; staging lays
  // them out at the same places, planner::StagingLayout). Needed by sender-quantised ops only;
  // an empty entry reads as `layouts`.
  std::vector<planner::WorkerLayout> live_layouts;
  std::vector<bool> quantized;
  std::vector<SliceOp> ops;
  std::vector<CertifyBox> certify;  // catch-up slices: sources' boxes checked against the version's digests
  uint32_t num_buckets = 0;
  bool sync = false;          // MODE_SYNC
  bool hosts_gather = false;  // this node holds the rank-0 gather staging ("g")
  const planner::Inventory* inventory = nullptr;  // dtypes of the tensors (must outlive the plan)
};

// Region keys of a version on a node: "w<slice worker>.b<buffer>" or "g" (the gather staging).
std::string RegionKey(uint32_t worker, int32_t buffer);

// Where one side of an op lives: the region key and the piece (a synthetic contiguous piece for a
// gather staging side).
struct PieceAt {
  std::string key;
  planner::Piece piece;
};
absl::StatusOr<PieceAt> ResolveSide(const Slice& slice, const SliceOp& op, bool src);

// ---- Sender-side quantisation (issue 17.1; docs/daemon.md "Quantized targets") ----
// A sender-quantised op moves two copies: the quantised elements of its box (fp8: a byte per
// element; int4: the packed bytes, planner::StoredBytes) and the scales of the box's blocks (a
// sub-grid of the destination piece's scales). They land where the receiver's quantiser would have
// written them: the live piece's place and its scales in the rollout's staging (same offsets as
// the live buffers). Their source is
//  - a trainer piece: the sending node quantises the box (daemon/node/quantize_outgoing.h) into
//    its outgoing staging "q.<destination node>" (QuantOutKey): per (source node, destination
//    node), the sender-quantised ops from trainers in op-index order, each its elements row-major
//    over the box then its scales row-major over the box's block grid. Both nodes of such an op
//    hold every op between them in their slices, so they compute the same offsets;
//  - a rollout piece (a relay): the quantised elements and scales it received, at its own piece's
//    place (the planner gives every needer of a fragment the same format on the global grid);
//  - a quantised piece of a catch-up source (a rollout holding the committed version, ROLE_TRAINER
//    in the catch-up slice: planner::PlanOptions::quantized_sources): the same, read from its
//    committed staging or live buffers.
std::string QuantOutKey(const std::string& dst_node);

// The two sides of `box` (whole blocks of the tensor's global grid, inside quantised piece `p`) in
// the memory of `p`'s worker, as a copy addresses them: its quantised elements (planner::StoredBytes;
// int4: the last dim packed two per byte) in `p.buffer`, and the scales of its blocks, a sub-grid
// of `p`'s scale grid, in `p.quant->scale_buffer`. Each sets `copy.shape` / `copy.element_size` and
// `ref` (offset and strides in that buffer). Layout independent in content: two pieces of one format
// holding the same bytes give the same elements and scales in the same order (digests compare them).
void QuantElementsSide(const planner::Inventory& inventory, const planner::Piece& p, const planner::Box& box, transport::CopyOp& copy,
                       transport::StridedRef& ref);
void QuantScalesSide(const planner::Piece& p, const planner::Box& box, transport::CopyOp& copy, transport::StridedRef& ref);

// One trainer-source op to quantise on the sending node.
struct QuantJob {
  uint32_t op_index = 0;
  std::string src_key;         // the trainer region the canonical box is read from
  planner::Piece src;          // the trainer's piece (canonical dtype)
  planner::Box box;            // the op's box
  planner::Quantization quant; // the destination's format (scale_buffer / offset unused)
  int64_t elements_offset = 0, elements_bytes = 0;  // in the q region
  int64_t scales_offset = 0, scales_bytes = 0;
};
struct QuantRegion {
  int64_t size = 0;
  std::vector<QuantJob> jobs;  // op-index order
};

// The two copies of a sender-quantised op (handles unset).
struct QuantCopy {
  std::string src_key, dst_key;
  transport::CopyOp copy;
};
struct SenderQuant {
  std::map<std::string, QuantRegion> regions;  // this node's q regions (QuantOutKey) -> their jobs
  std::map<uint32_t, std::pair<QuantCopy, QuantCopy>> copies;  // op index -> (elements, scales)
  // Local rollouts' pieces that arrive sender-quantised (their receiver-side quantising is skipped).
  std::map<uint32_t, std::set<int32_t>> pieces_in;
};

// Every sender-quantised op of `slice` with a side on `me`: its copies; the q regions of `me`
// (ops from local trainers); the local rollouts' pieces they fill. INVALID_ARGUMENT for an op the
// rule cannot serve (a gather side, a destination piece without quantisation or with a format
// senders cannot produce, a box off the block grid, a relay whose source holds another format).
absl::StatusOr<SenderQuant> PlanSenderQuant(const Slice& slice, const std::string& me);

// First step (before staging is allocated): which local regions go over nccl and on which lane.
struct LanePlan {
  std::map<std::string, int> lane_of;  // local region key -> the lane (GPU) that moves it
  std::set<uint32_t> crosses;          // local workers with an op to or from another node
  std::set<uint32_t> nccl_in;          // local rollouts that receive over nccl
};
// FAILED_PRECONDITION: an op routed over a lane `lanes` lacks, or a quantised rollout's buffer
// routed over nccl; INVALID_ARGUMENT: one region on two lanes.
absl::StatusOr<LanePlan> PlanLanes(const Slice& slice, const std::string& me, const std::set<int>& lanes);

// What the node knows when it plans (after staging is allocated).
struct ExecFacts {
  std::string me;
  std::set<int> lanes;  // nccl lanes (GPUs) this node has
  // Memory kind of each local region key; absent = host.
  std::map<std::string, transport::MemoryKind> kind;
  // Local sync rollouts (slice worker index) whose live buffers are all host memory.
  std::set<uint32_t> host_live_sync;
  std::string cross_kind = "host_tcp";  // the host channel's transport name (its capabilities().kind)
  bool have_local = true, have_cuda = true, have_cross = true;  // which transports exist
  bool checksums = true;  // checksum host-channel batches
};

// A channel to a peer node: the host channel (mine == theirs == cross_kind) or an nccl lane pair.
struct ChannelPlan {
  std::string peer;
  std::string mine, theirs;  // transport names: a kind ("host_tcp") or a lane ("nccl/<device>")
  int my_lane = -1;          // nccl: our GPU
  int their_lane = -1;
  std::string name;          // ChannelName(peer, mine, theirs)
  std::tuple<std::string, std::string, int, int, int> order;  // the global setup order
};

// "<node>" for the host channel, "<node>\n<mine>><theirs>" for an nccl lane pair.
std::string ChannelName(const std::string& peer, const std::string& mine, const std::string& theirs);
// <mine> of a channel name ("" for the host channel).
std::string ChannelTransportName(const std::string& chan);

// The connection round of `channel` in one execution (transport.h, Transport::Connect): the same
// bytes on both nodes of the channel, different for every other execution or channel between
// them. Built from what both nodes hold in SetupPeer - the model, version and plan epoch (the
// caller of ExchangeRegions sends its epoch, and the callee's execution of that version has the
// same: made from the request, or from the coordinator's ExecuteVersion of that epoch) and the
// channel's two (node, transport) ends, smaller node first. So a Connect of an aborted version
// still waiting on one node never takes the connections dialled for the next version or a
// catch-up attempt (another epoch). Components are length-prefixed (no two tuples give the same
// bytes); past transport::kMaxConnectRoundBytes the model id is replaced by a 64-bit hash of the
// whole tuple.
std::string ConnectRound(const std::string& model_id, uint64_t version, uint64_t epoch, const std::string& me,
                         const ChannelPlan& channel);

enum class RouteKind { kHost, kCuda, kPeer, kNccl };

// One op of a batch: region keys and the copy with handles unset (the executor fills them).
struct RouteOp {
  uint32_t op_index = 0;
  std::string src_key, dst_key;
  bool src_local = true, dst_local = true;
  PieceAt src, dst;      // the resolved sides (pieces and boxes stay reachable after the run)
  planner::Box box;      // canonical box moved
  // Sender-quantised op (issue 17.1): its two copies are two RouteOps with the same op_index,
  // kElements then kScales; `src` / `dst` are the canonical sides as the slice names them.
  enum class Part { kCanonical, kElements, kScales } part = Part::kCanonical;
  transport::CopyOp copy;  // src.region / dst.region unset
  uint64_t bytes = 0;
  // Lossless deltas: a kPeer route's canonical op that may travel as a delta (SliceOp.delta), its
  // tensor and destination slice worker (whose base version decides).
  bool delta = false;
  int32_t tensor = 0;
  uint32_t dst_worker = 0;
  // Its destination is a receiver-quantised piece's shadow (canonical bytes the receiving node
  // quantises): a delta's base is that shadow in the committed staging (DeltaOptions::
  // without_shadows).
  bool into_shadow = false;
  // A sender-quantised part's bytes in the sender's delta cache (DeltaKey::variant): a hash of the
  // part and the destination's format, never 0; 0 for canonical bytes.
  uint64_t delta_variant = 0;
};

// One batch of a bucket.
struct Route {
  RouteKind kind = RouteKind::kHost;
  uint32_t bucket = 0;
  std::string what;     // for messages
  std::string peer;     // the peer node (own id for same-node copies)
  std::string channel;  // kPeer / kNccl: ChannelName
  bool checksum = false;
  int64_t bytes = 0;
  int64_t incoming = 0;        // bytes landing on this node
  bool reads_written = false;  // reads a written region: needs every earlier bucket complete
  // Same-node relays out of boxes incoming deltas write: posted after the delta tail (see the top).
  bool after_deltas = false;
  std::pair<int, int> lane{-1, -1};  // nccl: (our GPU, the peer's GPU)
  std::tuple<std::string, std::string, int, int> order;  // nccl: place in the global channel order
  std::vector<RouteOp> ops;
};

struct BucketPlan {
  std::vector<Route> routes;  // in the order their first op appears (op index order)
  bool has_nccl = false;      // keeps the barrier and the lane schedule
};

struct ExecPlan {
  LanePlan lanes;
  std::set<std::string> host_keys, cuda_keys, cross_keys;  // regions per same-node host, cuda_ipc, host channel
  std::set<std::string> peers;                             // peers of the host channel
  std::vector<ChannelPlan> channels;                       // in the global setup order
  std::set<std::string> written;
  std::set<uint32_t> at_commit;  // op indices left to the commit
  std::map<std::string, std::vector<RelayAtCommit>> relays_at_commit;  // destination rollout -> copies
  std::map<std::string, std::set<int32_t>> pieces_at_commit;           // destination rollout -> pieces they fill
  uint64_t relay_bytes_at_commit = 0;
  std::vector<BucketPlan> buckets;
  // Sender-side quantisation: this node's q regions to fill before the buckets (QuantizeOutgoing)
  // and the local rollouts' pieces that arrive quantised (QuantizeStaging skips them).
  std::map<std::string, QuantRegion> quant_out;
  std::map<uint32_t, std::set<int32_t>> quant_pieces_in;
};

absl::StatusOr<ExecPlan> MakeExecPlan(const Slice& slice, const ExecFacts& facts);

// Per GPU, the nccl routes of a bucket in the order that GPU runs them (the global channel order).
std::map<int, std::vector<const Route*>> LaneSchedule(const BucketPlan& bucket);

// Unique among unfinished batches of one channel.
inline uint64_t BatchTag(uint64_t version, uint32_t bucket) { return (version << 24) ^ bucket; }
// The after-deltas batch of a bucket on a channel (Route::after_deltas across nodes).
inline uint64_t AfterDeltasTag(uint64_t version, uint32_t bucket) { return BatchTag(version, 0x400000u | bucket); }

}  // namespace wb::daemon::node
