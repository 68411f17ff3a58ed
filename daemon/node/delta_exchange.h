#pragma once
// Lossless deltas in the node executor (issue 17.2; docs/daemon.md "Deltas (design and status)").
// The executor (daemon/node/executor.cc) runs the protocol; this file holds its parts: the slots
// of a version, the per-peer delta region and its layout, the sender's encode and the receiver's
// decode of one op, and the worker threads that run them.
//
// Which ops: a kPeer (host channel) route's op with RouteOp::delta whose destination worker has a
// base version (DeltaOptions::base_versions > 0) is a SLOT - except an op into a receiver-quantised
// piece's shadow (RouteOp::into_shadow) of a rollout whose base holds no shadows
// (DeltaOptions::without_shadows: caught up from quantised bytes): it moves in full (SlotBase). A sender-quantised op is two slots,
// its elements and its scales (RouteOp::Part), each coded with its own element size (fp8 / packed
// int4: 1 byte, scales: their dtype's size) and cached apart from canonical bytes (DeltaKey::variant). Both nodes of the op derive the same
// slots from their slices and the same ExecuteVersion (base_versions goes to every node).
//
// Per version and peer node, each side registers one host region "d.<peer>" on the cross
// transport, laid out from the two lists of slots (ours to the peer = "out", the peer's to us =
// "in", each in (bucket, op index) order):
//   [out lengths: u64 per out slot][in lengths][out refusals: u8 per out slot][in refusals]
//   (64-aligned) [out streams: MaxEncodedBytes per out slot][in landing: MaxEncodedBytes per in slot]
// The peer's region for us has the same layout with out and in swapped, so both sides compute
// every offset on both ends from the plan alone.
//
// Protocol per bucket with slots (all batches are mirror batches on the host channel):
//  1. the sender encodes its out slots of the bucket (worker threads, started with the version);
//     a slot's length is its stream's bytes, or 0 = "sent in full" (no base in the cache, the
//     source is not host memory, or the stream would not be smaller);
//  2. lengths batch (tag LengthsTag): each side's out lengths of the bucket into the peer's in
//     lengths; both wait for it;
//  3. the route's batch: a slot with length L > 0 is one op of L bytes from its out stream to the
//     peer's landing; a slot with 0 is the op's full copy, as without deltas;
//  4. the receiver decodes each landed stream (worker threads) against its committed copy of the
//     destination: DeltaOptions::base gives it; delta::Decode checks base version and digest
//     BEFORE it writes, and the target digest after; the decoded box goes to the op's place in
//     incoming staging. A refused or corrupt stream marks the slot refused.
// After the buckets: a refusals batch (tag RefusalsTag: each side's in refusals into the peer's
// out refusals), then one fallback batch (tag FallbackTag) with the full copies of every refused
// slot, both directions. Never a wrong byte: staging holds a decoded box only when its digest
// matched, and a refused slot's place is overwritten by its full copy before the version is done.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/default_init_allocator.h"
#include "daemon/delta/codec.h"
#include "daemon/node/delta_cache.h"
#include "daemon/node/exec_plan.h"
#include "transport/transport.h"

namespace wb::daemon::node {

// The committed copy of a local rollout region as the receiver holds it (laid out as the region
// it is the base of: the incoming staging of the same key).
struct DeltaBase {
  uint64_t version = 0;
  const uint8_t* data = nullptr;
  int64_t size = 0;
  std::shared_ptr<const void> hold;  // keeps `data` alive while the executor decodes
  // Which memory it is, named in refusals (NodeDeltas::For says which of its bases it chose, and
  // for the live weights what the rollout held when the version started and at the lookup).
  std::string what = "the committed copy";
};

// Reusable host buffers for the per-peer delta regions (first touch of fresh memory is slow on
// some VMs; a node keeps one per model). Thread-safe.
class DeltaBuffers {
 public:
  // A buffer of at least `size` bytes named `name` (e.g. "d.<peer>"), reused across versions while
  // big enough; returned to the pool when the last holder drops it. Its bytes are not zeroed: a
  // region is bounded by the raw size of its slots while streams fill a few percent of them, so
  // only the pages written are ever faulted in (a zero fill touched all of it on the first delta
  // version: 2.8 s of setup per GB on the shared VM). Everything read is written first.
  std::shared_ptr<UninitVector<uint8_t>> Get(const std::string& name, int64_t size);

