#pragma once
// Sender-side quantisation (issue 17.1; docs/daemon.md "Quantized targets"): before a version's
// buckets, the sending node quantises the box of each sender-quantised op whose source is one of
// its trainers (ExecPlan::quant_out, daemon/node/exec_plan.h) into its outgoing staging
// "q.<destination node>": the op's quantised elements row-major over the box, then the scales of
// the box's blocks row-major over its block grid, at the offsets the plan gave. The executor then
// moves those bytes into the rollout's staging where its receiver-side quantiser would have
// written them. The quantiser is the receiver's (daemon/quantize.h QuantizePiece) run on the box
// alone: the box holds whole blocks of the tensor's global grid, so every block sees the same
// elements and the bytes are bit for bit what the receiver would have produced.

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/digest/op_digests.h"
#include "daemon/node/exec_plan.h"
#include "daemon/node/executor.h"
#include "planner/types.h"

namespace wb::daemon::node {

// The filled q regions of one version; `regions` point into memory `hold` keeps alive.
struct OutgoingStaging {
  std::map<std::string, RegionMemory> regions;  // q key -> host memory
  std::shared_ptr<void> hold;
  int64_t ops = 0;
  int64_t canonical_bytes = 0;  // read from the sources
  int64_t wire_bytes = 0;       // quantised elements + scales written
  double seconds = 0;
  int threads = 0;
};

class OutgoingQuantizer {
 public:
  // Quantises on up to `max_threads` threads (ops are independent; one thread does ~2-3 GB/s,
  // //bench:quantize).
  explicit OutgoingQuantizer(int max_threads = 16) : max_threads_(max_threads) {}

  // Fills `regions` from the sources in `memory` (every job's src_key, host memory). Contract:
  // every source box lies in its region (INTERNAL naming op, tensor and region otherwise);
  // FAILED_PRECONDITION naming the region when a source is device memory (the coordinator plans
  // sender-side quantisation only for host trainer buffers); DEADLINE_EXCEEDED past `deadline`
  // (checked between ops). `label` ("<model> v<version>") prefixes every message.
  absl::StatusOr<OutgoingStaging> Quantize(const planner::Inventory& inventory, const std::map<std::string, QuantRegion>& regions,
                                           const std::map<std::string, RegionMemory>& memory, const std::string& label,
                                           absl::Time deadline) const;

 private:
  const int max_threads_;
};

// End-to-end digests of sender-quantised ops (issue 17.4; docs/daemon.md "End-to-end digests"):
// what travels is the quantised bytes, so both sides digest those. Per op with a side on `me`, the
// digest is digest::BoxDigest over the two u64 digests (elements, then scales) of its two copies'
// boxes: on the source side where the copies read (the q region or a relay's staging), on the
// destination side where they landed. Overwrites those ops' entries of `digests` (the generic pass
// digested their canonical sides); other entries stay. Device-memory sides are skipped (counted in
// skipped_sides). INTERNAL for a region missing or a box outside it; DEADLINE_EXCEEDED past
// `deadline`.
absl::Status DigestSenderQuantized(const Slice& slice, const std::string& me, const std::map<std::string, digest::RegionBytes>& regions,
                                   int threads, absl::Time deadline, digest::OpDigests& digests);

}  // namespace wb::daemon::node
