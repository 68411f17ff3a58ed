#include "transport/host_shm/host_shm.h"

#include <pthread.h>
#include <unistd.h>
#include <xxhash.h>
#if defined(__x86_64__)
// XXH3 with the widest vector unit of this CPU (AVX2 / AVX-512 instead of the library's SSE2
// default): same hashes, about twice as fast (~8 vs ~4 GB/s per core on cold data). The macros of
// this header route XXH3_64bits* to libxxhash's *_dispatch entry points.
#include <xxh_x86dispatch.h>
#endif

#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "base/stream_copy.h"
#include "transport/common.h"
#include "transport/cpu_affinity.h"
#include "transport/registry.h"
#include "base/shm_segment.h"
#include "transport/strided.h"
#include "base/wire.h"

namespace wb::transport {
namespace {

constexpr char kKind[] = "host_shm";
// Pieces at least this long are copied with cache-bypassing stores when no checksum reads them back
// (measured: bench:e2e full versions about 3% faster on the CI VM).
constexpr int64_t kStreamCopyPiece = int64_t{256} << 10;

struct Region : RegionRecord {
  // Local regions: backing segment name/offset (for export). Imports: our mapping.
  std::string shared_name;
  int64_t shared_offset = 0;
  std::shared_ptr<ShmSegment> mapping;
};

// A unit of work: ops [op_first, op_last) entirely, or, when `end >= 0`, logical range
// [begin, end) of the single op op_first.
struct Task {
  int op_first = 0;
  int op_last = 0;
  int64_t begin = 0;
  int64_t end = -1;
};

struct BatchRun {
  uint64_t id = 0;
  uint64_t tag = 0;
  bool checksum = false;
  std::vector<OpLayout> layouts;
  std::vector<char*> src_base;
  std::vector<char*> dst_base;
  std::vector<uint64_t> regions;  // pinned region ids
  std::vector<Task> tasks;
  size_t next = 0;        // next task to hand out
  size_t finished = 0;    // tasks completed or skipped
  int active = 0;         // tasks running right now
  bool cancelled = false;
  bool corrupt_once = false;
  absl::Status status;
  int64_t bytes = 0;
  bool Done() const { return finished == tasks.size() && active == 0; }
};

class HostShmTransport : public Transport {
 public:
  explicit HostShmTransport(const TransportConfig& config)
      : options_(config.host_shm),
        node_id_(config.node_id.empty() ? DefaultNodeId() : config.node_id),
        instance_id_(RandomInstanceId()),
        corrupt_(config.test_corrupt_checksummed_payload) {
    int n = options_.threads < 1 ? 1 : options_.threads;
    for (int i = 0; i < n; ++i) {
      workers_.emplace_back([this] { WorkerLoop(); });
      pthread_setname_np(workers_.back().native_handle(), "wb-shm-copy");
      // TransportConfig::cpus was validated by the factory (CreateTransport); a cpuset shrunk
      // since then can only leave a thread floating, never lose a copy.
      (void)PinThread(workers_.back(), config.cpus);
    }
  }

  ~HostShmTransport() override {
    {
      absl::MutexLock l(&mu_);
      for (auto& [id, b] : batches_.all()) CancelLocked(b.get(), absl::CancelledError("transport destroyed"));
      stopping_ = true;
    }
    for (auto& t : workers_) t.join();
  }

  Capabilities capabilities() const override {
    Capabilities c;
    c.kind = kKind;
    c.memory_kinds = {MemoryKind::kHost};
    c.same_node = true;
    c.cross_node = false;
    c.two_sided = false;
    c.checksums = true;
    c.native_strides = true;
    return c;
  }

  std::string instance_id() const override { return instance_id_; }

  absl::StatusOr<std::string> ExportEndpoint(absl::string_view) override {
    wire::Writer w = RecordWriter(RecordType::kEndpoint, kKind, instance_id_, node_id_);
    return std::move(w.out());
  }

