#pragma once
// Sender-side quantisation (issue 17.1; docs/daemon.md "Quantized targets"): while a version's
// channels are set up and its buckets run, the sending node quantises the box of each
// sender-quantised op whose source is one of its trainers (ExecPlan::quant_out,
// daemon/node/exec_plan.h) into its outgoing staging
// "q.<destination node>": the op's quantised elements row-major over the box, then the scales of
// the box's blocks row-major over its block grid, at the offsets the plan gave. The executor then
// moves those bytes into the rollout's staging where its receiver-side quantiser would have
// written them. The quantiser is the receiver's (daemon/quantize.h QuantizePiece) run on the box
// alone: the box holds whole blocks of the tensor's global grid, so every block sees the same
// elements and the bytes are bit for bit what the receiver would have produced.

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/digest/op_digests.h"
#include "daemon/node/exec_plan.h"
#include "daemon/node/executor.h"
#include "daemon/node/staging_budget.h"
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

// Host memory for one q region: `base` (size bytes) stays valid while `hold` lives.
struct QStaging {
  uint8_t* base = nullptr;
  std::shared_ptr<void> hold;
};

struct OutgoingOptions {
  int max_threads = 16;  // capped by the machine's cores and the number of chunks
  // The node's host staging budget: every q region is charged to it (like incoming staging) for as
  // long as its memory lives. Null: not charged (tests).
  StagingBudget* budget = nullptr;
  // Where q memory comes from (the node: its staging pool, so a version reuses the previous one's
  // pages instead of faulting fresh ones in). Null: new[].
  std::function<absl::StatusOr<QStaging>(int64_t size, const std::string& what)> allocate;
  // Canonical bytes per chunk (rounded to whole block rows, at least one): the unit the threads
  // hand out, small enough that a chunk's source rows stay in cache while it is quantised.
  int64_t chunk_bytes = int64_t{1} << 20;
  // TEST ONLY: on a quantising thread before each chunk, with the chunk's bucket.
  std::function<void(uint32_t bucket)> before_chunk;
};

// One version's sender-side quantisation, running in the background from Start on so that it
// overlaps channel setup and the buckets: each op's box is cut along dim 0 into chunks of whole
// block rows (each chunk is QuantizePiece over its rows alone - whole blocks again, so the bytes
// are those of the whole box), handed out in bucket order to up to max_threads threads; the
// executor's ExecOptions::before_post(b) calls WaitBucket(b), which returns once every chunk of
// buckets <= b is written. A chunk whose source rows are contiguous in the trainer's buffer is
// quantised in place; others are gathered into a per-thread scratch buffer first.
// Thread-safe. The inventory and every source region's memory must outlive the object; the
// destructor stops handing out chunks and joins the threads (a failed version just drops it).
class OutgoingQuantization {
 public:
  struct Stats {
    int64_t ops = 0, chunks = 0;
    int64_t canonical_bytes = 0;  // read from the sources
    int64_t gathered_bytes = 0;   // of which first copied into scratch (non-contiguous sources)
    int64_t wire_bytes = 0;       // quantised elements + scales written
    double seconds = 0;           // Start -> the last chunk written (so far)
    double waited_seconds = 0;    // the executor blocked in WaitBucket (what was not overlapped)
    int threads = 0;
  };

  // Checks every job (errors as OutgoingQuantizer::Quantize), charges and allocates the q regions
  // (RESOURCE_EXHAUSTED naming the node's --staging_budget_bytes when the budget is too small),
  // and starts the threads. `bucket_of`: op index -> the first bucket that reads its q bytes
  // (QuantBuckets; an op missing is done first, as bucket 0).
  static absl::StatusOr<std::unique_ptr<OutgoingQuantization>> Start(const planner::Inventory& inventory,
                                                                     const std::map<std::string, QuantRegion>& regions,
                                                                     const std::map<uint32_t, uint32_t>& bucket_of,
                                                                     const std::map<std::string, RegionMemory>& memory,
                                                                     const std::string& label, absl::Time deadline,
                                                                     const OutgoingOptions& options = {});
  ~OutgoingQuantization();
  OutgoingQuantization(const OutgoingQuantization&) = delete;
  OutgoingQuantization& operator=(const OutgoingQuantization&) = delete;

