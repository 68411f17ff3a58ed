#pragma once
// The data-plane interface: how bytes move between registered memory regions (design.md "Data
// plane"). Every implementation (host shared memory, host TCP, CUDA IPC, NCCL) sits behind this one
// interface; the daemon's executor only ever sees `Transport`. Implementations are created by the
// explicit factory in transport/factory.h. Headers-only: no backend fields, no #ifdef.
//
// ---------------------------------------------------------------------------------------------
// Lifecycle (all calls return absl::Status / StatusOr; nothing blocks without a deadline)
//
//   1. Peers.  Two daemons that want to exchange bytes over a transport first exchange endpoint
//      bytes through the control plane:
//        a = A.instance_id(); b = B.instance_id();            // opaque strings, sent both ways
//        ea = A.ExportEndpoint(b); eb = B.ExportEndpoint(a);  // bytes FOR that one peer
//        pa = A.Connect(eb, deadline) || pb = B.Connect(ea, deadline)   // both sides, concurrently
//      Connect is collective for two-sided transports (TCP, NCCL): both sides must call it and it
//      returns when the channel is up or the deadline passes. ExportEndpoint may create per-peer
//      state (e.g. an NCCL unique id), so call it once per peer and give that peer those bytes.
//      Rounds: Connect(endpoint, round, deadline) names the attempt. Both sides of one attempt
//      must pass the same round bytes (the daemon: model, version, plan epoch and the channel's
//      nodes and transports). For two-sided transports the connections dialled for one round are
//      never handed to a Connect of another round, so a Connect whose caller gave up on its attempt
//      (an aborted version) cannot take the channel of the next attempt between the same two
//      instances: it ends at its own deadline. The empty round matches only the empty round (the
//      two-argument Connect). At most kMaxConnectRoundBytes; a transport that honours rounds
//      refuses a longer one with INVALID_ARGUMENT. Transports whose endpoints already tell
//      attempts apart (NCCL: a unique id per export) or that need no connection (host shm, CUDA
//      IPC) may ignore the round; one that wraps another transport must pass it on.
//      Cancelling: CancelRound(round) ends the attempt on this side. Every Connect of that round
//      waiting in this transport returns CANCELLED naming the round, promptly (well before its
//      deadline), and so does every later Connect of it (at once); connections parked or dialled
//      for it are closed. Channels already connected are not touched (Disconnect them). A round
//      names one attempt: do not Connect in a round again once it was cancelled (a transport
//      remembers at least kMinRememberedCancelledRounds cancelled rounds; one cancelled longer ago
//      may connect again). Every transport implements it, also those that ignore the round for
//      pairing; one that wraps another must pass it on.
//      Same-node one-sided transports (host shared memory, CUDA IPC) need no Connect for copies
//      between regions the calling process registered or imported; Connect there only validates
//      that the peer is on the same node and yields a PeerId usable in Batch::peer.
//
//   2. Memory.  RegisterMemory(spec) makes a region of this process's memory known to the
//      transport (host virtual memory, optionally backed by a named POSIX shm segment, or CUDA
//      device memory). ExportDescriptor(region) returns opaque bytes the control plane carries to
//      the peer; the peer's ImportDescriptor(bytes) returns a RegionHandle for the remote region.
//      A descriptor contains: a format magic + version, the exporting transport's kind and
//      instance id, the node identity, the exporter's region id, the region size and memory kind,
//      and whatever the backend needs to reach the bytes (shm name + offset, CUDA IPC handle).
//      It never contains secrets; importing a descriptor never grants more than the region.
//
//   3. Copies.  Post(batch) validates every op and starts the batch; Poll(batch) is non-blocking;
//      Wait(batch, deadline) blocks until the batch finishes or the deadline passes.
//
//   4. Release.  Release(region) forgets a registered or imported region (unmaps imports). A
//      region referenced by an unfinished batch cannot be released (FAILED_PRECONDITION).
//      Disconnect(peer) tears a peer channel down. Destroying the Transport cancels unfinished
//      batches, waits (bounded) for its threads and releases everything it imported.
//
// ---------------------------------------------------------------------------------------------
// Copy ops
//
//   A CopyOp copies an N-D strided region. Element at index vector i (0 <= i[d] < shape[d]) is read
//   from byte   src.offset_bytes + sum_d i[d] * src.strides[d] * element_size   of src.region and
//   written to byte  dst.offset_bytes + sum_d i[d] * dst.strides[d] * element_size  of dst.region.
//   Strides are in ELEMENTS, one per dim, and must be >= 0; shape dims must be >= 0. A shape with a
//   zero dim is a zero-length op: valid, completes, writes nothing (its offsets are not checked
//   against the region). An empty shape vector means a scalar (one element). Destination elements of one batch
//   must not overlap each other (the result is unspecified if they do); sources may overlap.
//   Bytes are copied verbatim (no dtype conversion): element_size only scales strides.
//
//   Which side executes an op: regions are either LOCAL (registered here) or REMOTE (imported).
//     - one-sided transports (Capabilities::two_sided == false: host shared memory, CUDA IPC):
//       the posting process performs the whole copy; the region owner does nothing. Remote
//       regions are directly addressable after import.
//     - two-sided transports (TCP, NCCL): every op has exactly one local and one remote region,
//       and BOTH peers must post the MIRROR batch: same Batch::tag, same ops in the same order,
//       with src/dst naming the same bytes from each side's point of view (each side uses its own
//       local handle and its import of the other's descriptor). An op whose src is local is a
//       send, one whose dst is local is a receive; one batch may mix both directions. A batch
//       whose mirror disagrees (shape, element size, offsets, strides, regions) fails with
//       INVALID_ARGUMENT on both sides.
//   All remote regions in one batch must have been imported from Batch::peer (the peer given to
//   Connect); a region from any other peer is INVALID_ARGUMENT. Batch::peer may be kNoPeer when
//   every region is local (one-sided transports only).
//
//   Validation happens in Post, before anything moves: unknown/released region, region of the
//   wrong peer, negative dims/strides, element_size <= 0, rank mismatch between shape and strides,
//   or any touched byte outside its region -> INVALID_ARGUMENT naming the op index and the
//   reason, and NOTHING of the batch is executed or written.
//
// ---------------------------------------------------------------------------------------------
// Completion, errors, deadlines
//
//   Poll returns BatchState::kRunning, kDone, or the batch's error status. Wait returns OK once
//   every op of the batch has completed on this side AND (two-sided) the peer has confirmed
//   receipt of every byte this side sent (and verified its checksum when enabled); it never
//   reports success before the destination bytes are in place. When the deadline passes first,
//   Wait cancels the batch and returns DEADLINE_EXCEEDED; cancellation is bounded: for a one-sided
//   transport it stops after in-flight chunks, for TCP it closes the peer's connection, for NCCL it
//   aborts the communicator (ncclCommAbort). After a cancelled or failed batch the peer channel
//   may be unusable (Poll/Post on it returns UNAVAILABLE) and must be Connect()ed again.
//   A peer process that vanishes mid-transfer yields UNAVAILABLE naming the peer, no later than
//   the Wait deadline. A checksum mismatch yields DATA_LOSS naming the batch tag and op.
//   Destination contents are unspecified after any failure (the caller discards the version).
//   Every batch must be retired by exactly one call to Wait (any result, including a Wait with a
//   past deadline on an already-finished batch); Poll never retires. After Wait returns, the
//   transport holds no reference to the batch's memory.
//
// ---------------------------------------------------------------------------------------------
// Threading and ownership
//
//   All methods are thread-safe and may be called from any thread. Post never blocks on the
//   network or on copies (it may take locks and validate). Copies run on the transport's own
//   threads / CUDA streams.
//   The caller owns all registered memory: it must stay allocated and mapped until Release
//   returns; the transport never frees it. Imported memory (mapped segments, opened IPC handles)
//   is owned by the transport and stays valid until Release(import) or transport destruction.
//   Post copies the Batch (ops included): the caller may reuse or destroy its Batch as soon as
//   Post returns. The caller must not write source bytes or read destination bytes of a batch
//   until Wait has returned.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wb::transport {