  using Transport::Connect;
  // One-sided: nothing is dialled, so there is nothing a round could tell apart (transport.h);
  // only a cancelled round is refused (CancelRound).
  absl::StatusOr<PeerId> Connect(absl::string_view endpoint, absl::string_view round, absl::Time) override {
    wire::Reader r(endpoint);
    uint32_t magic = r.U32();
    uint8_t type = r.U8();
    std::string kind = r.Str(), inst = r.Str(), node = r.Str();
    if (!r.done() || magic != kWireMagic || type != static_cast<uint8_t>(RecordType::kEndpoint) || kind != kKind) {
      return absl::InvalidArgumentError("host_shm Connect: bytes are not a host_shm endpoint");
    }
    if (node != node_id_) {
      return absl::InvalidArgumentError(absl::StrCat("host_shm Connect: peer ", inst, " is on node '", node,
                                                     "', this is node '", node_id_, "' (same-node transport)"));
    }
    absl::MutexLock l(&mu_);
    if (cancelled_.Has(round)) return CancelledRounds::Error(kKind, inst, round);
    if (PeerId known = peers_.Find(inst); known != kNoPeer) return known;
    uint64_t id = next_id_++;
    peers_.Add(id, inst);
    return PeerId{id};
  }

  // A Connect here never waits: cancelling only makes later Connects of the round fail.
  absl::Status CancelRound(absl::string_view round) override {
    if (absl::Status s = CancelledRounds::Check(kKind, round); !s.ok()) return s;
    absl::MutexLock l(&mu_);
    cancelled_.Add(round);
    return absl::OkStatus();
  }

  absl::Status Disconnect(PeerId peer) override {
    absl::MutexLock l(&mu_);
    return peers_.Remove(peer);
  }

  absl::StatusOr<RegionHandle> RegisterMemory(const MemorySpec& spec) override {
    if (spec.kind != MemoryKind::kHost) {
      return absl::InvalidArgumentError(absl::StrCat("host_shm cannot reach ", MemoryKindName(spec.kind),
                                                     " memory (region '", spec.label, "')"));
    }
    if (spec.size_bytes < 0 || (spec.base == nullptr && spec.size_bytes > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("host_shm: bad region '", spec.label, "' (base ",
                                                     spec.base == nullptr ? "null" : "set", ", size ", spec.size_bytes, ")"));
    }
    if (!spec.shared_name.empty()) {
      if (absl::Status s = ShmSegment::ValidateName(spec.shared_name); !s.ok()) return s;
      if (spec.shared_offset < 0) return absl::InvalidArgumentError("host_shm: negative shared_offset");
    }
    Region r;
    r.local = true;
    r.base = static_cast<char*>(spec.base);
    r.size = spec.size_bytes;
    r.label = spec.label;
    r.owner_instance = instance_id_;
    r.shared_name = spec.shared_name;
    r.shared_offset = spec.shared_offset;
    absl::MutexLock l(&mu_);
    uint64_t id = next_id_++;
    r.owner_region_id = id;
    regions_.Add(id, std::move(r));
    return RegionHandle{id};
  }

  absl::StatusOr<std::string> ExportDescriptor(RegionHandle h) override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(const Region* found, regions_.Find(h));
    const Region& r = *found;
    if (!r.local) return absl::FailedPreconditionError("host_shm: cannot re-export an imported region");
    if (r.shared_name.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("host_shm: region '", r.label,
                                                        "' is not backed by a named shm segment; cannot export"));
    }
    wire::Writer w = RecordWriter(RecordType::kDescriptor, kKind, instance_id_, node_id_);
    w.U64(h.id);
    w.I64(r.size);
    w.Str(r.shared_name);
    w.I64(r.shared_offset);
    w.Str(r.label);
    return std::move(w.out());
  }

