#pragma once
// Quantised rollouts (docs/daemon.md "Quantized targets"): the canonical bytes of a rollout's
// quantised pieces land in its incoming (host) staging, each piece in its shadow
// (planner::StagingLayout); the node quantises each shadow into the piece's place and scales in the
// same staging before it reports the version transferred.
//
// NVFP4 groups whose pieces on this node do not cover their tensors (an engine's ranks on several
// nodes, a catch-up of some ranks) take the tensors' magnitudes from the other nodes through
// IncomingOptions::exchange (the coordinator's ExchangeMagnitudes) before they quantise.
//
// IncomingQuantization does that while the buckets still run: a piece is quantised as soon as
// every op landing in it has landed (the executor's ExecOptions::on_op_landed), on a few threads
// beside the transports; NVFP4 pieces sharing a global scale wait for the whole group (the scale
// is the group's largest magnitude). An NVFP4 group is every piece of this node's targets that
// names one global scale slot, merged with the groups holding parts of the same canonical tensors
// (the TP ranks of one engine on this node): its scale is then ModelOpt's per-tensor
// weight_scale_2, the same on every rank, as vLLM holds it after loading a ModelOpt checkpoint. Finish() quantises whatever is left (pieces no op was seen
// for, pieces the early threads had not reached) with every thread and waits. A task checks the
// deadline and a stop before it starts, not inside a piece: an abort waits for the pieces being
// quantised (a piece runs at 1.5-3.5 GB/s per thread). Quantising reads only the shadows and
// writes only the pieces' places and scales, which no transfer touches (StagingLayout puts the
// shadows past every buffer's end), and staging is private to the version, so an abort loses
// nothing: the destructor stops and joins the threads.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/node/live_copy.h"
#include "planner/types.h"

namespace wb::daemon::node {

// One local quantised rollout's incoming staging.
struct QuantizeTarget {
  std::string worker;
  const planner::WorkerLayout* live = nullptr;    // the worker's own layout (quantised pieces + scales)
  const planner::WorkerLayout* shadow = nullptr;  // the staging layout the bytes landed in
  StagedBytes* staging = nullptr;                 // host buffers; must outlive the IncomingQuantization
  // Pieces (indices into `live`) that arrived quantised by their senders (issue 17.1,
  // ExecPlan::quant_pieces_in): already in place, not quantised again. May be null.
  const std::set<int32_t>* sender_quantized = nullptr;
  // Piece index -> the ops (slice op indices) whose boxes land in its shadow. A piece listed here
  // is quantised once every one of them was reported through OpLanded; a piece not listed (or an
  // empty list) waits for Finish.
  std::map<int32_t, std::vector<uint32_t>> landing;
};

// What the quantiser wrote into one piece (IncomingOptions::digests): digest::QuantizedDigest of
// its quantised elements and the scales of its blocks over the piece's box, read as
// QuantElementsSide / QuantScalesSide read them (the form a sender-quantised op's digest has).
struct QuantizedPieceDigest {
  std::string worker;  // the target's worker
  int32_t piece = 0;   // index into the target's `live` layout
  int32_t tensor = -1;
  planner::Box box;    // the piece's box
  uint64_t digest = 0;
};

struct QuantizeResult {
  int64_t pieces = 0;
  int64_t bytes = 0;  // canonical bytes read
  double seconds = 0;         // the first piece started -> the last one written
  double busy_seconds = 0;    // summed over threads (bytes / busy_seconds: the quantiser's rate)
  double finish_seconds = 0;  // Finish() waiting: what the version's critical path paid
  int64_t early_pieces = 0;   // quantised (or started) before Finish
  int64_t ready_pieces = 0;   // whose ops had all landed before Finish (early or not)
  // NVFP4: global scales computed (groups of slots merged by canonical tensor), and of those the
  // ones whose pieces on this node do not cover their tensors (the rollout's ranks span nodes, or a
  // version reached only some of them): those come from the magnitude of the part held here.
  int64_t global_scales = 0;
  int64_t partial_global_scales = 0;  // after the exchange, if any
  int64_t exchanged_tensors = 0;      // tensors whose magnitude the exchange answered
  double exchange_seconds = 0;        // in IncomingOptions::exchange (waiting for other nodes)
  int threads = 0;
  // IncomingOptions::digests: one per piece quantised in a format senders produce (fp8, MXFP8,
  // W4A16: the forms catch-ups serve), in target then piece order.
  std::vector<QuantizedPieceDigest> digests;
  int64_t digest_bytes = 0;  // quantised bytes hashed for them
};

// NVFP4: the largest magnitude of the part of one canonical tensor this node's pieces hold.
struct MagnitudePart {
  int32_t tensor = -1;  // inventory index
  float amax = 0.0f;
  std::vector<planner::Box> boxes;
};
// The exchange's answer for one tensor: the magnitude over every node's parts, and whether they
// cover the tensor.
struct TensorMagnitude {
  float amax = 0.0f;
  bool whole = false;
};
// Called once, from Finish, with this node's parts of every NVFP4 tensor; `wait`: some group here
// is partial and needs the answer (the exchange then returns once every node reported). An empty
// answer leaves the partial groups with their own magnitude; an error fails Finish.
using MagnitudeExchange =
    std::function<absl::StatusOr<std::map<int32_t, TensorMagnitude>>(const std::vector<MagnitudePart>& parts, bool wait)>;

struct IncomingOptions {
  int max_threads = 16;  // capped by the machine's cores and the number of pieces
  // Threads that may quantise before Finish (the buckets' transports and delta decoders share the
  // cores meanwhile). 0: half the cores, at least one; negative: none (all at Finish).
  int early_threads = 0;
  // NVFP4 magnitudes across nodes (see MagnitudeExchange); unset: partial groups use their own.
  MagnitudeExchange exchange;
  // Hash each piece right after quantising it (QuantizeResult::digests): the end-to-end record of
  // what a receiver-quantised rollout holds, against which a catch-up certifies it as a source
  // (pb::QuantizedPieceDigest). The node sets it with --digests.
  bool digests = false;
  // TEST ONLY: on the quantising thread after piece `piece` of target `target` was written.
  std::function<void(size_t target, int32_t piece)> after_piece;
};

class IncomingQuantization {
 public:
  // Checks every quantised piece of `targets` (INTERNAL naming the rollout and tensor when staging
  // cannot hold it or is not host memory) and starts the threads; nothing is quantised until its
  // ops landed. `targets` (their layouts and staging) and `inventory` must outlive the object.
  static absl::StatusOr<std::unique_ptr<IncomingQuantization>> Start(const planner::Inventory& inventory,
                                                                     std::vector<QuantizeTarget> targets, uint64_t version,
                                                                     absl::Time deadline, const IncomingOptions& options = {});
  ~IncomingQuantization();
  IncomingQuantization(const IncomingQuantization&) = delete;
  IncomingQuantization& operator=(const IncomingQuantization&) = delete;

