#include "transport/nccl/nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "transport/common.h"
#include "transport/registry.h"
#include "transport/cuda_ipc/cuda_copy.h"
#include "transport/cuda_ipc/cuda_status.h"
#include "transport/nccl/nccl_internal.h"
#include "transport/strided.h"
#include "base/wire.h"
#include "base/status_macros.h"

namespace wb::transport {
namespace {

using nccl_internal::WithDenseSide;

constexpr char kKind[] = "nccl";
// Chunking and staging constants must be equal on both peers (they decide the NCCL call sequence);
// they are compile-time constants for that reason, and part of the manifest.
constexpr int64_t kStageChunk = int64_t{8} << 20;
constexpr int64_t kStagingBytes = int64_t{64} << 20;
constexpr int kMaxCallsPerGroup = 256;
constexpr int64_t kStageAlign = 256;
constexpr absl::Duration kLivenessEvery = absl::Milliseconds(100);
// After Wait's deadline: how long Wait waits for the worker to abort the communicator and finish
// the batch, and how long teardown lets the peer's stream drain before it leaks (rather than frees)
// memory the GPU may still touch. ncclCommAbort is meant to be bounded, but no wait here is
// allowed to be unbounded on that promise alone.
constexpr absl::Duration kAbortGrace = absl::Seconds(10);

std::string PidNamespace() {
  char buf[256];
  ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

struct Region : RegionRecord {};  // base: local regions only

// One NCCL send or receive of a batch. Both sides derive the same chunk list from the ops.
struct Chunk {
  int op = 0;
  bool send = false;
  CanonicalBox box;      // this chunk's part of the op
  int64_t local_off = 0;  // byte offset of the chunk's first element in the local region
  bool staged = false;    // the local side is strided: pack/unpack through staging
  int64_t stage_off = 0;  // offset in the staging buffer (valid when the chunk needs staging on either side)
};

struct Round {
  std::vector<Chunk> chunks;
};

struct NcclPeer;

struct NcclBatch {
  uint64_t id = 0;
  uint64_t tag = 0;
  std::shared_ptr<NcclPeer> peer;
  uint64_t manifest = 0;
  int64_t bytes = 0;
  std::vector<uint64_t> regions;
  std::vector<char*> local_base;  // per op
  std::vector<Round> rounds;
  bool finished = false;
  bool deadline_hit = false;
  absl::Status status;
};

struct NcclPeer {
  uint64_t id = 0;
  std::string instance;
  int remote_rank = 0;
  pid_t pid = 0;
  bool same_pidns = false;  // pid is meaningful for a liveness check
  // Owned by the worker thread once it runs (created by Connect before that).
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  uint64_t* host = nullptr;  // pinned, 4 words: manifest out (2), manifest in (2)
  char* dev = nullptr;       // 32 bytes of device scratch for the manifest
  char* staging = nullptr;
  cudaEvent_t event = nullptr;
  std::thread worker;
  // Guarded by the transport's mu_.
  bool broken = false;
  absl::Status broken_status;
  absl::Status cancel;  // set by Wait's deadline / Disconnect: the worker aborts the communicator
  bool stop = false;
  std::deque<std::shared_ptr<NcclBatch>> queue;
  std::map<uint64_t, std::shared_ptr<NcclBatch>> by_tag;  // unretired batches
};

// Sub-boxes of `box` (offsets relative to the op's first element) of at most kStageChunk bytes
// each, in logical order; the whole box when it is contiguous on both sides or small enough.
struct SubBox {
  CanonicalBox box;
  int64_t src_off = 0;
  int64_t dst_off = 0;
};

std::vector<SubBox> SplitBox(const CanonicalBox& box) {
  std::vector<SubBox> out;
  const int k = static_cast<int>(box.outer.size());
  if (k == 0 || box.bytes() <= kStageChunk) {
    out.push_back({box, 0, 0});
    return out;
  }
  // slice[i] = bytes of one index of outer dim i.
  std::vector<int64_t> slice(k);
  int64_t inner = box.width;
  for (int i = k - 1; i >= 0; --i) {
    slice[i] = inner;
    inner *= box.outer[i].extent;
  }
  int split = k;  // first dim whose slices fit a chunk; k: single rows (each contiguous on both sides)
  for (int i = 0; i < k; ++i) {
    if (slice[i] <= kStageChunk) {
      split = i;
      break;
    }
  }
  const int fixed = split;  // dims [0, fixed) iterate one index at a time
  std::vector<int64_t> idx(fixed, 0);
  while (true) {
    int64_t so = 0, dof = 0;
    for (int i = 0; i < fixed; ++i) {
      so += idx[i] * box.outer[i].src_stride;
      dof += idx[i] * box.outer[i].dst_stride;
    }
    if (split == k) {
      SubBox sb;
      sb.box.width = box.width;
      sb.src_off = so;
      sb.dst_off = dof;
      out.push_back(std::move(sb));
    } else {
      const BoxDim& d = box.outer[split];
      const int64_t step = std::max<int64_t>(1, kStageChunk / slice[split]);
      for (int64_t a = 0; a < d.extent; a += step) {
        SubBox sb;
        sb.box.width = box.width;
        sb.box.outer.push_back({std::min(step, d.extent - a), d.src_stride, d.dst_stride});
        for (int i = split + 1; i < k; ++i) sb.box.outer.push_back(box.outer[i]);
        sb.src_off = so + a * d.src_stride;
        sb.dst_off = dof + a * d.dst_stride;
        out.push_back(std::move(sb));
      }
    }
    int i = fixed - 1;
    for (; i >= 0; --i) {
      if (++idx[i] < box.outer[i].extent) break;
      idx[i] = 0;
    }
    if (i < 0) break;
  }
  return out;
}

class NcclTransport : public Transport {
 public:
  NcclTransport(const TransportConfig& config)
      : device_(config.nccl.device),
        node_id_(config.node_id.empty() ? DefaultNodeId() : config.node_id),
        instance_id_(RandomInstanceId()),
        pidns_(PidNamespace()) {}

  ~NcclTransport() override {
    std::vector<std::shared_ptr<NcclPeer>> peers;
    {
      absl::MutexLock l(&mu_);
      for (auto& [id, p] : peers_) peers.push_back(p);
      peers_.clear();
    }
    for (auto& p : peers) Teardown(p, absl::CancelledError("nccl transport destroyed"));
  }

  Capabilities capabilities() const override {
    Capabilities c;
    c.kind = kKind;
    c.memory_kinds = {MemoryKind::kCuda};
    c.same_node = false;  // works on one node with two GPUs, but cuda_ipc is the same-node path
    c.cross_node = true;
    c.two_sided = true;
    c.checksums = false;
    c.native_strides = false;  // strided sides go through a packing copy into staging
    return c;
  }

  std::string instance_id() const override { return instance_id_; }

  absl::StatusOr<std::string> ExportEndpoint(absl::string_view peer_instance_id) override {
    if (peer_instance_id.empty() || peer_instance_id == instance_id_) {
      return absl::InvalidArgumentError(absl::StrCat("nccl ExportEndpoint: bad peer instance '", peer_instance_id, "'"));
    }
    wire::Writer w = RecordWriter(RecordType::kEndpoint, kKind, instance_id_, node_id_);
    w.Str(pidns_);
    w.U32(static_cast<uint32_t>(getpid()));
    if (instance_id_ < peer_instance_id) {  // we are rank 0: we create the unique id
      // Each ncclGetUniqueId starts an NCCL bootstrap root (a listening socket + a detached thread
      // that accepts until every rank of that id has joined; NCCL has no call to cancel it). So a
      // repeated export for a peer whose id no Connect has consumed yet hands out the SAME id
      // rather than a new one: no second root is started, and a peer already joining with the
      // first endpoint's id still meets us. Connect consumes the id (success or failure); the next
      // export then creates a fresh one.
      // (ncclGetUniqueId runs outside mu_: its first call initialises NCCL, which can take a while;
      // two racing first exports for one peer both return the id stored first, and the other
      // id's root is left waiting: rare, and no worse than before.)
      ncclUniqueId uid;
      bool have = false;
      {
        absl::MutexLock l(&mu_);
        if (auto it = pending_uids_.find(peer_instance_id); it != pending_uids_.end()) {
          uid = it->second;
          have = true;
        }
      }
      if (!have) {
        if (absl::Status s = NcclStatus(ncclGetUniqueId(&uid), "nccl ExportEndpoint: ncclGetUniqueId"); !s.ok()) {
          return s;
        }
        absl::MutexLock l(&mu_);
        uid = pending_uids_.try_emplace(std::string(peer_instance_id), uid).first->second;
      }
      w.U8(1);
      w.Str(absl::string_view(uid.internal, NCCL_UNIQUE_ID_BYTES));
    } else {
      w.U8(0);
      w.Str("");
    }
    return std::move(w.out());
  }

  using Transport::Connect;
  // The round does not pair anything: a Connect joins the communicator of the unique id in the
  // endpoint it was given. Not a full answer (docs/transport.md, "nccl"): an export repeats a
  // unique id that no Connect of rank 0 consumed yet, so a rank-1 Connect left waiting by an
  // abandoned attempt can still meet rank 0 of the next one unless its caller cancels its round
  // (CancelRound, which the daemon does when it aborts the version); telling those apart without
  // that needs the round at export time. A cancelled round ends the communicator init (abort).
  absl::StatusOr<PeerId> Connect(absl::string_view endpoint, absl::string_view round, absl::Time deadline) override {
    ScopedCudaDevice keep_device;
    wire::Reader r(endpoint);
    const uint32_t magic = r.U32();
    const uint8_t type = r.U8();
    std::string kind = r.Str(), inst = r.Str(), node = r.Str(), pidns = r.Str();
    const uint32_t pid = r.U32();
    const uint8_t has_uid = r.U8();
    std::string uid_bytes = r.Str(NCCL_UNIQUE_ID_BYTES);
    if (!r.done() || magic != kWireMagic || type != static_cast<uint8_t>(RecordType::kEndpoint) || kind != kKind) {
      return absl::InvalidArgumentError("nccl Connect: bytes are not an nccl endpoint");
    }
    if (inst == instance_id_) return absl::InvalidArgumentError("nccl Connect: cannot connect to itself");
    const int rank = instance_id_ < inst ? 0 : 1;
    ncclUniqueId uid;
    {
      absl::MutexLock l(&mu_);
      if (cancelled_.Has(round)) return CancelledRounds::Error(kKind, inst, round);
    }
    if (rank == 0) {
      absl::MutexLock l(&mu_);
      auto it = pending_uids_.find(inst);
      if (it == pending_uids_.end()) {
        return absl::FailedPreconditionError(absl::StrCat("nccl Connect to ", inst,
                                                          ": call ExportEndpoint(peer) first and give the peer "
                                                          "those bytes (this side creates the unique id)"));
      }
      uid = it->second;
      pending_uids_.erase(it);
    } else {
      if (has_uid != 1 || uid_bytes.size() != NCCL_UNIQUE_ID_BYTES) {
        return absl::InvalidArgumentError(absl::StrCat("nccl Connect: endpoint of ", inst,
                                                       " carries no unique id (it should be rank 0)"));
      }
      std::memcpy(uid.internal, uid_bytes.data(), NCCL_UNIQUE_ID_BYTES);
    }
    auto p = std::make_shared<NcclPeer>();
    p->instance = inst;
    p->remote_rank = 1 - rank;
    p->pid = static_cast<pid_t>(pid);
    p->same_pidns = node == node_id_ && !pidns.empty() && pidns == pidns_;
    if (absl::Status s = CreateComm(p.get(), uid, rank, deadline, round); !s.ok()) {
      FreePeerResources(p.get());
      return s;
    }
    absl::MutexLock l(&mu_);
    p->id = next_id_++;
    peers_[p->id] = p;
    p->worker = std::thread([this, p] { WorkerLoop(p); });
    return PeerId{p->id};
  }

  // A waiting Connect of `round` sees it at its next poll (<= 5 ms) and ends CANCELLED.
  absl::Status CancelRound(absl::string_view round) override {
    RETURN_IF_ERROR(CancelledRounds::Check(kKind, round));
    absl::MutexLock l(&mu_);
    cancelled_.Add(round);
    return absl::OkStatus();
  }

  absl::Status Disconnect(PeerId id) override {
    std::shared_ptr<NcclPeer> p;
    {
      absl::MutexLock l(&mu_);
      auto it = peers_.find(id.id);
      if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("nccl: unknown peer ", id.id));
      p = it->second;
      peers_.erase(it);
    }
    Teardown(p, absl::CancelledError(absl::StrCat("nccl peer ", p->instance, " disconnected")));
    return absl::OkStatus();
  }

  absl::StatusOr<RegionHandle> RegisterMemory(const MemorySpec& spec) override {
    if (spec.kind != MemoryKind::kCuda) {
      return absl::InvalidArgumentError(absl::StrCat("nccl cannot reach ", MemoryKindName(spec.kind),
                                                     " memory (region '", spec.label, "')"));
    }
    if (spec.size_bytes < 0 || (spec.base == nullptr && spec.size_bytes > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("nccl: bad region '", spec.label, "'"));
    }
    if (spec.size_bytes > 0) {
      cudaPointerAttributes attr = {};
      if (cudaError_t e = cudaPointerGetAttributes(&attr, spec.base); e != cudaSuccess) {
        return CudaStatus(e, absl::StrCat("nccl RegisterMemory('", spec.label, "'): cudaPointerGetAttributes"));
      }
      if (attr.type != cudaMemoryTypeDevice || attr.device != device_ || (spec.device >= 0 && spec.device != device_)) {
        return absl::InvalidArgumentError(absl::StrCat("nccl: region '", spec.label, "' is not device memory of GPU ",
                                                       device_, " (the transport's NcclOptions::device)"));
      }
    }
    absl::MutexLock l(&mu_);
    const uint64_t id = next_id_++;
    Region& r = regions_.Add(id, Region());
    r.local = true;
    r.base = static_cast<char*>(spec.base);
    r.size = spec.size_bytes;
    r.label = spec.label;
    r.owner_instance = instance_id_;
    r.owner_region_id = id;
    return RegionHandle{id};
  }

  absl::StatusOr<std::string> ExportDescriptor(RegionHandle h) override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(const Region* r, regions_.Find(h));
    if (!r->local) return absl::FailedPreconditionError("nccl: cannot re-export an imported region");
    return EncodePlainDescriptor(kKind, {instance_id_, node_id_, h.id, r->size, r->label});
  }