  absl::StatusOr<RegionHandle> ImportDescriptor(absl::string_view bytes) override {
    wire::Reader rd(bytes);
    uint32_t magic = rd.U32();
    uint8_t type = rd.U8();
    std::string kind = rd.Str(), inst = rd.Str(), node = rd.Str();
    uint64_t rid = rd.U64();
    int64_t size = rd.I64();
    std::string name = rd.Str();
    int64_t offset = rd.I64();
    std::string label = rd.Str();
    if (!rd.done() || magic != kWireMagic || type != static_cast<uint8_t>(RecordType::kDescriptor)) {
      return absl::InvalidArgumentError("host_shm ImportDescriptor: bytes are not a transport descriptor");
    }
    if (kind != kKind) {
      return absl::InvalidArgumentError(absl::StrCat("host_shm ImportDescriptor: descriptor is for transport '",
                                                     kind, "'"));
    }
    if (node != node_id_) {
      return absl::InvalidArgumentError(absl::StrCat("host_shm ImportDescriptor: region '", label, "' of ", inst,
                                                     " lives on node '", node, "', this is node '", node_id_, "'"));
    }
    if (size < 0 || offset < 0) return absl::InvalidArgumentError("host_shm ImportDescriptor: negative size/offset");
    auto seg = ShmSegment::Open(name);
    if (!seg.ok()) {
      return absl::Status(seg.status().code() == absl::StatusCode::kNotFound ? absl::StatusCode::kInvalidArgument
                                                                            : seg.status().code(),
                          absl::StrCat("host_shm import of region '", label, "': ", seg.status().message()));
    }
    if (getuid() != 0) {
      if (absl::Status s = seg->CheckOwner(getuid()); !s.ok()) return s;
    }
    // Written so that it cannot overflow: offset and size come from the peer (found by fuzz_transport_wire).
    if (offset > seg->size() || size > seg->size() - offset) {
      return absl::InvalidArgumentError(absl::StrCat("host_shm import of region '", label, "': ", size,
                                                     " bytes at offset ", offset, " exceed segment '", name, "' of ",
                                                     seg->size(), " bytes"));
    }
    Region r;
    r.local = false;
    r.mapping = std::make_shared<ShmSegment>(std::move(*seg));
    r.base = static_cast<char*>(r.mapping->data()) + offset;
    r.size = size;
    r.label = label;
    r.owner_instance = inst;
    r.owner_region_id = rid;
    absl::MutexLock l(&mu_);
    uint64_t id = next_id_++;
    regions_.Add(id, std::move(r));
    return RegionHandle{id};
  }