enum class MemoryKind : uint8_t {
  kHost = 0,  // host virtual memory in this process
  kCuda = 1,  // CUDA device memory (a pointer from cudaMalloc on `device`)
};
inline const char* MemoryKindName(MemoryKind kind) { return kind == MemoryKind::kCuda ? "cuda" : "host"; }

// What a transport can do. Capability queries are cheap and constant for a transport's lifetime.
struct Capabilities {
  std::string kind;                      // "host_shm", "host_tcp", "cuda_ipc", "nccl"
  std::vector<MemoryKind> memory_kinds;  // kinds of memory it can read and write
  bool same_node = false;                // can move bytes between processes of one node
  bool cross_node = false;               // can move bytes between nodes
  bool two_sided = false;                // both peers post the mirror batch (see above)
  bool checksums = false;                // honours Batch::checksum
  bool native_strides = false;           // strided ops move without a packing pass
  // CancelBatches works (Transport::CancelBatches): one group's batches end CANCELLED while the
  // channel and other groups' batches on it go on. False: CancelBatches is UNIMPLEMENTED and the
  // caller ends such batches as before (Disconnect, which fails every batch of the channel).
  bool cancel_batches = false;
  // Network endpoints ("host:port") it accepts connections on, for status displays (host_tcp: one
  // per data NIC, in TcpOptions::local_addresses order; its one bind address without multi-NIC).
  // Empty for transports that use no sockets of their own.
  std::vector<std::string> local_addresses;

