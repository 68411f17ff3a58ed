#pragma once
// The global transfer planner. Pure: no I/O, no clocks (plan_ms is filled by callers that time it).
//
// MakePlan(problem, kWeightBridge) returns a plan that is
//  - complete: every destination element is written exactly once;
//  - redundancy-free: a byte crosses the network at most once into each destination node; other
//    GPUs on that node get it by an intra-node relay (an op whose src_worker is the rollout worker
//    that received it in an earlier bucket, src_piece being that worker's destination piece);
//  - relayed across nodes: when a trainer GPU's NIC egress would pass the lower bound, later copies
//    of its bytes are forwarded by rollout GPUs that received them in an earlier bucket (pipelined
//    broadcast tree), so trainers send each byte about once when their egress is the bottleneck;
//  - load-balanced: per fragment (a box with one set of holders and one set of needers, split along
//    dim 0 when large), the sender is the least-loaded holder and the receiver the least-loaded
//    needer of the node, so every trainer GPU and NIC sends;
//  - colocated-aware: bytes whose holder shares the destination's GPU are kSameGpu copies, bytes
//    held elsewhere on the node are kIntraNode copies; neither touches the network;
//  - bucketed: per bucket, each GPU slot sends at most and receives at most
//    problem.staging_budget_bytes (a single op larger than the budget gets a bucket of its own
//    for that GPU), and every relay op sits in a later bucket than the op that delivered its data;
//  - deterministic: equal problems give equal plans and fingerprints.
//
// Baselines (real executable plans):
//  - kRank0Broadcast: every byte trainer 0 (the lowest-indexed trainer worker) lacks is first
//    gathered into trainer 0's staging area (ops with dst_piece = -1), then trainer 0 sends every
//    rollout worker all it needs (src_piece = -1 when it reads the gathered staging copy);
//  - kOwnerBroadcast: each fragment is sent by its first holder to every destination, no dedup;
//  - kP2PNoDedup: each destination pulls each fragment from the least-loaded holder, no dedup.
// All strategies fill stats (lower_bound_s, makespan_s under cost_model.h) and the fingerprint.
//
// Errors: INVALID_ARGUMENT for malformed pieces, FAILED_PRECONDITION when a destination element has
// no source (both name the tensor and the box), INVALID_ARGUMENT for a non-positive budget or
// bandwidth, RESOURCE_EXHAUSTED (naming the tensor and the budget) when the pieces' boxes overlap
// so much that building fragments would pass its work budget (planner/fragments.h
// FragmentWorkBudget; docs/planner.md "Work bounds"), RESOURCE_EXHAUSTED (naming the model, the
// tensor that needs the most ops, the count and the limit) when the plan would have more ops than
// PlanOptions::max_ops / MaxPlanOps (counted before any op is built); PlanOptions::cancel's error
// (its code, CANCELLED / DEADLINE_EXCEEDED for the coordinator's) when it says stop, naming the
// phase and its progress (planner/cancel.h).

#include <cstdint>

#include "absl/status/statusor.h"
#include "planner/cancel.h"
#include "planner/types.h"

namespace wb::planner {

absl::StatusOr<Plan> MakePlan(const Problem& problem, Strategy strategy);

// Plan size cap (docs/planner.md "Work bounds"): the most transfer ops one plan may have,
// kPlanOpsBase + kPlanOpsPerPiece per piece of the problem (trainer and rollout pieces together).
// An op takes about 160 bytes in memory, so the base keeps a plan of a small layout under ~3 GB,
// and a large layout gets 256 ops per piece it sent (real layouts need at most ~200: every needer
// gets one op per fragment, e.g. Qwen2.5-7B FSDP2 dp1024 -> vLLM tp1 x 256, 68M ops for 353k
// pieces). Without it, fragments split at a tiny staging budget times their needers could ask for
// billions of ops (the fragments' work budget counts the split chunks, not chunks x needers).
inline constexpr int64_t kPlanOpsBase = int64_t{1} << 24;
inline constexpr int64_t kPlanOpsPerPiece = 256;
inline int64_t MaxPlanOps(int64_t pieces) { return kPlanOpsBase + kPlanOpsPerPiece * pieces; }

struct PlanOptions {
  // Fragment split size (load-balancing grain). 0: automatic (about 1/64 of one GPU's share of
  // the destination bytes, at least 4 MiB, at most a quarter of the staging budget); < 0: never.
  int64_t max_fragment_bytes = 0;
  // Sender-side quantisation (issue 17.1, planner/sender_quant.h): ops into quantised rollout
  // pieces whose every op lies on the piece's block grid carry the quantised elements and scales
  // (TransferOp::sender_quantized, wire_bytes), and links, buckets and the lower bound count those
  // bytes. Off by default (MakePlan: every op canonical, receiver-side quantisation). The
  // coordinator turns it on where the sending nodes can quantise (daemon/coordinator/plan_cache.h
  // SenderQuantizationFor: WeightBridge's strategy, quantised rollouts, host-memory trainers); the
  // node executor then moves each flagged op's quantised elements and scales, quantised on the
  // sending node (daemon/node/quantize_outgoing.h). `wbctl plan` and bench:planner use it for the
  // prediction (docs/planner.md).
  bool sender_quantization = false;
  // Catch-up plans (daemon/coordinator/catch_up.cc): the sources (ROLE_TRAINER here) are rollouts
  // holding a committed version, some of them quantised. A quantised source piece holds no
  // canonical bytes; it serves, as a copy of its quantised elements and scales (a sender-quantised
  // op that quantises nothing, like a relay's), exactly the fragments whose needers are all
  // quantised in its format on whole blocks (planner/sender_quant.h `from_quantized_holders`);
  // every other fragment is served by unquantised pieces only (KeepServingHolders), else the plan
  // fails FAILED_PRECONDITION naming the box. Implies nothing is quantised by a sender; combine
  // with sender_quantization = false.
  bool quantized_sources = false;
  // > 0: the most ops the plan may have instead of MaxPlanOps(pieces) (tests, tools); past it,
  // RESOURCE_EXHAUSTED before any op is built.
  int64_t max_ops = 0;
  // Cancellation (planner/cancel.h, docs/planner.md "Cancelling a plan"): when set, called at the
  // start and then about every kCancelPollUnits units of work - while building fragments, deciding
  // sender-side quantisation, reserving sender egress and building ops (the load balancer and the
  // bucketing) -, on the planning thread. A non-OK status stops the plan: MakePlanWithOptions
  // returns its code and message plus " (planner stopped PHASE: PROGRESS)". The planner stays
  // clock-free: a deadline is a check that reads the caller's clock. Not polled: the steps linear in
  // the fragments (op count, lower bound) and the final fingerprint. A plan the
  // check never stops is exactly the plan without it (same ops, same fingerprint).
  CancelCheck cancel;
};
absl::StatusOr<Plan> MakePlanWithOptions(const Problem& problem, Strategy strategy,
                                         const PlanOptions& options);

// The baselines MakePlan knows, in report order.
inline constexpr Strategy kBaselines[] = {Strategy::kRank0Broadcast, Strategy::kOwnerBroadcast,
                                          Strategy::kP2PNoDedup};

}  // namespace wb::planner
