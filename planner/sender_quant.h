#pragma once
// Sender-side quantisation (issue 17.1): which fragments travel quantised, decided before planning
// so the planner balances and buckets the bytes that actually move. Pure.
//
// Rule, per destination (rollout) piece P with a Quantization: P is *sender-quantised* when
//  - its format is one the senders produce (float8_e4m3 with float32 or float8_e8m0 scales, int4
//    with bfloat16 / float16 / float32 scales and groups of an even size along the last dim, so
//    every op moves whole packed bytes);
//  - its quantised bytes (elements + scales) are fewer than its canonical bytes;
//  - every fragment covering P lies on P's block grid (BoxOnBlockGrid: whole blocks, so the sender
//    of each op has every element of each block it quantises, and the box's scales are a sub-grid
//    of P's);
//  - every other needer of each of those fragments is sender-quantised in the same format.
// The last condition is what lets relays carry the quantised bytes: any op into a needer of such a
// fragment - from a trainer (which quantises), or a relay from another needer (which copies the
// quantised elements and scales it received; the block grid is global, so they are bit for bit
// what the relay's destination would have quantised itself) - moves the same quantised bytes, and
// no needer ever has to serve canonical bytes it never received. A piece failing any condition
// falls back to receiver-side quantisation for all its ops (canonical bytes into its shadow,
// docs/daemon.md "Quantized targets"); the demotion propagates to the other needers of its
// fragments (fixpoint). So a fragment's ops into rollout pieces are either all sender-quantised
// or none. Ops into a trainer's staging (the rank0 baseline's gather) stay canonical.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cancel.h"
#include "planner/fragments.h"
#include "planner/types.h"

namespace wb::planner {

struct SenderQuantization {
  // Per fragment of the FragmentSet: 1 when its ops into rollout pieces are sender-quantised.
  std::vector<uint8_t> quantized;
  // Per fragment: bytes one op of it into a rollout piece moves (quantised elements + scales, or
  // Fragment::bytes).
  std::vector<int64_t> wire_bytes;
  // The format of the quantised fragments' needers (per fragment; unset when not quantised).
  std::vector<const Quantization*> format;
};

// `enabled` false: nothing quantised, wire_bytes = Fragment::bytes.
//
// `from_quantized_holders` (catch-up plans, PlanOptions::quantized_sources): the sources are
// rollouts, some holding quantised pieces, and no sending node quantises. A fragment is then
// sender-quantised only when, besides the rule above, one of its holders is a quantised piece in
// its needers' format (its quantised elements and scales are then copied, as a relay's are; the
// block grid is global, so they are bit for bit what the needers would have quantised).
// Cost: linear in the fragments' refs (each fragment is checked once; a demoted piece demotes the
// other needers of its fragments through a piece -> fragments index, each fragment at most once),
// however long the chain of demotions. (It used to repeat whole passes over every fragment until
// nothing changed: one pass per link of a chain, quadratic on a chain of overlapping pieces.)
SenderQuantization DecideSenderQuantization(const Problem& problem, const FragmentSet& fs, bool enabled,
                                            bool from_quantized_holders = false);
// The same, polling `cancel` (planner/cancel.h; null: never) as it checks fragments and demotes
// pieces: its error, naming the progress, when it says stop.
absl::StatusOr<SenderQuantization> DecideSenderQuantization(const Problem& problem, const FragmentSet& fs, bool enabled,
                                                            CancelPoll* cancel, bool from_quantized_holders = false);

// Catch-up plans with quantised sources (PlanOptions::quantized_sources): keeps, per fragment, the
// holders that can serve it as `sq` decided - quantised pieces in the needers' format for a
// sender-quantised fragment, unquantised pieces otherwise (a quantised piece holds no canonical
// bytes, and no sending node quantises a catch-up). Rewrites fs.refs; the fragments' order and
// their needers are unchanged. FAILED_PRECONDITION naming tensor, box and the needers' form when a
// fragment keeps no holder.
absl::Status KeepServingHolders(const Problem& problem, const SenderQuantization& sq, FragmentSet& fs);

// Whether the sending node can produce `quant`'s format (see the rule above).
bool SenderCanQuantize(const Quantization& quant);

}  // namespace wb::planner