  absl::StatusOr<RegionHandle> ImportDescriptor(absl::string_view bytes) override {
    ASSIGN_OR_RETURN(PlainDescriptor d, DecodePlainDescriptor(kKind, bytes));
    if (d.instance == instance_id_) {
      return absl::InvalidArgumentError(absl::StrCat("nccl ImportDescriptor: region '", d.label,
                                                     "' is this transport's own; import a peer's descriptor"));
    }
    absl::MutexLock l(&mu_);
    const uint64_t id = next_id_++;
    Region& r = regions_.Add(id, Region());
    r.local = false;
    r.size = d.size;
    r.label = d.label;
    r.owner_instance = d.instance;
    r.owner_region_id = d.region_id;
    return RegionHandle{id};
  }

  absl::StatusOr<RegionInfo> Describe(RegionHandle h) const override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(const Region* r, regions_.Find(h));
    RegionInfo info = BasicRegionInfo(*r);
    info.kind = MemoryKind::kCuda;
    if (info.local) info.device = device_;  // only memory on this transport's GPU registers
    for (auto& [pid, p] : peers_) {
      if (!info.local && p->instance == r->owner_instance) info.peer = PeerId{pid};
    }
    return info;
  }

  absl::Status Release(RegionHandle h) override {
    absl::MutexLock l(&mu_);
    return regions_.Release(h);
  }