  absl::StatusOr<RegionInfo> Describe(RegionHandle h) const override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(const Region* r, regions_.Find(h));
    RegionInfo info = BasicRegionInfo(*r);
    info.kind = MemoryKind::kHost;
    if (!info.local) info.peer = peers_.PeerOf(r->owner_instance);
    return info;
  }

  absl::Status Release(RegionHandle h) override {
    absl::MutexLock l(&mu_);
    return regions_.Release(h);
  }

  absl::StatusOr<BatchId> Post(const Batch& batch) override {
    auto run = std::make_shared<BatchRun>();
    run->tag = batch.tag;
    run->checksum = batch.checksum;
    run->corrupt_once = batch.checksum && corrupt_;
    absl::MutexLock l(&mu_);
    std::string peer_inst;
    if (batch.peer != kNoPeer) {
      const std::string* p = peers_.Instance(batch.peer);
      if (p == nullptr) return absl::InvalidArgumentError(absl::StrCat("host_shm Post: unknown peer ", batch.peer.id));
      peer_inst = *p;
    }
    const std::string prefix = absl::StrCat("batch ", batch.tag);
    auto lookup = [&](const RegionHandle& h, int i, const char* which) -> absl::StatusOr<Region*> {
      ASSIGN_OR_RETURN(Region* r, regions_.FindForOp(h, prefix, i, which));
      if (!r->local && r->owner_instance != peer_inst) {
        return absl::InvalidArgumentError(absl::StrCat("batch ", batch.tag, " op ", i, ": ", which, " region '",
                                                       r->label, "' was exported by ", r->owner_instance,
                                                       ", not by the batch's peer ",
                                                       peer_inst.empty() ? "(none)" : peer_inst));
      }
      return r;
    };
    run->layouts.reserve(batch.ops.size());
    for (size_t i = 0; i < batch.ops.size(); ++i) {
      const CopyOp& op = batch.ops[i];
      auto src = lookup(op.src.region, i, "source");
      if (!src.ok()) return src.status();
      auto dst = lookup(op.dst.region, i, "destination");
      if (!dst.ok()) return dst.status();
      auto layout = ValidateOp(op, static_cast<int>(i), (*src)->size, (*dst)->size, (*src)->label, (*dst)->label);
      if (!layout.ok()) return layout.status();
      run->layouts.push_back(std::move(*layout));
      run->src_base.push_back((*src)->base);
      run->dst_base.push_back((*dst)->base);
      run->regions.push_back(op.src.region.id);
      run->regions.push_back(op.dst.region.id);
    }
    // Everything is valid: cut into tasks and pin the regions.
    const int64_t split = std::max<int64_t>(options_.split_bytes, 4096);
    Task small;
    int64_t small_bytes = 0;
    auto flush_small = [&] {
      if (small.op_last > small.op_first) run->tasks.push_back(small);
      small = Task();
      small_bytes = 0;
    };
    for (size_t i = 0; i < run->layouts.size(); ++i) {
      const int64_t n = run->layouts[i].src.total_bytes();
      run->bytes += n;
      if (n == 0) continue;
      if (n > split) {
        flush_small();
        const int64_t pieces = (n + split - 1) / split;
        const int64_t step = (n + pieces - 1) / pieces;
        for (int64_t b = 0; b < n; b += step) {
          run->tasks.push_back(Task{static_cast<int>(i), static_cast<int>(i) + 1, b, std::min(n, b + step)});
        }
        continue;
      }
      if (small.op_last == small.op_first) small.op_first = small.op_last = static_cast<int>(i);
      if (small.op_last != static_cast<int>(i)) {  // ops skipped (zero-length) in between: fine, they move nothing
        small.op_last = static_cast<int>(i);
      }
      small.op_last = static_cast<int>(i) + 1;
      small_bytes += n;
      if (small_bytes >= split) flush_small();
    }
    flush_small();
    regions_.Pin(run->regions);
    run->id = next_id_++;
    stats_.batches_posted++;
    batches_.Add(run);
    if (!run->tasks.empty()) {
      queue_.push_back(run);
    }
    return BatchId{run->id};
  }

  absl::StatusOr<BatchState> Poll(BatchId id) override {
    absl::MutexLock l(&mu_);
    return batches_.Poll(id, [](const BatchRun* b) { return b->Done(); });
  }

  absl::Status Wait(BatchId id, absl::Time deadline) override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(std::shared_ptr<BatchRun> b, batches_.Find(id));
    while (!b->Done()) {
      if (done_cv_.WaitWithDeadline(&mu_, deadline) && !b->Done()) {
        CancelLocked(b.get(), absl::DeadlineExceededError(absl::StrCat("host_shm batch ", b->tag, " (", b->bytes,
                                                                       " bytes) missed its deadline")));
        // In-flight tasks finish their current piece (<= split_bytes); bounded.
        while (!b->Done()) done_cv_.Wait(&mu_);
      }
    }
    regions_.Unpin(b->regions);
    batches_.Retire(id.id);
    if (!b->status.ok()) stats_.batches_failed++;
    return b->status;
  }

  TransportStats stats() const override {
    absl::MutexLock l(&mu_);
    return stats_;
  }

 private:
  void CancelLocked(BatchRun* b, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (b->status.ok()) b->status = std::move(why);
    b->cancelled = true;
    b->finished += b->tasks.size() - b->next;
    b->next = b->tasks.size();
    for (auto q = queue_.begin(); q != queue_.end(); ++q) {
      if (q->get() == b) {
        queue_.erase(q);
        break;
      }
    }
    done_cv_.SignalAll();
  }

  // Copies one task; returns DATA_LOSS on checksum mismatch.
  absl::Status RunTask(BatchRun* b, const Task& t, bool corrupt) {
    for (int i = t.op_first; i < t.op_last; ++i) {
      const OpLayout& op = b->layouts[i];
      const int64_t begin = t.end >= 0 ? t.begin : 0;
      const int64_t end = t.end >= 0 ? t.end : op.src.total_bytes();
      if (begin >= end) continue;
      const char* src = b->src_base[i];
      char* dst = b->dst_base[i];
      if (!b->checksum) {
        // Nothing here reads the destination again (a worker's staging or live memory, read by the
        // engine or hashed much later): large pieces bypass the cache (base/stream_copy.h), fenced
        // before the task is reported done.
        ForEachCopyPiece(op, begin, end, [&](int64_t s, int64_t d, int64_t n) {
          if (n >= kStreamCopyPiece) {
            StreamCopy(dst + d, src + s, static_cast<size_t>(n));
          } else {
            std::memcpy(dst + d, src + s, n);
          }
        });
        StreamFence();
        continue;
      }
      ForEachCopyPiece(op, begin, end, [&](int64_t s, int64_t d, int64_t n) { std::memcpy(dst + d, src + s, n); });
      if (corrupt) {
        int64_t first = -1;
        op.dst.ForEachPiece(begin, begin + 1, [&](int64_t d, int64_t, int64_t) { first = d; });
        dst[first] ^= 0x5a;
        corrupt = false;
      }
      XXH3_state_t* hs = XXH3_createState();
      XXH3_state_t* hd = XXH3_createState();
      XXH3_64bits_reset(hs);
      XXH3_64bits_reset(hd);
      op.src.ForEachPiece(begin, end, [&](int64_t s, int64_t, int64_t n) { XXH3_64bits_update(hs, src + s, n); });
      op.dst.ForEachPiece(begin, end, [&](int64_t d, int64_t, int64_t n) { XXH3_64bits_update(hd, dst + d, n); });
      const bool same = XXH3_64bits_digest(hs) == XXH3_64bits_digest(hd);
      XXH3_freeState(hs);
      XXH3_freeState(hd);
      if (!same) {
        return absl::DataLossError(absl::StrCat("host_shm batch ", b->tag, " op ", i, ": checksum mismatch in bytes [",
                                                begin, ", ", end, ") after copy"));
      }
    }
    return absl::OkStatus();
  }

  void WorkerLoop() {
    absl::MutexLock l(&mu_);
    while (true) {
      mu_.Await(absl::Condition(
          +[](HostShmTransport* t) ABSL_NO_THREAD_SAFETY_ANALYSIS { return t->stopping_ || !t->queue_.empty(); }, this));
      if (queue_.empty()) return;  // stopping and drained
      std::shared_ptr<BatchRun> b = queue_.front();
      const Task task = b->tasks[b->next++];
      if (b->next == b->tasks.size()) queue_.pop_front();
      b->active++;
      bool corrupt = b->corrupt_once;
      b->corrupt_once = false;
      mu_.Unlock();
      absl::Status s = RunTask(b.get(), task, corrupt);
      int64_t moved = 0;
      if (task.end >= 0) {
        moved = task.end - task.begin;
      } else {
        for (int i = task.op_first; i < task.op_last; ++i) moved += b->layouts[i].src.total_bytes();
      }
      mu_.Lock();
      b->active--;
      b->finished++;
      stats_.bytes_copied += moved;
      if (!s.ok()) CancelLocked(b.get(), s);
      if (b->Done()) done_cv_.SignalAll();
    }
  }

  const HostShmOptions options_;
  const std::string node_id_;
  const std::string instance_id_;
  const bool corrupt_;

  mutable absl::Mutex mu_;
  absl::CondVar done_cv_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  RegionRegistry<Region> regions_ ABSL_GUARDED_BY(mu_){kKind};
  PeerInstances peers_ ABSL_GUARDED_BY(mu_){kKind};
  CancelledRounds cancelled_ ABSL_GUARDED_BY(mu_);
  BatchTable<BatchRun> batches_ ABSL_GUARDED_BY(mu_){kKind};
  std::deque<std::shared_ptr<BatchRun>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  TransportStats stats_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Transport> NewHostShmTransport(const TransportConfig& config) {
  return std::make_unique<HostShmTransport>(config);
}

}  // namespace wb::transport