 private:
  absl::Mutex mu_;
  std::map<std::string, UninitVector<uint8_t>> free_ ABSL_GUARDED_BY(mu_);
};

struct DeltaOptions {
  std::string me;  // this node's id (names the peers' regions for us: "d.<me>")
  // Per destination slice worker: the version its node holds (ExecuteVersionRequest.base_versions).
  std::map<uint32_t, uint64_t> base_versions;
  // Destination slice workers whose base version holds no canonical shadows of their
  // receiver-quantised pieces (ExecuteVersionRequest.bases_without_shadows): a catch-up copied the
  // other rollouts' quantised bytes into the pieces' places and never wrote the shadows, so their
  // ops into shadows have no base (a delta would be refused and resent in full). Both ends know.
  std::set<uint32_t> without_shadows;
  // Sender: copies of what destinations committed; null = every slot goes full.
  DeltaCache* cache = nullptr;
  // Sender: blocks until the bytes that bucket `bucket`'s sender-quantised ops read are written
  // (the node's quantiser fills its q staging in the background; OutgoingQuantization::WaitReady);
  // an error sends those slots in full (the executor's before_post reports it). Null: ready.
  std::function<absl::Status(uint32_t bucket)> source_ready;
  // Receiver: the committed copy of local rollout region `key`; nullopt = refuse its slots.
  std::function<std::optional<DeltaBase>(const std::string& key)> base;
  // Receiver (optional): the digest of op's destination box as this node decoded and verified it
  // in `version` (the stream's target digest), recorded by `record` after each good decode; the
  // next version's base check then does not hash the base. Never trusted for correctness: a
  // recorded digest that no longer matches the base (live weights changed behind the node) fails
  // the decode's target digest, and the op is decoded again against the base's own digest (which
  // refuses it as without a record). Null: the base is hashed.
  std::function<std::optional<delta::Digest>(const RouteOp& op, uint64_t version)> recorded;
  std::function<void(const RouteOp& op, uint64_t version, const delta::Digest& digest)> record;
  // Receiver (optional): op's destination box was decoded into staging and verified - its bytes
  // there are final (a refused op is not reported: its full resend lands as a route). On a decode
  // worker thread; must not block.
  std::function<void(const RouteOp& op)> decoded;
  // End-to-end digests (issue 17.4; optional): the digest format's chunk hashes
  // (digest::ChunkStreamHasher) of the canonical box of a delta op's local side, taken by the codec
  // in its in-cache passes, so the digests need not read that box again. Called exactly once for
  // every (op, side) DeltaHashedSides lists, on a worker thread: `landed` false = the sender's
  // source box (the box it packed into the cache, chunk by chunk, while encoding it or only caching
  // it), true = the receiver's destination box as decoded into staging (dense boxes: staging
  // itself as each chunk is decoded; strided boxes: each run of staging right after it was copied
  // from the scratch); null `unit_hashes` = not hashed here (no pack, a stream that was not decoded
  // OK - the op is resent in full -, a slot that travelled in full): hash it some other way.
  std::function<void(const RouteOp& op, bool landed, const std::vector<uint64_t>* unit_hashes)> unit_hashes;
  DeltaBuffers* buffers = nullptr;  // null: fresh buffers per version
  int threads = 2;                  // encode / decode threads
  // TEST ONLY: called with each landed stream before it is decoded (a test corrupts it).
  std::function<void(uint32_t op_index, absl::Span<uint8_t> stream)> on_landed;
};

struct DeltaStats {
  // Sender side (out slots), and the delta ops' raw bytes.
  uint64_t ops_sent_delta = 0, ops_sent_full = 0;
  uint64_t bytes_sent_stream = 0, bytes_sent_raw = 0;  // streams, and the raw bytes they replace
  uint64_t bytes_sent_full = 0;                         // slots sent full (lengths 0) + fallbacks sent
  uint64_t cache_candidates = 0;                        // ops packed into the cache (slots or not)
  // Receiver side (in slots).
  uint64_t ops_decoded = 0, ops_refused = 0;
  uint64_t ops_decoded_in_place = 0;  // into staging that still held the base (no base copy)
  uint64_t bytes_received_stream = 0, bytes_fallback = 0;
  uint64_t base_digests_recorded = 0;  // decodes whose base digest was recorded, not hashed
  double encode_s = 0, decode_s = 0;  // summed over threads
  std::string first_refusal;          // why the first refused slot was refused
  uint64_t region_bytes = 0;          // host memory of the delta regions of this version
};

// ---- pure parts (unit-tested on their own) ----

// The base version of a delta op (RouteOp::delta) in `options`: its destination's base version, or
// 0 = not a slot (no base, or an op into a shadow of a base without shadows). Both ends of the op
// derive the same from the same ExecuteVersion.
uint64_t SlotBase(const DeltaOptions& options, const RouteOp& op);

// Offsets in a "d.<peer>" region (see above) from the slots' MaxEncodedBytes.
struct DeltaLayout {
  int64_t out_len = 0, in_len = 0, out_ref = 0, in_ref = 0;
  std::vector<int64_t> out_stream, in_land;  // per slot
  int64_t size = 0;
};
DeltaLayout LayoutDeltaRegion(const std::vector<int64_t>& out_max, const std::vector<int64_t>& in_max);

// Packs the elements one side of `copy` names in `region` (host memory of `region_size` bytes)
// into `out` (copy.bytes() long), in the op's element order; Unpack is the reverse.
// INVALID_ARGUMENT when the side reaches outside the region.
absl::Status PackSide(const uint8_t* region, int64_t region_size, const transport::StridedRef& side, const transport::CopyOp& copy,
                      uint8_t* out);
absl::Status UnpackSide(const uint8_t* in, uint8_t* region, int64_t region_size, const transport::StridedRef& side,
                        const transport::CopyOp& copy);

// The local sides DeltaRun hands DeltaOptions::unit_hashes for (op index, landed): of every
// canonical delta op of a kPeer route of `plan`, the source side when this node sends it (slots,
// and ops only cached while the cache is on) and the destination side when this node receives it
// as a slot (its destination has a base version).
std::set<std::pair<uint32_t, bool>> DeltaHashedSides(const ExecPlan& plan, const DeltaOptions& options);

// Sender: packs op's source box, encodes it against the cache's committed copy of `base_version`
// into `out` when there is one (empty `out`: not a slot, only cached), files the packed box as
// pending for `version`. Returns the stream's length, or 0 = send in full. `unit_hashes`
// (optional) receives the digest format's chunk hashes of the packed box when it was packed.
uint64_t EncodeOp(const RouteOp& op, const uint8_t* src, int64_t src_size, uint64_t version, uint64_t base_version, DeltaCache& cache,
                  absl::Span<uint8_t> out, const std::string& label,
                  std::optional<std::vector<uint64_t>>* unit_hashes = nullptr);

// Receiver: decodes `stream` against `base` into op's place in `dst` (incoming staging, host).
// FAILED_PRECONDITION (base missing or of another version/digest) or DATA_LOSS (corrupt stream):
// the caller resends the op in full; the op's place in `dst` holds unspecified bytes then.
// `recorded`: the base box's digest if recorded (DeltaOptions::recorded); on any failure with it the
// op is decoded once more against the base's own digest. `*decoded` (optional) receives the digest
// of the box it wrote (the stream's verified target digest); `*unit_hashes` (optional, on success
// only) the digest format's chunk hashes of the box as it is in `dst` (see
// DeltaOptions::unit_hashes).
absl::Status DecodeOp(const RouteOp& op, uint8_t* dst, int64_t dst_size, const std::optional<DeltaBase>& base,
                      absl::Span<const uint8_t> stream, const std::string& label,
                      std::optional<delta::Digest> recorded = std::nullopt, delta::Digest* decoded = nullptr,
                      std::vector<uint64_t>* unit_hashes = nullptr);

// Batch tags of the protocol's extra batches (distinct from every bucket's BatchTag).
inline uint64_t LengthsTag(uint64_t version, uint32_t bucket) { return BatchTag(version, 0x800000u | bucket); }
inline uint64_t RefusalsTag(uint64_t version) { return BatchTag(version, 0xFFFFFEu); }
inline uint64_t FallbackTag(uint64_t version) { return BatchTag(version, 0xFFFFFFu); }

// A small worker pool: decode jobs before encode jobs. Drain() waits for every queued job; the
// destructor drops queued jobs and joins (a job never outlives it).
class DeltaWorkers {
 public:
  explicit DeltaWorkers(int threads);
  ~DeltaWorkers();
  void Encode(std::function<void()> job);
  void Decode(std::function<void()> job);
  // Waits until no job is queued or running, or `deadline`; false on the deadline.
  bool Drain(absl::Time deadline);

