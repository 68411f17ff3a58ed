#pragma once
// The node's side of end-to-end digests (issue 17.4; docs/daemon.md "End-to-end digests"): after a
// version's buckets, the digests of every op of the node's slice that runs here. Pure over plain
// memory (no transports, no locks); the executor hands it the host address of each local region.

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/digest/digest.h"
#include "daemon/node/exec_plan.h"

namespace wb::digest {

// A local memory region of a version (RegionKey "w<i>.b<j>" or "g"): its host bytes, or
// host == nullptr for device memory (GPU staging, a worker's CUDA buffer), which is not digested.
struct RegionBytes {
  const uint8_t* host = nullptr;
  int64_t size = 0;
};

// `box` (tensor coordinates) of the piece `at` inside `region` (its host bytes, non-null) as a
// StridedBox of elements of `element_size` bytes; *offset = its byte offset in the region.
// INTERNAL, prefixed with `what`, for a box outside the region or of another rank than the piece.
absl::StatusOr<StridedBox> BoxInRegion(const std::string& what, const daemon::node::PieceAt& at, const planner::Box& box,
                                       int32_t element_size, const RegionBytes& region, int64_t* offset);

struct OpDigests {
  std::map<uint32_t, Digest> source;  // op index -> digest of what it read (ops this node sends)
  std::map<uint32_t, Digest> landed;  // op index -> digest of what landed (ops this node receives)
  int64_t bytes = 0;                  // bytes hashed (distinct boxes)
  int64_t skipped_sides = 0;          // op sides in device memory (no digest)
  // Cost figures (OpDigestTracker): of `bytes`, those host_tcp hashed as they crossed
  // (transport::UnitHashes), and the CPU seconds spent hashing the rest from memory, split by
  // boxes read as a source and boxes that landed (a box that is both counts as landed).
  int64_t transport_bytes = 0;
  // Of `bytes`, those whose chunk hashes the delta codec took in its passes (CodecHashes).
  int64_t codec_bytes = 0;
  double source_hash_s = 0, landed_hash_s = 0;
};

// For every op of `slice` with a side on node `me`: the source digest over the box it reads when
// its source is local, the landed digest over its destination box when its destination is local
// (a same-node op: both). Ops in `at_commit` (same-node relays the sync commit copies straight from
// the source rollout's staging into live memory; the buckets skipped them) get both from their
// source, which is what the commit copies. Sender-quantised ops are left out (their digests cover
// the quantised bytes: node::DigestSenderQuantized). Identical boxes are hashed once. INTERNAL for a region
// missing from `regions` or a box outside its region (a bug, never a silent skip);
// DEADLINE_EXCEEDED past `deadline`.
absl::StatusOr<OpDigests> DigestLocalOps(const daemon::node::Slice& slice, const std::string& me, const std::set<uint32_t>& at_commit,
                                         const std::map<std::string, RegionBytes>& regions, int threads, absl::Time deadline);

// The same digests, hashed while the version's buckets run (docs/daemon.md "End-to-end digests",
// cost): Start queues every box no bucket of this version writes (what a trainer snapshot or live
// buffer, or a catch-up source, sends) on a DigestPool at once; OnRouteDone, called as each batch
// of the node's ExecPlan completes, queues each landed box once every route op landing it here
// completed; a box of a written region read as a source (a relay, an op left to the commit) waits
// for every route op landing in that region; Finish queues whatever is left, waits and returns
// what DigestLocalOps would have (same digests, same maps). With `overlap` false nothing is queued
// before Finish (the digests after the buckets, as before; bench:e2e --digest_cost compares both).
// The caller keeps every region's memory alive until Finish returns or the tracker is destroyed
// (the destructor stops the hashing: a failed version just drops it).
//
// Hashing in the transport (overlap only; PrepareBatch): a box that is the local side of a
// canonical, non-delta op of a host-channel route is not hashed from memory at all when the
// transport hashes it as it crosses (transport::UnitHashes, host_tcp: the sender hashes the source
// bytes as it sends them, the receiver the destination bytes right after they landed, chunk by
// chunk of the canonical stream, which is the op's logical stream): its digest is combined from
// those chunk hashes when the route completes. Any box the transport did not hash whole is hashed
// from memory as above. What a transport-hashed landed digest covers: the bytes as recv wrote them
// into staging; a flip in staging after that is outside it (with `overlap` false, every box is
// hashed from memory after the buckets).
class OpDigestTracker {
 public:
  struct Options {
    int threads = 8;  // background hashing threads (Finish's caller hashes too)
    absl::Time deadline = absl::InfiniteFuture();
    bool overlap = true;
    int nice = 10;  // of the background threads while the buckets run (DigestPool::Options::nice)
    // With `overlap`: the caller calls PrepareBatch for every batch it posts, so boxes the
    // host channel moves wait for the transport's hashes (see above) instead of being hashed
    // from memory.
    bool in_transport = false;
    // With `overlap`: local sides (op index, landed) of delta ops whose chunk hashes the delta
    // codec hands over through CodecHashes (daemon/node/delta_exchange.h DeltaHashedSides): their
    // boxes wait for them instead of being hashed from memory (see CodecHashes).
    std::set<std::pair<uint32_t, bool>> codec_sides;
  };
  // Errors as DigestLocalOps (a region missing, a box outside its region).
  static absl::StatusOr<std::unique_ptr<OpDigestTracker>> Start(const daemon::node::Slice& slice, const std::string& me,
                                                                const daemon::node::ExecPlan& plan,
                                                                const std::map<std::string, RegionBytes>& regions, Options options);
  ~OpDigestTracker();

  // Before `route` is posted as `batch` (ExecOptions::prepare_batch; executor thread): asks the
  // transport to hash the local side of each op whose box is hashed in the transport (see above) by
  // setting batch.unit_hashes. Ops that differ from the route's copy (a delta stream in its place)
  // and routes not of this tracker's plan are left alone.
  void PrepareBatch(const daemon::node::Route& route, transport::Batch& batch);
  // The delta codec's chunk hashes (digest format, ChunkStreamHasher) of the canonical box of op
  // `op`'s local side (`landed`: the destination box, else the source box), taken while it packed
  // the source or decoded into staging (DeltaOptions::unit_hashes; any thread); null = it did not
  // hash it (the box is hashed from memory once final, or by the transport when it moved it in
  // full). Counted only for a side of Options::codec_sides whose route op copies exactly the
  // side's box (its canonical stream is the op's); one call per such route op.
  void CodecHashes(uint32_t op, bool landed, const std::vector<uint64_t>* chunk_hashes);
  // A batch of `route` completed OK (ExecOptions::on_batch_done; any thread, cheap: it only queues).
  void OnRouteDone(const daemon::node::Route& route);
  // Every op's digests; call once, after the last batch completed.
  absl::StatusOr<OpDigests> Finish();

  struct Boxes;  // the node's boxes and who waits for what (op_digests.cc)

 private:
  OpDigestTracker(std::unique_ptr<Boxes> boxes, Options options);
  void QueueLocked(size_t box) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `box` when it is final and no transport is still to hash it.
  void MaybeQueueLocked(size_t box) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The transport's answer for the ops of a completed route PrepareBatch attached hashes to.
  void TakeUnitHashesLocked(const daemon::node::Route& route) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  absl::Mutex mu_;
  std::unique_ptr<Boxes> boxes_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<DigestPool> pool_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);  // a box the pool refused (never expected: boxes are checked in Start)
};

}  // namespace wb::digest