  bool Reaches(MemoryKind k) const {
    for (MemoryKind m : memory_kinds) {
      if (m == k) return true;
    }
    return false;
  }
};

// Memory to register. For kHost, set `shared_name` when [base, base + size_bytes) lies in a
// named POSIX shm segment (mapped in this process with the segment's byte `shared_offset` at
// `base`): only such regions can be exported to a same-node peer by the host shm transport.
struct MemorySpec {
  MemoryKind kind = MemoryKind::kHost;
  void* base = nullptr;        // may be null only when size_bytes == 0
  int64_t size_bytes = 0;
  int device = -1;             // CUDA device ordinal, kCuda only
  std::string shared_name;     // kHost: POSIX shm segment name backing base, or empty
  int64_t shared_offset = 0;   // kHost: byte offset of `base` within that segment
  std::string label;           // for error messages, e.g. "trainer/3 buffer 0"
};

// Handles are plain values, unique within one Transport instance, never reused by it.
struct RegionHandle {
  uint64_t id = 0;  // 0 is never a valid handle
  friend bool operator==(RegionHandle a, RegionHandle b) { return a.id == b.id; }
  friend bool operator!=(RegionHandle a, RegionHandle b) { return a.id != b.id; }
};

struct PeerId {
  uint64_t id = 0;  // 0 == kNoPeer
  friend bool operator==(PeerId a, PeerId b) { return a.id == b.id; }
  friend bool operator!=(PeerId a, PeerId b) { return a.id != b.id; }
};
inline constexpr PeerId kNoPeer{0};

// The longest round a Connect takes (Transport::Connect; host_tcp sends it in every hello).
inline constexpr size_t kMaxConnectRoundBytes = 256;
// How many cancelled rounds a transport remembers at least (Transport::CancelRound): a Connect of
// one of them fails at once. The oldest is forgotten past it (each costs its bytes, <= 256).
inline constexpr size_t kMinRememberedCancelledRounds = 1024;
// How many cancelled batch groups a transport remembers at least (Transport::CancelBatches): a Post
// in one of them fails at once.
inline constexpr size_t kMinRememberedCancelledGroups = 1024;

struct BatchId {
  uint64_t id = 0;
  friend bool operator==(BatchId a, BatchId b) { return a.id == b.id; }
};