  absl::StatusOr<BatchId> Post(const Batch& batch) override {
    auto b = std::make_shared<NcclBatch>();
    b->tag = batch.tag;
    absl::MutexLock l(&mu_);
    auto pit = peers_.find(batch.peer.id);
    if (pit == peers_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("nccl batch ", batch.tag, ": unknown peer ", batch.peer.id,
                                                     " (two-sided transport: Batch::peer is required)"));
    }
    std::shared_ptr<NcclPeer> peer = pit->second;
    if (peer->broken) {
      return absl::UnavailableError(absl::StrCat("nccl peer ", peer->instance, " is unusable until reconnected: ",
                                                 peer->broken_status.message()));
    }
    if (peer->by_tag.count(batch.tag)) {
      return absl::InvalidArgumentError(absl::StrCat("nccl: batch tag ", batch.tag, " already in flight"));
    }
    wire::Writer m;  // the batch as both sides must see it (who sends, whose regions, the layout)
    m.U64(batch.tag);
    m.I64(kStageChunk);
    m.I64(kStagingBytes);
    m.U32(kMaxCallsPerGroup);
    std::vector<Chunk> chunks;
    const std::string prefix = absl::StrCat("nccl batch ", batch.tag);
    for (size_t i = 0; i < batch.ops.size(); ++i) {
      const CopyOp& op = batch.ops[i];
      auto src = regions_.FindForOp(op.src.region, prefix, i, "source");
      if (!src.ok()) return src.status();
      auto dst = regions_.FindForOp(op.dst.region, prefix, i, "destination");
      if (!dst.ok()) return dst.status();
      auto is_send = TwoSidedOpIsSend(**src, **dst, prefix, i, peer->instance);
      if (!is_send.ok()) return is_send.status();
      auto layout = ValidateOp(op, static_cast<int>(i), (*src)->size, (*dst)->size, (*src)->label, (*dst)->label);
      if (!layout.ok()) return layout.status();
      const bool send = *is_send;
      b->local_base.push_back(send ? (*src)->base : (*dst)->base);
      b->regions.push_back(op.src.region.id);
      b->regions.push_back(op.dst.region.id);
      b->bytes += layout->src.total_bytes();
      m.Str(send ? instance_id_ : peer->instance);
      m.U64((*src)->owner_region_id);
      m.U64((*dst)->owner_region_id);
      m.I64(op.src.offset_bytes);
      m.I64(op.dst.offset_bytes);
      m.U32(op.element_size);
      m.U32(op.shape.size());
      for (auto d : op.shape) m.I64(d);
      for (auto s : op.src.strides) m.I64(s);
      for (auto s : op.dst.strides) m.I64(s);
      const CanonicalBox box = Canonicalize(op.shape, op.src.strides, op.dst.strides, op.element_size);
      if (box.empty || box.bytes() == 0) continue;
      for (SubBox& sb : SplitBox(box)) {
        Chunk c;
        c.op = static_cast<int>(i);
        c.send = send;
        c.local_off = send ? op.src.offset_bytes + sb.src_off : op.dst.offset_bytes + sb.dst_off;
        c.staged = send ? !SrcContiguous(sb.box) : !DstContiguous(sb.box);
        c.box = std::move(sb.box);
        chunks.push_back(std::move(c));
      }
    }
    b->manifest = XXH3_64bits(m.out().data(), m.out().size());
    // Rounds: identical on both sides because "needs staging" looks at both sides of the chunk.
    Round round;
    int64_t staged_bytes = 0;
    for (Chunk& c : chunks) {
      const bool needs = !SrcContiguous(c.box) || !DstContiguous(c.box);
      const int64_t n = (c.box.bytes() + kStageAlign - 1) / kStageAlign * kStageAlign;
      if (static_cast<int>(round.chunks.size()) == kMaxCallsPerGroup || (needs && staged_bytes + n > kStagingBytes)) {
        b->rounds.push_back(std::move(round));
        round = Round();
        staged_bytes = 0;
      }
      if (needs) {
        c.stage_off = staged_bytes;
        staged_bytes += n;
      }
      round.chunks.push_back(std::move(c));
    }
    if (!round.chunks.empty()) b->rounds.push_back(std::move(round));
    regions_.Pin(b->regions);
    b->id = next_id_++;
    b->peer = peer;
    stats_.batches_posted++;
    batches_.Add(b);
    peer->by_tag[b->tag] = b;
    peer->queue.push_back(b);
    cv_.SignalAll();
    return BatchId{b->id};
  }

  absl::StatusOr<BatchState> Poll(BatchId id) override {
    absl::MutexLock l(&mu_);
    return batches_.Poll(id, [](const NcclBatch* b) { return b->finished; });
  }

  absl::Status Wait(BatchId id, absl::Time deadline) override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(std::shared_ptr<NcclBatch> b, batches_.Find(id));
    while (!b->finished) {
      if (cv_.WaitWithDeadline(&mu_, deadline) && !b->finished) {
        b->deadline_hit = true;
        if (b->peer->cancel.ok()) {
          b->peer->cancel = absl::DeadlineExceededError(absl::StrCat(
              "nccl batch ", b->tag, " with peer ", b->peer->instance, " (", b->bytes,
              " bytes) missed its deadline; communicator aborted"));
        }
        cv_.SignalAll();
        // The worker notices within ~1 ms, aborts the communicator and finishes every queued
        // batch; bounded all the same (a hung abort or copy must not hang Wait forever).
        const absl::Time give_up = absl::Now() + kAbortGrace;
        while (!b->finished && !cv_.WaitWithDeadline(&mu_, give_up)) {
        }
        if (!b->finished) {
          // The worker is stuck (in ncclCommAbort or a CUDA call): the batch stays queued and its
          // regions stay pinned (Release refuses them) since NCCL may still write them.
          batches_.Retire(id.id);
          stats_.batches_failed++;
          return absl::DeadlineExceededError(absl::StrCat(
              "nccl batch ", b->tag, " with peer ", b->peer->instance, " missed its deadline and the worker did not "
              "finish aborting within ", absl::FormatDuration(kAbortGrace), "; its regions stay pinned"));
        }
      }
    }
    regions_.Unpin(b->regions);
    if (auto t = b->peer->by_tag.find(b->tag); t != b->peer->by_tag.end() && t->second == b) b->peer->by_tag.erase(t);
    batches_.Retire(id.id);
    absl::Status result = b->status;
    if (b->deadline_hit && !result.ok() && result.code() != absl::StatusCode::kDeadlineExceeded) {
      result = absl::DeadlineExceededError(absl::StrCat("nccl batch ", b->tag, " missed its deadline (",
                                                        result.message(), ")"));
    }
    if (result.ok()) {
      stats_.bytes_copied += b->bytes;
    } else {
      stats_.batches_failed++;
    }
    return result;
  }

  TransportStats stats() const override {
    absl::MutexLock l(&mu_);
    return stats_;
  }

 private:
  absl::Status CreateComm(NcclPeer* p, const ncclUniqueId& uid, int rank, absl::Time deadline, absl::string_view round) {
    const std::string what = absl::StrCat("nccl Connect to ", p->instance, " (rank ", rank, ", GPU ", device_, ")");
    // CancelRound ends the init between polls (the caller aborts the half-made communicator).
    auto cancelled = [&]() -> absl::Status {
      absl::MutexLock l(&mu_);
      return cancelled_.Has(round) ? CancelledRounds::Error(kKind, p->instance, round) : absl::OkStatus();
    };
    RETURN_IF_ERROR(nccl_internal::InitComm(device_, 2, rank, uid, deadline, what, &p->comm, cancelled));
    WB_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking),
                            absl::StrCat(what, ": cudaStreamCreateWithFlags"));
    WB_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&p->event, cudaEventDisableTiming),
                            absl::StrCat(what, ": cudaEventCreateWithFlags"));
    void* host = nullptr;
    WB_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host, 4 * sizeof(uint64_t)), absl::StrCat(what, ": cudaMallocHost"));
    p->host = static_cast<uint64_t*>(host);
    void* dev = nullptr;
    WB_CUDA_RETURN_IF_ERROR(cudaMalloc(&dev, 32), absl::StrCat(what, ": cudaMalloc"));
    p->dev = static_cast<char*>(dev);
    return absl::OkStatus();
  }

  // Aborts the communicator (if any) and frees the peer's CUDA resources. Only when no worker runs.
  void FreePeerResources(NcclPeer* p) {
    (void)cudaSetDevice(device_);
    if (p->comm != nullptr) {
      (void)ncclCommAbort(p->comm);
      p->comm = nullptr;
    }
    if (p->stream != nullptr) {
      // Aborting the communicator ended its kernels; the rest of the stream is our own short
      // copies. Poll (bounded) rather than cudaStreamSynchronize: if the stream does not drain,
      // leak the buffers it may still use instead of freeing them under it (cudaFree would also
      // block on the device).
      const absl::Time until = absl::Now() + kAbortGrace;
      absl::Duration backoff = absl::Microseconds(20);
      cudaError_t q = cudaStreamQuery(p->stream);
      while (q == cudaErrorNotReady && absl::Now() < until) {
        absl::SleepFor(backoff);
        backoff = std::min(backoff * 2, absl::Milliseconds(5));
        q = cudaStreamQuery(p->stream);
      }
      (void)cudaStreamDestroy(p->stream);  // returns at once; released when its work is done
      p->stream = nullptr;
      if (q == cudaErrorNotReady) {
        p->event = nullptr;  // leaked on purpose (see above)
        p->host = nullptr;
        p->dev = nullptr;
        p->staging = nullptr;
      }
    }
    if (p->event != nullptr) (void)cudaEventDestroy(p->event);
    if (p->host != nullptr) (void)cudaFreeHost(p->host);
    if (p->dev != nullptr) (void)cudaFree(p->dev);
    if (p->staging != nullptr) (void)cudaFree(p->staging);
    p->event = nullptr;
    p->host = nullptr;
    p->dev = nullptr;
    p->staging = nullptr;
    (void)cudaGetLastError();
  }

  void Teardown(const std::shared_ptr<NcclPeer>& p, absl::Status why) {
    ScopedCudaDevice keep_device;
    {
      absl::MutexLock l(&mu_);
      p->stop = true;
      if (p->cancel.ok()) p->cancel = why;
      cv_.SignalAll();
    }
    if (p->worker.joinable()) p->worker.join();
    FreePeerResources(p.get());
    absl::MutexLock l(&mu_);
    for (auto& b : p->queue) {  // the worker drains the queue before exiting; this is a safety net
      if (!b->finished) {
        b->status = why;
        b->finished = true;
      }
    }
    p->queue.clear();
    cv_.SignalAll();
  }

  // Polls until `event` (if set) has completed, or, without an event, until the communicator has
  // no operation in progress; fails on an NCCL async error, a cancel (deadline / disconnect) or a
  // vanished peer process.
  absl::Status Await(NcclPeer* p, cudaEvent_t event, uint64_t tag, const char* phase) {
    return nccl_internal::Await(p->comm, event, BatchWhat(p, tag, phase), Interruption(p, tag, phase));
  }

  // ncclGroupEnd on a non-blocking communicator may return ncclInProgress: the operations are only
  // enqueued on the stream once the communicator's state leaves ncclInProgress.
  absl::Status GroupEnd(NcclPeer* p, uint64_t tag, const char* phase) {
    return nccl_internal::GroupEnd(p->comm, BatchWhat(p, tag, phase), Interruption(p, tag, phase));
  }

  static std::string BatchWhat(const NcclPeer* p, uint64_t tag, const char* phase) {
    return absl::StrCat("nccl batch ", tag, " with peer ", p->instance, " (", phase, ")");
  }

  // The checks between polls: a cancel (Wait's deadline, Disconnect) and, every kLivenessEvery, the
  // peer process when it is on this node and pid namespace.
  std::function<absl::Status()> Interruption(NcclPeer* p, uint64_t tag, const char* phase) {
    return [this, p, tag, phase, next_liveness = absl::Now() + kLivenessEvery]() mutable -> absl::Status {
      {
        absl::MutexLock l(&mu_);
        if (!p->cancel.ok()) return p->cancel;
      }
      const absl::Time now = absl::Now();
      if (p->same_pidns && now >= next_liveness) {
        next_liveness = now + kLivenessEvery;
        if (kill(p->pid, 0) != 0 && errno == ESRCH) {
          return absl::UnavailableError(absl::StrCat("nccl peer ", p->instance, " (pid ", p->pid,
                                                     ") vanished during batch ", tag, " (", phase, ")"));
        }
      }
      return absl::OkStatus();
    };
  }

  absl::Status P2P(NcclPeer* p, bool send, void* ptr, int64_t n, uint64_t tag) {
    return nccl_internal::P2P(p->comm, send, ptr, n, p->remote_rank, p->stream, absl::StrCat("nccl batch ", tag));
  }

  // *mirror_mismatch is set when the batch failed only because the peer's mirror differs.
  absl::Status RunBatch(NcclPeer* p, NcclBatch* b, bool* mirror_mismatch) {
    // 1. Mirror check.
    p->host[0] = b->manifest;
    p->host[1] = b->tag;
    p->host[2] = p->host[3] = 0;
    WB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p->dev, p->host, 16, cudaMemcpyHostToDevice, p->stream),
                            "nccl manifest H2D");
    (void)ncclGroupStart();
    absl::Status s = P2P(p, true, p->dev, 16, b->tag);
    if (s.ok()) s = P2P(p, false, p->dev + 16, 16, b->tag);
    absl::Status end = GroupEnd(p, b->tag, "manifest exchange");
    if (!s.ok()) return s;
    if (!end.ok()) return end;
    WB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p->host + 2, p->dev + 16, 16, cudaMemcpyDeviceToHost, p->stream),
                            "nccl manifest D2H");
    WB_CUDA_RETURN_IF_ERROR(cudaEventRecord(p->event, p->stream), "nccl cudaEventRecord");
    if (absl::Status w = Await(p, p->event, b->tag, "manifest exchange"); !w.ok()) return w;
    if (p->host[2] != b->manifest || p->host[3] != b->tag) {
      *mirror_mismatch = true;
      return absl::InvalidArgumentError(absl::StrCat(
          "nccl batch ", b->tag, ": the peer ", p->instance, " posted a different mirror batch (tag ", p->host[3],
          "; ops, regions, offsets or strides differ, or batches were posted in a different order)"));
    }
    // 2. Data, round by round; staging is reused across rounds safely because everything is on
    // one stream (the unpack of round r precedes the pack of round r + 1).
    for (const Round& round : b->rounds) {
      bool needs_staging = false;
      for (const Chunk& c : round.chunks) needs_staging |= c.staged;
      if (needs_staging && p->staging == nullptr) {
        void* st = nullptr;
        WB_CUDA_RETURN_IF_ERROR(cudaMalloc(&st, kStagingBytes), "nccl: cudaMalloc of the staging buffer");
        p->staging = static_cast<char*>(st);
      }
      for (const Chunk& c : round.chunks) {
        if (!c.staged || !c.send) continue;
        RETURN_IF_ERROR(EnqueueBoxCopy(p->staging + c.stage_off, b->local_base[c.op] + c.local_off,
                                        WithDenseSide(c.box, /*dense_dst=*/true), p->stream));
      }
      (void)ncclGroupStart();
      absl::Status calls;
      for (const Chunk& c : round.chunks) {
        char* ptr = c.staged ? p->staging + c.stage_off : b->local_base[c.op] + c.local_off;
        calls = P2P(p, c.send, ptr, c.box.bytes(), b->tag);
        if (!calls.ok()) break;
      }
      absl::Status ended = GroupEnd(p, b->tag, "data");
      if (!calls.ok()) return calls;
      if (!ended.ok()) return ended;
      for (const Chunk& c : round.chunks) {
        if (!c.staged || c.send) continue;
        RETURN_IF_ERROR(EnqueueBoxCopy(b->local_base[c.op] + c.local_off, p->staging + c.stage_off,
                                        WithDenseSide(c.box, /*dense_dst=*/false), p->stream));
      }
    }
    WB_CUDA_RETURN_IF_ERROR(cudaEventRecord(p->event, p->stream), "nccl cudaEventRecord");
    return Await(p, p->event, b->tag, "data");
  }

  void WorkerLoop(std::shared_ptr<NcclPeer> p) {
    (void)cudaSetDevice(device_);
    absl::MutexLock l(&mu_);
    while (true) {
      while (!p->stop && p->queue.empty()) cv_.Wait(&mu_);
      if (p->queue.empty()) return;  // stopping and drained
      std::shared_ptr<NcclBatch> b = p->queue.front();
      absl::Status s;
      bool mirror_mismatch = false;
      if (p->broken) {
        s = absl::UnavailableError(absl::StrCat("nccl peer ", p->instance, " is unusable until reconnected: ",
                                                p->broken_status.message()));
      } else if (!p->cancel.ok()) {
        s = p->cancel;
      } else {
        mu_.Unlock();
        s = RunBatch(p.get(), b.get(), &mirror_mismatch);
        mu_.Lock();
      }
      // A mirror mismatch leaves both sides in step (each saw the same pair of manifests and
      // posted nothing more); anything else may leave NCCL operations half done: abort.
      if (!s.ok() && !mirror_mismatch && !p->broken) {
        p->broken = true;
        p->broken_status = s;
        mu_.Unlock();
        (void)ncclCommAbort(p->comm);  // bounded: it exists to stop hung operations
        mu_.Lock();
        p->comm = nullptr;
      }
      b->status = s;
      b->finished = true;
      p->queue.pop_front();
      cv_.SignalAll();
    }
  }

  const int device_;
  const std::string node_id_;
  const std::string instance_id_;
  const std::string pidns_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  RegionRegistry<Region> regions_ ABSL_GUARDED_BY(mu_){kKind};
  std::map<uint64_t, std::shared_ptr<NcclPeer>> peers_ ABSL_GUARDED_BY(mu_);
  BatchTable<NcclBatch> batches_ ABSL_GUARDED_BY(mu_){kKind};
  std::map<std::string, ncclUniqueId, std::less<>> pending_uids_ ABSL_GUARDED_BY(mu_);  // peer instance -> our id
  CancelledRounds cancelled_ ABSL_GUARDED_BY(mu_);
  TransportStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportConfig& config) {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
    absl::Status s = CudaStatus(e == cudaSuccess ? cudaErrorNoDevice : e, "nccl: cudaGetDeviceCount");
    return absl::FailedPreconditionError(s.message());
  }
  if (config.nccl.device < 0 || config.nccl.device >= n) {
    return absl::InvalidArgumentError(absl::StrCat("nccl.device ", config.nccl.device, " is not a visible GPU (",
                                                   n, " visible)"));
  }
  return std::unique_ptr<Transport>(new NcclTransport(config));
}

}  // namespace wb::transport