  // The q regions (allocated, filled as the chunks complete) and what keeps them (and their
  // budget charge) alive; hold it as long as a transport may read them.
  const std::map<std::string, RegionMemory>& regions() const { return regions_; }
  std::shared_ptr<void> hold() const { return hold_; }

  // Blocks until every chunk of buckets <= `bucket` is written: OK; the first chunk's error
  // (label, op, tensor); DEADLINE_EXCEEDED at the version's deadline.
  absl::Status WaitBucket(uint32_t bucket) { return Wait(bucket, true); }
  absl::Status WaitAll() { return WaitBucket(std::numeric_limits<uint32_t>::max()); }
  // The same for the sending node's delta encoders (DeltaOptions::source_ready: a sender-quantised
  // op's delta is of its quantised bytes), which wait off the executor thread: not counted in
  // Stats::waited_seconds.
  absl::Status WaitReady(uint32_t bucket) { return Wait(bucket, false); }
  Stats stats() const;

 private:
  struct Chunk;
  OutgoingQuantization(const planner::Inventory& inventory, std::string label, absl::Time deadline);
  absl::Status Wait(uint32_t bucket, bool executor);
  void Work();
  absl::Status Run(const Chunk& c, std::vector<uint8_t>& scratch, int64_t& gathered) const;

  const planner::Inventory& inventory_;
  const std::string label_;
  const absl::Time deadline_;
  const absl::Time start_;
  std::function<void(uint32_t bucket)> before_chunk_;
  std::map<std::string, RegionMemory> regions_;
  std::shared_ptr<void> hold_;
  std::vector<QuantJob> jobs_;
  std::vector<Chunk> chunks_;  // bucket order
  Stats base_;                 // the totals known at Start
  std::atomic<size_t> next_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
  mutable absl::Mutex mu_;
  std::map<uint32_t, int64_t> remaining_ ABSL_GUARDED_BY(mu_);  // bucket -> chunks not yet written
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  absl::Time last_done_ ABSL_GUARDED_BY(mu_);
  int64_t gathered_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration waited_ ABSL_GUARDED_BY(mu_);
};

// Op index -> the first bucket of `plan` with a route reading that op's bytes from a q region.
std::map<uint32_t, uint32_t> QuantBuckets(const ExecPlan& plan);

// All at once (tests, callers without an executor): Start, then WaitAll.
class OutgoingQuantizer {
 public:
  explicit OutgoingQuantizer(int max_threads = 16) : max_threads_(max_threads) {}

  // Fills `regions` from the sources in `memory` (every job's src_key, host memory). Contract:
  // every source box lies in its region (INTERNAL naming op, tensor and region otherwise);
  // FAILED_PRECONDITION naming the region when a source is device memory (the coordinator plans
  // sender-side quantisation only for host trainer buffers); DEADLINE_EXCEEDED past `deadline`
  // (checked between chunks). `label` ("<model> v<version>") prefixes every message.
  absl::StatusOr<OutgoingStaging> Quantize(const planner::Inventory& inventory, const std::map<std::string, QuantRegion>& regions,
                                           const std::map<std::string, RegionMemory>& memory, const std::string& label,
                                           absl::Time deadline) const;

 private:
  const int max_threads_;
};

// End-to-end digests of sender-quantised ops (issue 17.4; docs/daemon.md "End-to-end digests"):
// what travels is the quantised bytes, so both sides digest those. Per op with a side on `me`, the
// digest is digest::QuantizedDigest of the two digests (elements, then scales) of its two copies'
// boxes: on the source side where the copies read (the q region or a relay's staging), on the
// destination side where they landed. Overwrites those ops' entries of `digests` (the generic pass
// digested their canonical sides); other entries stay. Device-memory sides are skipped (counted in
// skipped_sides). INTERNAL for a region missing or a box outside it; DEADLINE_EXCEEDED past
// `deadline`.
absl::Status DigestSenderQuantized(const Slice& slice, const std::string& me, const std::map<std::string, digest::RegionBytes>& regions,
                                   int threads, absl::Time deadline, digest::OpDigests& digests);

}  // namespace wb::daemon::node