// Information about a handle (local registration or import).
struct RegionInfo {
  bool local = true;         // registered here (true) or imported (false)
  MemoryKind kind = MemoryKind::kHost;
  int64_t size_bytes = 0;
  PeerId peer = kNoPeer;     // imports: the connected peer that exported it, if known
  std::string owner_instance;  // instance_id() of the exporter (== ours for local regions)
  std::string label;
  int device = -1;             // kCuda: the GPU holding the bytes, in this process's numbering; else -1
};

// One side of a copy op.
struct StridedRef {
  RegionHandle region;
  int64_t offset_bytes = 0;
  std::vector<int64_t> strides;  // elements, one per shape dim, each >= 0
};

struct CopyOp {
  StridedRef src;
  StridedRef dst;
  std::vector<int64_t> shape;  // elements per dim, each >= 0; empty = one element
  int32_t element_size = 1;    // bytes, > 0

  // Number of bytes this op moves (product(shape) * element_size).
  int64_t bytes() const {
    int64_t n = element_size;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Hashing an op's bytes as they move (end-to-end digests' cost, docs/daemon.md "End-to-end
// digests"; host_tcp only, other transports leave it untouched). The caller sets unit_bytes before
// Post: per op of the batch (same index), U > 0 asks this side to hash the op's LOGICAL stream in
// units [k * U, min((k + 1) * U, bytes)), each XXH3-64 with seed k - on the sending side the source
// bytes as they are read for sending, on the receiving side the destination bytes right after they
// landed; 0 (or a missing entry): not hashed. Before the batch completes OK the transport fills
// hashes[i] (one per unit) and sets complete[i] = 1 for every op it hashed whole; an op it could not
// hash that way (frames that cut a unit) stays complete[i] = 0, and the caller hashes its memory.
struct UnitHashes {
  std::vector<int64_t> unit_bytes;
  std::vector<std::vector<uint64_t>> hashes;
  std::vector<uint8_t> complete;
};

struct Batch {
  uint64_t tag = 0;        // identifies the batch to the peer (two-sided: mirror has the same tag);
                           // e.g. (version << 32) | bucket. Unique among unfinished batches per peer.
  PeerId peer = kNoPeer;   // whose imported regions the ops may reference
  bool checksum = false;   // verify an xxh3 checksum of the moved bytes before completion
                           // (ignored with a warning-free no-op when !capabilities().checksums)
  std::vector<CopyOp> ops;
  std::shared_ptr<UnitHashes> unit_hashes;  // optional: see UnitHashes (read only after Wait returned OK)
  // Which of the caller's groups the batch belongs to (the daemon: one execution of a version), for
  // CancelBatches; 0 = none. Local to this side: the peer's mirror may name another group.
  uint64_t group = 0;
};

enum class BatchState : uint8_t { kRunning, kDone };

// Payload bytes over one network path: one local address to one remote address of one peer.
struct PathStats {
  std::string peer_instance;   // instance_id() of the peer's transport
  std::string local_address;   // this side's address of the connections (e.g. a data NIC)
  std::string remote_address;  // the peer's address of them
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};

// What one of a transport's bounds against its peers has done (host_tcp: HostTcpCounters, e.g.
// hellos refused, parked connections): `name` is a short snake_case word; `cumulative` counts
// only grow (events), the others are how much is held now. The daemon exports them as
// wb_transport_guard_events_total / wb_transport_guard_held (daemon/guard_meter.h).
struct GuardCount {
  std::string name;
  int64_t value = 0;
  bool cumulative = true;
};

// Progress counters, for metrics and tests.
struct TransportStats {
  int64_t batches_posted = 0;
  int64_t batches_failed = 0;
  int64_t bytes_copied = 0;  // bytes this side completed (sent, received or copied)
  // Per network path, for transports that move bytes over their own connections (host_tcp: one
  // entry per (peer, local address, remote address) its connections ever used, so multi-NIC
  // striping is observable); empty for the others. Counted as payload goes out / comes in (also for
  // batches that fail later), cumulative over the transport's lifetime, kept after the peer
  // disconnects (a peer that restarts is a new instance, with entries of its own).
  std::vector<PathStats> paths;
  // The transport's bounds against peers (empty for transports that keep none).
  std::vector<GuardCount> guards;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual Capabilities capabilities() const = 0;

  // Random, unique per Transport instance; stable for its lifetime.
  virtual std::string instance_id() const = 0;

  // --- peers ---
  virtual absl::StatusOr<std::string> ExportEndpoint(absl::string_view peer_instance_id) = 0;
  // `round`: the attempt this Connect belongs to, the same bytes on both sides (Lifecycle 1
  // above). Pure virtual, so that every implementation, wrappers included, decides what to do
  // with it: a wrapper that dropped it would connect in the empty round while its peer waits in
  // another.
  virtual absl::StatusOr<PeerId> Connect(absl::string_view peer_endpoint, absl::string_view round,
                                         absl::Time deadline) = 0;
  // Connect in the empty round. Implementations bring it into scope (`using Transport::Connect;`).
  absl::StatusOr<PeerId> Connect(absl::string_view peer_endpoint, absl::Time deadline) {
    return Connect(peer_endpoint, absl::string_view(), deadline);
  }
  // Cancels `round` on this side (Lifecycle 1 above): its waiting Connects return CANCELLED
  // naming it, promptly, later ones at once; what was parked or dialled for it is closed; connected
  // channels are not touched. INVALID_ARGUMENT for the empty round (it names no one attempt: every
  // two-argument Connect shares it) or one over kMaxConnectRoundBytes; OK otherwise, also when no
  // Connect of it ever ran. Pure virtual for the reason Connect is: a wrapper that dropped it would
  // leave the wrapped transport's Connect waiting until its deadline.
  virtual absl::Status CancelRound(absl::string_view round) = 0;
  virtual absl::Status Disconnect(PeerId peer) = 0;

  // --- memory ---
  virtual absl::StatusOr<RegionHandle> RegisterMemory(const MemorySpec& spec) = 0;
  virtual absl::StatusOr<std::string> ExportDescriptor(RegionHandle region) = 0;
  // INVALID_ARGUMENT for bytes that are not a descriptor of this transport kind, that come from
  // another node where the transport is same-node only, or that name memory it cannot reach.
  virtual absl::StatusOr<RegionHandle> ImportDescriptor(absl::string_view descriptor) = 0;
  virtual absl::StatusOr<RegionInfo> Describe(RegionHandle region) const = 0;
  virtual absl::Status Release(RegionHandle region) = 0;

  // --- copies ---
  virtual absl::StatusOr<BatchId> Post(const Batch& batch) = 0;
  // StatusOr: kRunning / kDone, or the batch's error. NOT_FOUND for an unknown/retired id.
  virtual absl::StatusOr<BatchState> Poll(BatchId batch) = 0;
  virtual absl::Status Wait(BatchId batch, absl::Time deadline) = 0;
  // Cancels every unfinished batch of `group` (Batch::group) on every peer, and refuses later Posts
  // of it (a transport remembers at least kMinRememberedCancelledGroups cancelled groups, so a
  // group must not be reused). A cancelled batch still needs its Wait, which returns CANCELLED
  // naming `why` promptly (well before its deadline) once no thread of the transport touches its
  // memory. The channel and every other batch on it are untouched: they go on and complete. A
  // two-sided transport tells the peer, whose mirror of a cancelled batch ends CANCELLED too
  // (also one it posts after the cancel arrived). Where a peer cannot take such a cancel (a build
  // from before it), the batch still ends CANCELLED but that channel is closed, as a missed
  // deadline closes it. INVALID_ARGUMENT for group 0; UNIMPLEMENTED when
  // !capabilities().cancel_batches (the default here, so that a wrapper that does not pass it on
  // leaves its caller on the Disconnect path rather than half-cancelled).
  virtual absl::Status CancelBatches(uint64_t group, absl::string_view why) {
    (void)group;
    (void)why;
    return absl::UnimplementedError(absl::StrCat(capabilities().kind, " cannot cancel a group of batches"));
  }

  virtual TransportStats stats() const = 0;
};

}  // namespace wb::transport