  // Op `op_index` has landed on this node for good (its bytes are final in staging). Any thread;
  // cheap (queues work, never waits for it); repeated or unknown ops are ignored.
  void OpLanded(uint32_t op_index);

  // Quantises every piece not yet quantised, with every thread, and waits: the totals, the first
  // piece's error, or DEADLINE_EXCEEDED at the deadline. With an exchange and NVFP4 pieces it
  // first waits for every group's magnitude, exchanges (partial groups wait for the answer; the
  // others are quantised meanwhile), then quantises the partial groups. Call once.
  absl::StatusOr<QuantizeResult> Finish();

 private:
  struct Job;
  struct Group;
  struct Task {
    size_t job;
    bool amax;  // NVFP4: the piece's largest magnitude (for its group), else quantise the piece
  };
  IncomingQuantization(const planner::Inventory& inventory, uint64_t version, absl::Time deadline);
  // Start: turns each NVFP4 job's slot index (Job::group) into its merged group's index, fills
  // groups_ and the global scale counts.
  void MergeGroups(const std::vector<std::pair<StagedBuffer*, int64_t>>& slots);
  void ReadyLocked(size_t job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Work();
  absl::Status Run(const Task& t, float& amax) const;
  // The piece's QuantizedPieceDigest::digest (after Run quantised it); adds the bytes hashed.
  absl::StatusOr<uint64_t> PieceDigest(const Job& job, int64_t& bytes) const;
  absl::Status DeadlineError() const;
  // Finish, with an exchange: the parts of every NVFP4 tensor, sent; the partial groups' scales
  // from the answer, their quantising queued. Called with mu_ held; releases it around the call.
  absl::Status ExchangeLocked(QuantizeResult& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The group's global scale from gr.amax, written into its slots; its quantising queued.
  void GlobalScaleLocked(Group& gr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const planner::Inventory& inventory_;
  const uint64_t version_;
  const absl::Time deadline_;
  std::vector<QuantizeTarget> targets_;
  std::vector<Job> jobs_;      // fixed after Start
  std::vector<Group> groups_;  // fixed after Start but amax / global / counts (under mu_)
  std::map<uint32_t, std::vector<size_t>> jobs_of_op_;  // fixed after Start
  std::function<void(size_t target, int32_t piece)> after_piece_;
  bool digests_ = false;
  MagnitudeExchange exchange_;
  QuantizeResult base_;
  std::vector<std::thread> threads_;

  mutable absl::Mutex mu_;
  std::map<uint32_t, size_t> op_left_ ABSL_GUARDED_BY(mu_);  // listed op -> not landed yet (1 or 0)
  std::vector<size_t> job_waits_ ABSL_GUARDED_BY(mu_);      // ops each job still waits for
  std::vector<bool> job_ready_ ABSL_GUARDED_BY(mu_);
  std::vector<float> job_amax_ ABSL_GUARDED_BY(mu_);  // NVFP4 jobs: the piece's largest magnitude
  std::vector<std::optional<uint64_t>> job_digest_ ABSL_GUARDED_BY(mu_);  // digests_: per job, once quantised
  int64_t digest_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t groups_measured_ ABSL_GUARDED_BY(mu_) = 0;   // groups whose magnitude tasks all ran
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  int allowed_ ABSL_GUARDED_BY(mu_) = 1;  // threads that may run a task now
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  size_t quantized_ ABSL_GUARDED_BY(mu_) = 0;  // jobs written
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  absl::Time first_start_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time last_end_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration busy_ ABSL_GUARDED_BY(mu_);
  int64_t early_ ABSL_GUARDED_BY(mu_) = 0;
};

// All at once, for callers without an executor (tests): Start with no op lists, then Finish.
// Errors as IncomingQuantization::Start and Finish.
absl::StatusOr<QuantizeResult> QuantizeStaging(const planner::Inventory& inventory, const std::vector<QuantizeTarget>& targets,
                                               uint64_t version, absl::Time deadline);

}  // namespace wb::daemon::node