 private:
  void Loop();
  absl::Mutex mu_;
  std::deque<std::function<void()>> encode_ ABSL_GUARDED_BY(mu_), decode_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// One copy of the protocol's own batches (lengths, refusals, streams): region keys ("d.<node>")
// and offsets; `src_local` says which side is this node's region.
struct DeltaCopy {
  bool src_local = true;
  std::string src_key, dst_key;
  int64_t src_off = 0, dst_off = 0, bytes = 0;
};
struct DeltaBatchPlan {
  std::string peer, channel;
  uint64_t tag = 0;
  std::vector<DeltaCopy> copies;
};

// The delta side of one executor run (see the top of this file). The executor thread calls
// everything except what the worker threads run; counters are guarded.
class DeltaRun {
 public:
  using HostMemory = std::function<std::optional<std::pair<uint8_t*, int64_t>>(const std::string& key)>;
  // Null when the plan has no slot and nothing to cache. `host` finds the host memory of a local
  // region key (nullopt for GPU memory: such slots go full / are refused).
  static absl::StatusOr<std::unique_ptr<DeltaRun>> Make(const ExecPlan& plan, const DeltaOptions& options, uint64_t version,
                                                        std::string label, HostMemory host);
  ~DeltaRun();

  // The "d.<peer>" regions to register on the cross transport (host memory).
  std::map<std::string, std::pair<uint8_t*, int64_t>> Regions() const;
  // Queues the encodes (slots first, by bucket; then boxes only cached).
  void Start();
  // Bucket `b`'s lengths batches (one per peer with slots in it, either direction), after its out
  // slots are encoded (waits for that, until `deadline`).
  absl::StatusOr<std::vector<DeltaBatchPlan>> LengthsBatches(uint32_t b, absl::Time deadline);
  // After the lengths batches of `b` completed: reads the peer's lengths (DATA_LOSS when one
  // exceeds its slot).
  absl::Status LengthsLanded(uint32_t b);
  // Ops of route `r` that travel as streams: position in r.ops -> the stream copy.
  std::map<size_t, DeltaCopy> Substitutions(const Route& r) const;
  // Route `r` completed: decode its landed streams (worker threads). True when it queued any: the
  // route's destination bytes are final only after RefusalsBatches and the fallback (the executor
  // holds the route's on_batch_done until then). `decoding` (optional) receives the route ops
  // queued (elements of r.ops: a sender-quantised op's two parts share an op index, so they are
  // told apart by address): DeltaOptions::decoded reports each that decodes; the route's other
  // ops are final now.
  bool Landed(const Route& r, std::set<const RouteOp*>* decoding = nullptr);
  // After the buckets: waits for the decodes, then the refusals batches (one per peer that had a
  // stream either way).
  absl::StatusOr<std::vector<DeltaBatchPlan>> RefusalsBatches(absl::Time deadline);
  // After the refusals batches completed: per peer with a refused slot, a route of the refused
  // ops' full copies (both directions, lower node's sends first); its tag is FallbackTag.
  std::vector<Route> FallbackRoutes();
  // Waits for every job (cache-only encodes too) before the executor returns.
  absl::Status Finish(absl::Time deadline);
  DeltaStats stats() const;

 private:
  struct Slot {
    const Route* route = nullptr;
    size_t pos = 0;
    const RouteOp* op = nullptr;
    uint64_t base = 0;
    int64_t max = 0;
    uint64_t len = 0;
    bool refused = false;
  };
  struct Peer {
    std::string peer, channel;
    std::vector<Slot> out, in;
    std::map<uint32_t, std::pair<size_t, size_t>> out_b, in_b;  // bucket -> [first, end) slots
    DeltaLayout mine, theirs;
    std::shared_ptr<UninitVector<uint8_t>> mem;
    bool streams = false;  // some slot either way travelled as a stream
  };
  DeltaRun(const DeltaOptions& o, uint64_t version, std::string label, HostMemory host);
  // The host memory of op's source once its bytes are written (DeltaOptions::source_ready).
  std::optional<std::pair<uint8_t*, int64_t>> SourceWhenReady(const RouteOp& op, uint32_t bucket);
  void EncodeSlot(Peer& p, size_t i);
  // DeltaOptions::unit_hashes: whether op's hashes are wanted, and handing them over (null: none).
  bool WantUnits(const RouteOp& op) const;
  void HandUnits(const RouteOp& op, bool landed, const std::optional<std::vector<uint64_t>>& units);
  void DecodeSlot(Peer& p, size_t j);
  bool Lo(const Peer& p) const { return o_.me < p.peer; }

  const DeltaOptions& o_;
  const uint64_t version_;
  const std::string label_;
  HostMemory host_;
  std::map<std::string, Peer> peers_;  // by peer node
  std::vector<std::pair<const RouteOp*, uint32_t>> cache_only_;  // with the bucket of its route
  mutable absl::Mutex mu_;
  std::map<uint32_t, int> encoding_ ABSL_GUARDED_BY(mu_);  // bucket -> out slots not yet encoded
  int decoding_ ABSL_GUARDED_BY(mu_) = 0;
  DeltaStats stats_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<DeltaWorkers> workers_;  // last: joined first
};

}  // namespace wb::daemon::node
