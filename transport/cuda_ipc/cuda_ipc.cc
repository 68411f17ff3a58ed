#include "transport/cuda_ipc/cuda_ipc.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "transport/common.h"
#include "transport/cuda_ipc/cuda_copy.h"
#include "transport/cuda_ipc/cuda_status.h"
#include "transport/cuda_ipc/cuda_vmm.h"
#include "transport/registry.h"
#include "transport/strided.h"
#include "base/wire.h"

namespace wb::transport {
namespace {

constexpr char kKind[] = "cuda_ipc";
constexpr size_t kHandleBytes = sizeof(cudaIpcMemHandle_t);
static_assert(kHandleBytes == 64, "cudaIpcMemHandle_t is 64 bytes");
constexpr size_t kUuidBytes = sizeof(cudaUUID_t);
static_assert(kUuidBytes == 16, "cudaUUID_t is 16 bytes");
// How long Wait (after its deadline) and the destructor let already-enqueued copies drain.
constexpr absl::Duration kDrainGrace = absl::Seconds(10);

// cuMemGetAddressRange through the runtime's driver entry point (no -lcuda at link time).
using GetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

GetAddressRangeFn LoadGetAddressRange() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<GetAddressRangeFn>(fn);
}

// The descriptor's kind-specific fields, after the common header (see EncodeDescriptor).
struct Desc {
  std::string inst, node, label;
  uint64_t region_id = 0;
  int64_t size = 0;
  std::string handle;  // kHandleBytes
  int64_t alloc_offset = 0;
  uint32_t device = 0;
  std::string uuid;  // kUuidBytes or empty
  // VMM variant (RawCudaVmmBuffer; `handle` empty): an optional trailer after uuid.
  bool vmm = false;
  uint32_t vmm_pid = 0;  // the process in which the parts' fds are descriptors
  struct VmmPart {
    int32_t fd = -1;
    std::string key;
    int64_t bytes = 0;
  };
  std::vector<VmmPart> vmm_parts;  // the allocations, mapped back to back in this order
  int64_t vmm_total = 0;           // sum of their bytes (no overflow: checked when built)
};
constexpr uint8_t kVmmTrailer = 1;

std::string EncodeDescriptor(const Desc& d) {
  wire::Writer w = RecordWriter(RecordType::kDescriptor, kKind, d.inst, d.node);
  w.U64(d.region_id);
  w.I64(d.size);
  w.Str(d.label);
  w.Str(d.handle);
  w.I64(d.alloc_offset);
  w.U32(d.device);
  w.Str(d.uuid);
  if (d.vmm) {
    w.U8(kVmmTrailer);
    w.U32(d.vmm_pid);
    w.U32(static_cast<uint32_t>(d.vmm_parts.size()));
    for (const Desc::VmmPart& p : d.vmm_parts) {
      w.U32(static_cast<uint32_t>(p.fd));
      w.Str(p.key);
      w.I64(p.bytes);
    }
  }
  return std::move(w.out());
}

absl::StatusOr<Desc> DecodeDescriptor(absl::string_view bytes) {
  wire::Reader r(bytes);
  const uint32_t magic = r.U32();
  const uint8_t type = r.U8();
  std::string kind = r.Str();
  Desc d;
  d.inst = r.Str();
  d.node = r.Str();
  d.region_id = r.U64();
  d.size = r.I64();
  d.label = r.Str();
  d.handle = r.Str(kHandleBytes);
  d.alloc_offset = r.I64();
  d.device = r.U32();
  d.uuid = r.Str(kUuidBytes);
  if (r.ok() && !r.done()) {
    d.vmm = r.U8() == kVmmTrailer;
    d.vmm_pid = r.U32();
    const uint32_t n = r.U32();
    bool parts_ok = n >= 1 && n <= kMaxCudaVmmAllocationsPerBuffer;
    for (uint32_t i = 0; parts_ok && i < n && r.ok(); ++i) {
      Desc::VmmPart p;
      p.fd = static_cast<int32_t>(r.U32());
      p.key = r.Str(1024);
      p.bytes = r.I64();
      parts_ok = p.fd >= 0 && !p.key.empty() && p.bytes > 0 && d.vmm_total <= INT64_MAX - p.bytes;
      if (parts_ok) d.vmm_total += p.bytes;
      d.vmm_parts.push_back(std::move(p));
    }
    if (!parts_ok) d.vmm_parts.clear();  // malformed, refused below
  }
  if (!r.ok() || magic != kWireMagic || type != static_cast<uint8_t>(RecordType::kDescriptor)) {
    return absl::InvalidArgumentError("cuda_ipc ImportDescriptor: bytes are not a transport descriptor");
  }
  if (kind != kKind) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc ImportDescriptor: descriptor is for transport '", kind, "'"));
  }
  if (!r.done() || (d.vmm ? !d.handle.empty() || d.vmm_parts.empty() : d.handle.size() != kHandleBytes) || (!d.uuid.empty() && d.uuid.size() != kUuidBytes) ||
      d.size < 0 || d.alloc_offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc ImportDescriptor: malformed descriptor of region '",
                                                   d.label, "'"));
  }
  return d;
}

struct Mapping {
  char* base = nullptr;  // what cudaIpcOpenMemHandle returned (the allocation base), or the VMM range
  int64_t alloc_size = -1;  // -1: unknown
  int device = 0;
  int refs = 0;
  // VMM imports: the imported allocation handles, mapped back to back over [base, base + alloc_size)
  // (vmm_sizes[i] bytes each, in order).
  bool vmm = false;
  std::vector<CUmemGenericAllocationHandle> vmm_handles;
  std::vector<int64_t> vmm_sizes;
};

// Undoes a mapping (the last reference is gone, or the transport is destroyed).
absl::Status CloseMapping(const Mapping& m) {
  (void)cudaSetDevice(m.device);
  if (!m.vmm) return CudaStatus(cudaIpcCloseMemHandle(m.base), "cuda_ipc: cudaIpcCloseMemHandle");
  auto api = LoadCudaVmmApi();
  if (!api.ok()) return api.status();
  const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(m.base);
  // Each allocation's mapping on its own (cuMemUnmap takes whole mappings), then the range, then
  // the handles.
  absl::Status s;
  CUdeviceptr at = va;
  for (int64_t bytes : m.vmm_sizes) {
    absl::Status u = CuStatus((*api)->unmap(at, static_cast<size_t>(bytes)), "cuda_ipc: cuMemUnmap");
    if (s.ok()) s = u;
    at += static_cast<CUdeviceptr>(bytes);
  }
  absl::Status f = CuStatus((*api)->address_free(va, static_cast<size_t>(m.alloc_size)), "cuda_ipc: cuMemAddressFree");
  absl::Status r;
  for (CUmemGenericAllocationHandle h : m.vmm_handles) {
    absl::Status x = CuStatus((*api)->release(h), "cuda_ipc: cuMemRelease");
    if (r.ok()) r = x;
  }
  return !s.ok() ? s : !f.ok() ? f : r;
}

// owner_instance empty: a raw worker buffer, treated like a local region.
struct Region : RegionRecord {
  MemoryKind kind = MemoryKind::kCuda;
  int device = -1;  // kCuda: the device the bytes live on (imports: the local ordinal)
  // Local kCuda regions.
  char* alloc_base = nullptr;
  int64_t alloc_size = -1;  // -1: the driver could not tell where the allocation starts
  bool have_handle = false;
  cudaIpcMemHandle_t handle = {};
  // Local kHost regions: pinned by us (undo on Release).
  bool host_registered = false;
  // Imports: key into mappings_.
  std::string mapping_key;
};

struct StreamEvent {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  bool done = false;
};

struct IpcBatch {
  uint64_t id = 0;
  uint64_t tag = 0;
  int64_t bytes = 0;
  std::vector<uint64_t> regions;
  std::vector<StreamEvent> events;
  absl::Status status;  // first error (enqueue, copy, or deadline)
};

class CudaIpcTransport : public Transport {
 public:
  CudaIpcTransport(const TransportConfig& config, std::vector<std::string> uuids)
      : options_(config.cuda_ipc),
        node_id_(config.node_id.empty() ? DefaultNodeId() : config.node_id),
        instance_id_(RandomInstanceId()),
        uuids_(std::move(uuids)),
        get_range_(LoadGetAddressRange()) {}

  ~CudaIpcTransport() override {
    ScopedCudaDevice keep_device;  // the destructor switches devices; the caller's stays current
    absl::MutexLock l(&mu_);
    const absl::Time until = absl::Now() + kDrainGrace;
    bool all_drained = true;
    for (auto& [id, b] : batches_.all()) {
      while (!QueryLocked(b.get()) && absl::Now() < until) {
        mu_.Unlock();
        absl::SleepFor(absl::Microseconds(200));
        mu_.Lock();
      }
      if (QueryLocked(b.get())) {
        DestroyEvents(b.get());
      } else {
        all_drained = false;  // leak: the GPU may still use them
      }
    }
    // Also a batch that Wait gave up on (copies still queued after the grace) left its regions
    // pinned: never unmap or unpin memory a queued copy may still touch. Leaking the mappings is
    // the lesser evil (the process is usually exiting).
    if (!all_drained || gave_up_on_copies_) return;
    for (auto& [id, r] : regions_.all()) {
      if (r.host_registered) {
        (void)cudaHostUnregister(r.base);
        (void)cudaGetLastError();
      }
    }
    for (auto& [key, m] : mappings_) {
      (void)CloseMapping(m);
      (void)cudaGetLastError();
    }
    absl::MutexLock sl(&streams_mu_);
    for (auto& [dev, streams] : streams_) {
      (void)cudaSetDevice(dev);
      for (cudaStream_t s : streams) (void)cudaStreamDestroy(s);
    }
    (void)cudaGetLastError();
  }

  Capabilities capabilities() const override {
    Capabilities c;
    c.kind = kKind;
    c.memory_kinds = {MemoryKind::kCuda, MemoryKind::kHost};
    c.same_node = true;
    c.cross_node = false;
    c.two_sided = false;
    c.checksums = false;
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
    const uint32_t magic = r.U32();
    const uint8_t type = r.U8();
    std::string kind = r.Str(), inst = r.Str(), node = r.Str();
    if (!r.done() || magic != kWireMagic || type != static_cast<uint8_t>(RecordType::kEndpoint) || kind != kKind) {
      return absl::InvalidArgumentError("cuda_ipc Connect: bytes are not a cuda_ipc endpoint");
    }
    if (node != node_id_) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc Connect: peer ", inst, " is on node '", node,
                                                     "', this is node '", node_id_, "' (same-node transport)"));
    }
    absl::MutexLock l(&mu_);
    if (cancelled_.Has(round)) return CancelledRounds::Error(kKind, inst, round);
    if (PeerId known = peers_.Find(inst); known != kNoPeer) return known;
    const uint64_t id = next_id_++;
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
    ScopedCudaDevice keep_device;
    if (spec.size_bytes < 0 || (spec.base == nullptr && spec.size_bytes > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: bad region '", spec.label, "' (base ",
                                                     spec.base == nullptr ? "null" : "set", ", size ", spec.size_bytes,
                                                     ")"));
    }
    Region r;
    r.local = true;
    r.kind = spec.kind;
    r.base = static_cast<char*>(spec.base);
    r.size = spec.size_bytes;
    r.label = spec.label;
    r.owner_instance = instance_id_;
    if (spec.kind == MemoryKind::kCuda && spec.size_bytes > 0) {
      cudaPointerAttributes attr = {};
      if (cudaError_t e = cudaPointerGetAttributes(&attr, spec.base); e != cudaSuccess) {
        return CudaStatus(e, absl::StrCat("cuda_ipc RegisterMemory('", spec.label, "'): cudaPointerGetAttributes"));
      }
      if (attr.type != cudaMemoryTypeDevice) {
        return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: region '", spec.label,
                                                       "' is not CUDA device memory (cudaPointerGetAttributes type ",
                                                       static_cast<int>(attr.type), ")"));
      }
      if (spec.device >= 0 && spec.device != attr.device) {
        return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: region '", spec.label, "' says device ", spec.device,
                                                       " but the pointer belongs to device ", attr.device));
      }
      r.device = attr.device;
      WB_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device), "cuda_ipc RegisterMemory: cudaSetDevice");
      int64_t alloc_size = -1;
      r.alloc_base = AllocationBase(r.base, &alloc_size);
      r.alloc_size = alloc_size;
      if (alloc_size >= 0 && (r.base - r.alloc_base) + r.size > alloc_size) {
        return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: region '", spec.label, "' (", r.size,
                                                       " bytes at offset ", r.base - r.alloc_base,
                                                       ") extends past its allocation of ", alloc_size, " bytes"));
      }
    } else if (spec.kind == MemoryKind::kHost && spec.size_bytes > 0) {
      // Pinning makes host <-> device copies asynchronous DMA; without it they still work (staged).
      // Portable: the pinning must hold for the contexts of every device that copies from/to it,
      // not only for the device current on this thread (cudaHostRegisterDefault pins for the
      // current context only).
      cudaError_t e = cudaHostRegister(spec.base, spec.size_bytes, cudaHostRegisterPortable);
      r.host_registered = e == cudaSuccess;
      if (e != cudaSuccess) (void)cudaGetLastError();
    }
    absl::MutexLock l(&mu_);
    const uint64_t id = next_id_++;
    r.owner_region_id = id;
    regions_.Add(id, std::move(r));
    return RegionHandle{id};
  }

  absl::StatusOr<std::string> ExportDescriptor(RegionHandle h) override {
    ScopedCudaDevice keep_device;
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(Region* found, regions_.Find(h));
    Region& r = *found;
    if (!r.local) return absl::FailedPreconditionError("cuda_ipc: cannot re-export an imported region");
    if (r.kind != MemoryKind::kCuda) {
      return absl::FailedPreconditionError(absl::StrCat("cuda_ipc: region '", r.label,
                                                        "' is host memory; export it with host_shm"));
    }
    if (r.size == 0) {
      return absl::FailedPreconditionError(absl::StrCat("cuda_ipc: region '", r.label, "' is empty; nothing to export"));
    }
    if (r.alloc_size < 0) {
      // cudaIpcOpenMemHandle maps the WHOLE allocation and returns its base, whatever pointer the
      // handle was taken from; without the base the importer would read at the wrong offset.
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda_ipc: region '", r.label, "': the driver did not tell where its allocation starts ",
          "(cuMemGetAddressRange unavailable or failed), so its IPC offset would be wrong; not exported"));
    }
    if (!r.have_handle) {
      WB_CUDA_RETURN_IF_ERROR(cudaSetDevice(r.device), "cuda_ipc ExportDescriptor: cudaSetDevice");
      if (cudaError_t e = cudaIpcGetMemHandle(&r.handle, r.alloc_base); e != cudaSuccess) {
        absl::Status s = CudaStatus(e, absl::StrCat("cuda_ipc ExportDescriptor('", r.label, "'): cudaIpcGetMemHandle"));
        // Memory from cudaMallocAsync pools or cuMemCreate cannot be exported with legacy IPC.
        return absl::FailedPreconditionError(absl::StrCat(s.message(), " (the region must come from cudaMalloc)"));
      }
      r.have_handle = true;
    }
    Desc d;
    d.inst = instance_id_;
    d.node = node_id_;
    d.region_id = h.id;
    d.size = r.size;
    d.label = r.label;
    d.handle.assign(reinterpret_cast<const char*>(&r.handle), kHandleBytes);
    d.alloc_offset = r.base - r.alloc_base;
    d.device = static_cast<uint32_t>(r.device);
    if (r.device >= 0 && r.device < static_cast<int>(uuids_.size())) d.uuid = uuids_[r.device];
    return EncodeDescriptor(d);
  }

  absl::StatusOr<RegionHandle> ImportDescriptor(absl::string_view bytes) override {
    ScopedCudaDevice keep_device;
    auto d = DecodeDescriptor(bytes);
    if (!d.ok()) return d.status();
    if (d->node != node_id_) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc ImportDescriptor: region '", d->label, "' of ",
                                                     d->inst, " lives on node '", d->node, "', this is node '",
                                                     node_id_, "'"));
    }
    if (d->inst == instance_id_) return ImportOwn(*d);
    // The exporter's device, in our numbering.
    int device = -1;
    if (!d->uuid.empty()) {
      for (size_t i = 0; i < uuids_.size(); ++i) {
        if (uuids_[i] == d->uuid) device = static_cast<int>(i);
      }
      if (device < 0) {
        return absl::InvalidArgumentError(absl::StrCat("cuda_ipc ImportDescriptor: region '", d->label,
                                                       "' lives on a GPU this process cannot see (exporter's device ",
                                                       d->device, ")"));
      }
    } else {
      device = static_cast<int>(d->device);
      if (device >= static_cast<int>(uuids_.size())) {
        return absl::InvalidArgumentError(absl::StrCat("cuda_ipc ImportDescriptor: region '", d->label,
                                                       "' names device ", device, ", only ", uuids_.size(),
                                                       " visible here"));
      }
    }
    if (d->vmm) return ImportVmm(*d, device);
    absl::MutexLock il(&import_mu_);  // one open per handle even with concurrent imports
    Mapping m;
    {
      // One mapping per handle (whatever device a descriptor names: it is opened on the GPU that
      // holds the memory, see OpenMapping).
      absl::MutexLock l(&mu_);
      const std::string prefix = absl::StrCat(d->handle, "@");
      for (auto it = mappings_.lower_bound(prefix); it != mappings_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
        m = it->second;
      }
    }
    bool opened = false;
    if (m.base == nullptr) {
      ASSIGN_OR_RETURN(m, OpenMapping(*d, device));
      opened = true;
    }
    device = m.device;
    const std::string key = absl::StrCat(d->handle, "@", device);
    // (subtraction: alloc_offset and size are each < 2^63 but their sum may not be)
    // Without the opened allocation's size (cuMemGetAddressRange unavailable or failed) the bytes
    // cannot be checked against it: refused, as the export side refuses a region whose allocation
    // it cannot place, rather than mapping a range that may run past the allocation.
    if (m.alloc_size < 0 || d->alloc_offset > m.alloc_size || d->size > m.alloc_size - d->alloc_offset) {
      if (opened) {
        (void)cudaSetDevice(m.device);
        (void)cudaIpcCloseMemHandle(m.base);
        (void)cudaGetLastError();
      }
      if (m.alloc_size < 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cuda_ipc import of region '", d->label, "': the driver did not report the size of the allocation its ",
            "IPC handle maps on GPU ", m.device, " (cuMemGetAddressRange unavailable or failed), so its ", d->size,
            " bytes at offset ", d->alloc_offset, " cannot be checked against it; not imported"));
      }
      // (no sum in the message: alloc_offset + size may overflow)
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc import of region '", d->label, "': ", d->size,
                                                     " bytes at offset ", d->alloc_offset,
                                                     " exceed the exported allocation of ", m.alloc_size, " bytes"));
    }
    absl::MutexLock l(&mu_);
    Mapping& stored = mappings_[key];
    if (opened) stored = m;
    stored.refs++;
    Region r;
    r.local = false;
    r.kind = MemoryKind::kCuda;
    r.base = stored.base + d->alloc_offset;
    r.size = d->size;
    r.device = device;
    r.label = d->label;
    r.owner_instance = d->inst;
    r.owner_region_id = d->region_id;
    r.mapping_key = key;
    const uint64_t id = next_id_++;
    regions_.Add(id, std::move(r));
    return RegionHandle{id};
  }

  absl::StatusOr<RegionInfo> Describe(RegionHandle h) const override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(const Region* r, regions_.Find(h));
    RegionInfo info = BasicRegionInfo(*r);
    info.kind = r->kind;
    if (r->kind == MemoryKind::kCuda) info.device = r->device;
    if (!info.local) info.peer = peers_.PeerOf(r->owner_instance);
    return info;
  }

  absl::Status Release(RegionHandle h) override {
    ScopedCudaDevice keep_device;
    absl::MutexLock il(&import_mu_);  // an import in progress may be about to share the mapping
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(Region* found, regions_.Find(h));
    Region& r = *found;
    RETURN_IF_ERROR(regions_.CheckNotInUse(r));
    if (r.host_registered) {
      (void)cudaHostUnregister(r.base);
      (void)cudaGetLastError();
    }
    if (!r.mapping_key.empty()) {
      auto m = mappings_.find(r.mapping_key);
      if (m != mappings_.end() && --m->second.refs == 0) {
        absl::Status closed = CloseMapping(m->second);
        mappings_.erase(m);
        if (!closed.ok()) {
          regions_.Erase(h.id);
          return Annotate(closed, absl::StrCat("cuda_ipc Release of '", r.label, "'"));
        }
      }
    }
    regions_.Erase(h.id);
    return absl::OkStatus();
  }

  absl::StatusOr<BatchId> Post(const Batch& batch) override {
    ScopedCudaDevice keep_device;
    struct Planned {
      char* dst;
      const char* src;
      CanonicalBox box;
      int device;
    };
    std::vector<Planned> plan;
    auto b = std::make_shared<IpcBatch>();
    b->tag = batch.tag;
    {
      absl::MutexLock l(&mu_);
      std::string peer_inst;
      if (batch.peer != kNoPeer) {
        const std::string* p = peers_.Instance(batch.peer);
        if (p == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat("cuda_ipc batch ", batch.tag, ": unknown peer ", batch.peer.id));
        }
        peer_inst = *p;
      }
      const std::string prefix = absl::StrCat("cuda_ipc batch ", batch.tag);
      auto lookup = [&](const RegionHandle& h, size_t i, const char* which) -> absl::StatusOr<Region*> {
        ASSIGN_OR_RETURN(Region* r, regions_.FindForOp(h, prefix, i, which));
        // Raw worker buffers (no owner) and aliases of our own regions behave like local ones.
        if (!r->local && !r->owner_instance.empty() && r->owner_instance != instance_id_ &&
            r->owner_instance != peer_inst) {
          return absl::InvalidArgumentError(absl::StrCat("cuda_ipc batch ", batch.tag, " op ", i, ": ", which,
                                                         " region '", r->label, "' was exported by ", r->owner_instance,
                                                         ", not by the batch's peer ",
                                                         peer_inst.empty() ? "(none)" : peer_inst));
        }
        return r;
      };
      for (size_t i = 0; i < batch.ops.size(); ++i) {
        const CopyOp& op = batch.ops[i];
        auto src = lookup(op.src.region, i, "source");
        if (!src.ok()) return src.status();
        auto dst = lookup(op.dst.region, i, "destination");
        if (!dst.ok()) return dst.status();
        auto layout = ValidateOp(op, static_cast<int>(i), (*src)->size, (*dst)->size, (*src)->label, (*dst)->label);
        if (!layout.ok()) return layout.status();
        b->regions.push_back(op.src.region.id);
        b->regions.push_back(op.dst.region.id);
        const int64_t n = layout->src.total_bytes();
        if (n == 0) continue;
        const Region* dr = *dst;
        const Region* sr = *src;
        if (dr->kind != MemoryKind::kCuda && sr->kind != MemoryKind::kCuda) {
          return absl::InvalidArgumentError(absl::StrCat("cuda_ipc batch ", batch.tag, " op ", i, ": '", sr->label,
                                                         "' -> '", dr->label,
                                                         "' has no device side (host -> host belongs to host_shm)"));
        }
        b->bytes += n;
        plan.push_back({dr->base + op.dst.offset_bytes, sr->base + op.src.offset_bytes,
                        Canonicalize(op.shape, op.src.strides, op.dst.strides, op.element_size),
                        dr->kind == MemoryKind::kCuda ? dr->device : sr->device});
      }
      // Valid: pin the regions so nobody releases them while copies may run.
      regions_.Pin(b->regions);
      b->id = next_id_++;
      stats_.batches_posted++;
      batches_.Add(b);
    }
    // Enqueue outside mu_ (pageable host copies may take a while). Ops are dealt to the stream of
    // their device with the fewest bytes so far, so several copy engines work in parallel.
    std::map<std::pair<int, int>, int64_t> load;  // (device, stream index) -> bytes
    std::map<std::pair<int, int>, cudaStream_t> used;
    absl::Status status;
    for (size_t i = 0; i < plan.size() && status.ok(); ++i) {
      const Planned& p = plan[i];
      auto streams = StreamsFor(p.device);
      if (!streams.ok()) {
        status = streams.status();
        break;
      }
      int best = 0;
      for (int s = 1; s < static_cast<int>(streams->size()); ++s) {
        if (load[{p.device, s}] < load[{p.device, best}]) best = s;
      }
      load[{p.device, best}] += p.box.bytes();
      used[{p.device, best}] = (*streams)[best];
      status = CudaStatus(cudaSetDevice(p.device), "cudaSetDevice");
      if (status.ok()) status = EnqueueBoxCopy(p.dst, p.src, p.box, (*streams)[best]);
      if (!status.ok()) {
        status = absl::Status(status.code(), absl::StrCat("cuda_ipc batch ", batch.tag, ": enqueueing a copy: ",
                                                          status.message()));
      }
    }
    // Events after whatever was enqueued, also on failure, so Wait knows when the memory is free.
    std::vector<StreamEvent> events;
    for (auto& [key, stream] : used) {
      StreamEvent se;
      se.device = key.first;
      se.stream = stream;
      absl::Status s = CudaStatus(cudaSetDevice(se.device), "cudaSetDevice");
      if (s.ok()) s = CudaStatus(cudaEventCreateWithFlags(&se.event, cudaEventDisableTiming), "cudaEventCreate");
      if (s.ok()) s = CudaStatus(cudaEventRecord(se.event, stream), "cudaEventRecord");
      if (!s.ok()) {
        if (se.event != nullptr) (void)cudaEventDestroy(se.event);
        // Without an event we cannot tell when this stream is done; wait for it (bounded by the copies).
        (void)cudaStreamSynchronize(stream);
        (void)cudaGetLastError();
        if (status.ok()) status = s;
        continue;
      }
      events.push_back(se);
    }
    absl::MutexLock l(&mu_);
    b->events = std::move(events);
    if (!status.ok() && b->status.ok()) b->status = status;
    return BatchId{b->id};
  }

  absl::StatusOr<BatchState> Poll(BatchId id) override {
    absl::MutexLock l(&mu_);
    // QueryLocked under mu_, held here.
    return batches_.Poll(id, [this](IpcBatch* b) ABSL_NO_THREAD_SAFETY_ANALYSIS { return QueryLocked(b); });
  }

  absl::Status Wait(BatchId id, absl::Time deadline) override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(std::shared_ptr<IpcBatch> b, batches_.Find(id));
    absl::Duration backoff = absl::Microseconds(10);
    absl::Time give_up = absl::InfiniteFuture();
    bool drained = false;
    while (true) {
      drained = QueryLocked(b.get());
      if (drained) break;
      const absl::Time now = absl::Now();
      if (now >= deadline && give_up == absl::InfiniteFuture()) {
        if (b->status.ok()) {
          b->status = absl::DeadlineExceededError(absl::StrCat("cuda_ipc batch ", b->tag, " (", b->bytes,
                                                               " bytes) missed its deadline"));
        }
        give_up = now + kDrainGrace;  // enqueued copies cannot be recalled: let them drain
      }
      if (now >= give_up) break;
      mu_.Unlock();
      absl::SleepFor(backoff);
      mu_.Lock();
      backoff = std::min(backoff * 2, absl::Milliseconds(1));
    }
    if (drained) {
      DestroyEvents(b.get());
      regions_.Unpin(b->regions);
      if (b->status.ok()) stats_.bytes_copied += b->bytes;
    } else {
      // The GPU still has copies of this batch queued: keep its regions pinned (never unpinned)
      // and its events alive rather than let memory be released under running copies.
      gave_up_on_copies_ = true;
      b->status = absl::Status(b->status.code(), absl::StrCat(b->status.message(), "; copies still queued after ",
                                                              absl::FormatDuration(kDrainGrace),
                                                              ", regions stay pinned"));
    }
    batches_.Retire(id.id);
    if (!b->status.ok()) stats_.batches_failed++;
    return b->status;
  }

  TransportStats stats() const override {
    absl::MutexLock l(&mu_);
    return stats_;
  }

 private:
  // Start of the allocation containing p (p itself if the driver cannot tell); *size = its size
  // or -1. The device of p must be current.
  char* AllocationBase(char* p, int64_t* size) const {
    *size = -1;
    if (get_range_ == nullptr) return p;
    CUdeviceptr base = 0;
    size_t n = 0;
    if (get_range_(&base, &n, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return p;
    *size = static_cast<int64_t>(n);
    return reinterpret_cast<char*>(base);
  }

  // Opens a worker's / peer's IPC handle, first on `device` (the descriptor's GPU in our
  // numbering), then, if the memory lives on another GPU (a worker whose CUDA_VISIBLE_DEVICES
  // numbers GPUs differently and sent no UUID), again on the GPU that holds it: copies then run
  // on that GPU's own streams (not across NVLink) and Describe reports the true device.
  absl::StatusOr<Mapping> OpenMapping(const Desc& d, int device) {
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, d.handle.data(), kHandleBytes);
    auto open_on = [&](int dev) -> absl::StatusOr<char*> {
      WB_CUDA_RETURN_IF_ERROR(cudaSetDevice(dev), "cuda_ipc ImportDescriptor: cudaSetDevice");
      void* p = nullptr;
      if (cudaError_t e = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
        // Also what a handle exported by this very process gets (legacy IPC cannot open its own
        // handles); our own descriptors never get here (ImportOwn), raw worker handles may.
        absl::Status s = CudaStatus(e, absl::StrCat("cuda_ipc import of region '", d.label, "' of ",
                                                    d.inst.empty() ? "a worker" : d.inst,
                                                    ": cudaIpcOpenMemHandle on GPU ", dev,
                                                    " (is the exporting process alive, and another process than this one?)"));
        // A handle whose exporter is gone or that is not an IPC handle is the caller's bad input.
        return absl::Status(s.code() == absl::StatusCode::kInternal ? absl::StatusCode::kInvalidArgument : s.code(),
                            s.message());
      }
      return static_cast<char*>(p);
    };
    Mapping m;
    ASSIGN_OR_RETURN(m.base, open_on(device));
    m.device = device;
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, m.base) == cudaSuccess && attr.type == cudaMemoryTypeDevice && attr.device >= 0 &&
        attr.device != device) {
      (void)cudaIpcCloseMemHandle(m.base);
      (void)cudaGetLastError();
      ASSIGN_OR_RETURN(m.base, open_on(attr.device));
      m.device = attr.device;
    }
    (void)cudaGetLastError();
    AllocationBase(m.base, &m.alloc_size);
    return m;
  }

  // A worker's VMM allocation(s) (RawCudaVmmBuffer): mapped once per ordered list of allocation
  // keys, shared by every buffer that names the same list. `device`: the descriptor's GPU in our
  // numbering.
  absl::StatusOr<RegionHandle> ImportVmm(const Desc& d, int device) {
    const std::string what = absl::StrCat("cuda_ipc VMM import of region '", d.label, "'");
    if (d.vmm_pid != static_cast<uint32_t>(::getpid())) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the descriptor names fds of process ", d.vmm_pid,
                                                     ", not of this process (VMM descriptors do not travel)"));
    }
    const size_t n = d.vmm_parts.size();
    // (subtraction: offset and size are each < 2^63 but their sum may not be)
    if (d.alloc_offset > d.vmm_total || d.size > d.vmm_total - d.alloc_offset) {
      if (n == 1) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", d.alloc_offset, ", ", d.alloc_offset + d.size,
                                                       ") exceed the allocation of ", d.vmm_total, " bytes"));
      }
      return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", d.alloc_offset, ", ", d.alloc_offset + d.size,
                                                     ") exceed the ", n, " allocations of ", d.vmm_total,
                                                     " bytes in all (first '", d.vmm_parts.front().key, "', last '",
                                                     d.vmm_parts.back().key, "')"));
    }
    if (n > 1) {
      // Every listed allocation holds some of the buffer: a longer list maps memory for nothing
      // and usually means the worker walked its allocations wrong.
      if (d.alloc_offset >= d.vmm_parts.front().bytes) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": the buffer starts at byte ", d.alloc_offset,
                                                       ", past its first allocation '", d.vmm_parts.front().key, "' of ",
                                                       d.vmm_parts.front().bytes, " bytes (list only the allocations it spans)"));
      }
      if (d.alloc_offset + d.size <= d.vmm_total - d.vmm_parts.back().bytes) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": the buffer ends at byte ", d.alloc_offset + d.size,
                                                       ", before its last allocation '", d.vmm_parts.back().key,
                                                       "' (list only the allocations it spans)"));
      }
    }
    std::string key = "vmm:";
    if (n == 1) {
      key += d.vmm_parts[0].key;  // as before multi-allocation buffers: one allocation, one mapping
    } else {
      key = absl::StrCat("vmm", n, ":");
      for (const Desc::VmmPart& p : d.vmm_parts) absl::StrAppend(&key, p.key.size(), ":", p.key);
    }
    absl::MutexLock il(&import_mu_);  // one mapping per key list even with concurrent imports
    Mapping m;
    {
      absl::MutexLock l(&mu_);
      if (auto it = mappings_.find(key); it != mappings_.end()) m = it->second;
    }
    if (m.base != nullptr) {
      for (size_t i = 0; i < n; ++i) {
        if (m.vmm_sizes[i] != d.vmm_parts[i].bytes) {
          return absl::InvalidArgumentError(absl::StrCat(what, ": allocation '", d.vmm_parts[i].key, "' is mapped with ",
                                                         m.vmm_sizes[i], " bytes, the descriptor says ", d.vmm_parts[i].bytes));
        }
      }
    }
    const bool mapped_now = m.base == nullptr;
    if (mapped_now) {
      ASSIGN_OR_RETURN(m, MapVmm(d, device, what));
    }
    absl::MutexLock l(&mu_);
    Mapping& stored = mappings_[key];
    if (mapped_now) stored = m;
    stored.refs++;
    Region r;
    r.local = false;
    r.kind = MemoryKind::kCuda;
    r.base = stored.base + d.alloc_offset;
    r.size = d.size;
    r.device = stored.device;
    r.label = d.label;
    r.owner_instance = d.inst;
    r.owner_region_id = d.region_id;
    r.mapping_key = key;
    const uint64_t id = next_id_++;
    regions_.Add(id, std::move(r));
    return RegionHandle{id};
  }

  // cuMemImportFromShareableHandle of every part, one cuMemAddressReserve of their sum, cuMemMap of
  // each at its offset, one cuMemSetAccess over the whole range; undone on any failure.
  absl::StatusOr<Mapping> MapVmm(const Desc& d, int device, const std::string& what) {
    ASSIGN_OR_RETURN(const CudaVmmApi* api, LoadCudaVmmApi());
    WB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), absl::StrCat(what, ": cudaSetDevice"));
    Mapping m;
    m.vmm = true;
    m.device = device;
    m.alloc_size = d.vmm_total;
    CUdeviceptr va = 0;
    size_t mapped = 0;  // parts mapped so far
    auto undo = [&](absl::Status s) {
      CUdeviceptr at = va;
      for (size_t i = 0; i < mapped; ++i) {
        (void)api->unmap(at, static_cast<size_t>(m.vmm_sizes[i]));
        at += static_cast<CUdeviceptr>(m.vmm_sizes[i]);
      }
      if (va != 0) (void)api->address_free(va, static_cast<size_t>(m.alloc_size));
      for (CUmemGenericAllocationHandle h : m.vmm_handles) (void)api->release(h);
      return s;
    };
    for (size_t i = 0; i < d.vmm_parts.size(); ++i) {
      const Desc::VmmPart& p = d.vmm_parts[i];
      CUmemGenericAllocationHandle h = 0;
      if (absl::Status s = CuStatus(api->import_handle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(p.fd)),
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                                    absl::StrCat(what, ": cuMemImportFromShareableHandle of allocation '", p.key,
                                                 "' (is the fd an exported CUDA allocation?)"));
          !s.ok()) {
        return undo(s);
      }
      m.vmm_handles.push_back(h);
      m.vmm_sizes.push_back(p.bytes);
      // The GPU that holds the memory (a worker with another CUDA_VISIBLE_DEVICES and no UUID may
      // have named another): copies run on its streams and Describe reports it. All parts of one
      // range must be on it (one device's address range).
      CUmemAllocationProp prop = {};
      if (api->properties(&prop, h) == CUDA_SUCCESS && prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE &&
          prop.location.id >= 0 && prop.location.id < static_cast<int>(uuids_.size())) {
        if (i == 0) {
          m.device = prop.location.id;
        } else if (prop.location.id != m.device) {
          return undo(absl::InvalidArgumentError(absl::StrCat(what, ": allocation '", p.key, "' is on GPU ", prop.location.id,
                                                              ", allocation '", d.vmm_parts[0].key, "' on GPU ", m.device,
                                                              " (one buffer's allocations must share a GPU)")));
        }
      }
    }
    if (m.device != device) {
      if (absl::Status s = CudaStatus(cudaSetDevice(m.device), what); !s.ok()) return undo(s);
    }
    size_t g = 0;
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = m.device;
    if (absl::Status s = CuStatus(api->granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                                  absl::StrCat(what, ": cuMemGetAllocationGranularity"));
        !s.ok()) {
      return undo(s);
    }
    for (const Desc::VmmPart& p : d.vmm_parts) {
      // cuMemMap needs sizes (and, in one range, offsets) that are multiples of the granularity.
      if (g == 0 || p.bytes % static_cast<int64_t>(g) != 0) {
        return undo(absl::InvalidArgumentError(absl::StrCat(what, ": allocation '", p.key, "' size ", p.bytes,
                                                            " is not a multiple of the granularity ", g,
                                                            " (give the size passed to cuMemCreate)")));
      }
    }
    const size_t total = static_cast<size_t>(d.vmm_total);
    if (absl::Status s = CuStatus(api->reserve(&va, total, 0, 0, 0), absl::StrCat(what, ": cuMemAddressReserve of ", total, " bytes"));
        !s.ok()) {
      va = 0;
      return undo(s);
    }
    CUdeviceptr at = va;
    for (size_t i = 0; i < d.vmm_parts.size(); ++i) {
      const size_t bytes = static_cast<size_t>(d.vmm_parts[i].bytes);
      if (absl::Status s = CuStatus(api->map(at, bytes, 0, m.vmm_handles[i], 0),
                                    absl::StrCat(what, ": cuMemMap of allocation '", d.vmm_parts[i].key, "' (", bytes,
                                                 " bytes; larger than the allocation?)"));
          !s.ok()) {
        return undo(s);
      }
      ++mapped;
      at += static_cast<CUdeviceptr>(bytes);
    }
    CUmemAccessDesc rw = {};
    rw.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    rw.location.id = m.device;
    rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (absl::Status s = CuStatus(api->set_access(va, total, &rw, 1), absl::StrCat(what, ": cuMemSetAccess")); !s.ok()) {
      return undo(s);
    }
    m.base = reinterpret_cast<char*>(va);
    return m;
  }

  absl::StatusOr<RegionHandle> ImportOwn(const Desc& d) {
    // cudaIpcOpenMemHandle refuses handles of the calling process; our own region is reachable directly.
    absl::MutexLock l(&mu_);
    const Region* own = regions_.Get(d.region_id);
    if (own == nullptr || !own->local || own->kind != MemoryKind::kCuda) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc ImportDescriptor: own region ", d.region_id,
                                                     " is no longer registered"));
    }
    Region r = *own;
    r.local = false;
    r.have_handle = false;
    r.host_registered = false;
    r.pinned = 0;
    const uint64_t id = next_id_++;
    regions_.Add(id, std::move(r));
    return RegionHandle{id};
  }

  absl::StatusOr<std::vector<cudaStream_t>> StreamsFor(int device) {
    absl::MutexLock l(&streams_mu_);
    auto it = streams_.find(device);
    if (it != streams_.end()) return it->second;
    WB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cuda_ipc: cudaSetDevice");
    std::vector<cudaStream_t> streams;
    const int n = std::clamp(options_.streams, 1, 16);
    for (int i = 0; i < n; ++i) {
      cudaStream_t s = nullptr;
      if (cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
        for (cudaStream_t made : streams) (void)cudaStreamDestroy(made);
        return CudaStatus(e, absl::StrCat("cuda_ipc: cudaStreamCreateWithFlags on device ", device));
      }
      streams.push_back(s);
    }
    streams_[device] = streams;
    return streams;
  }

  // True when every event of the batch has completed (or failed; the failure lands in status).
  bool QueryLocked(IpcBatch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool all = true;
    for (StreamEvent& se : b->events) {
      if (se.done) continue;
      const cudaError_t e = cudaEventQuery(se.event);
      if (e == cudaErrorNotReady) {
        all = false;
        continue;
      }
      se.done = true;
      if (e != cudaSuccess && b->status.ok()) {
        absl::Status s = CudaStatus(e, absl::StrCat("cuda_ipc batch ", b->tag, ": copy on device ", se.device));
        // A failed copy is a device/peer problem, not the caller's argument.
        b->status = s.code() == absl::StatusCode::kInvalidArgument ? absl::InternalError(s.message()) : s;
      }
    }
    return all;
  }

  void DestroyEvents(IpcBatch* b) {
    for (StreamEvent& se : b->events) {
      if (se.event != nullptr) (void)cudaEventDestroy(se.event);
      se.event = nullptr;
    }
    b->events.clear();
  }

  const CudaIpcOptions options_;
  const std::string node_id_;
  const std::string instance_id_;
  const std::vector<std::string> uuids_;  // per local device ordinal
  const GetAddressRangeFn get_range_;

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  RegionRegistry<Region> regions_ ABSL_GUARDED_BY(mu_){kKind};
  PeerInstances peers_ ABSL_GUARDED_BY(mu_){kKind};
  CancelledRounds cancelled_ ABSL_GUARDED_BY(mu_);
  BatchTable<IpcBatch> batches_ ABSL_GUARDED_BY(mu_){kKind};
  std::map<std::string, Mapping> mappings_ ABSL_GUARDED_BY(mu_);
  TransportStats stats_ ABSL_GUARDED_BY(mu_);
  bool gave_up_on_copies_ ABSL_GUARDED_BY(mu_) = false;  // a Wait returned with copies still queued
  absl::Mutex import_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex streams_mu_;
  std::map<int, std::vector<cudaStream_t>> streams_ ABSL_GUARDED_BY(streams_mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateCudaIpcTransport(const TransportConfig& config) {
  if (config.cuda_ipc.streams < 1 || config.cuda_ipc.streams > 16) {
    return absl::InvalidArgumentError("cuda_ipc.streams must be in [1, 16]");
  }
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
    absl::Status s = CudaStatus(e == cudaSuccess ? cudaErrorNoDevice : e, "cuda_ipc: cudaGetDeviceCount");
    return absl::FailedPreconditionError(s.message());
  }
  std::vector<std::string> uuids;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop;
    WB_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i), absl::StrCat("cuda_ipc: cudaGetDeviceProperties(", i, ")"));
    uuids.emplace_back(prop.uuid.bytes, kUuidBytes);
  }
  return std::unique_ptr<Transport>(new CudaIpcTransport(config, std::move(uuids)));
}

absl::StatusOr<std::string> CudaIpcDescriptorFromVmmFd(const RawCudaVmmBuffer& buffer) {
  if (buffer.next_allocations.size() + 1 > kMaxCudaVmmAllocationsPerBuffer) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: VMM buffer '", buffer.label, "' spans ",
                                                   buffer.next_allocations.size() + 1, " allocations, more than the limit of ",
                                                   kMaxCudaVmmAllocationsPerBuffer));
  }
  std::vector<Desc::VmmPart> parts = {{buffer.fd, buffer.allocation_key, buffer.allocation_bytes}};
  for (const CudaVmmAllocationRef& a : buffer.next_allocations) parts.push_back({a.fd, a.key, a.bytes});
  int64_t total = 0;
  std::set<std::string> keys;
  for (const Desc::VmmPart& p : parts) {
    if (p.fd < 0 || p.key.empty() || p.bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: VMM buffer '", buffer.label, "': allocation '", p.key,
                                                     "' needs an fd, a key and a positive size"));
    }
    if (!keys.insert(p.key).second) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: VMM buffer '", buffer.label, "' names allocation '", p.key,
                                                     "' twice"));
    }
    if (total > INT64_MAX - p.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: VMM buffer '", buffer.label, "': allocation sizes overflow"));
    }
    total += p.bytes;
  }
  if (!buffer.device_uuid.empty() && buffer.device_uuid.size() != kUuidBytes) {
    return absl::InvalidArgumentError("cuda_ipc: device uuid must be 16 bytes or empty");
  }
  if (buffer.offset_bytes < 0 || buffer.size_bytes < 0 || buffer.device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: buffer '", buffer.label, "' has a negative field"));
  }
  Desc d;
  d.node = buffer.node_id;
  d.size = buffer.size_bytes;
  d.label = buffer.label;
  d.alloc_offset = buffer.offset_bytes;
  d.device = static_cast<uint32_t>(buffer.device);
  d.uuid = buffer.device_uuid;
  d.vmm = true;
  d.vmm_pid = static_cast<uint32_t>(::getpid());
  d.vmm_parts = std::move(parts);
  d.vmm_total = total;
  return EncodeDescriptor(d);
}

absl::StatusOr<std::string> CudaIpcDescriptorFromRawHandle(const RawCudaIpcBuffer& buffer) {
  if (buffer.ipc_handle.size() != kHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: IPC handle of buffer '", buffer.label, "' has ",
                                                   buffer.ipc_handle.size(), " bytes, expected ", kHandleBytes));
  }
  if (!buffer.device_uuid.empty() && buffer.device_uuid.size() != kUuidBytes) {
    return absl::InvalidArgumentError("cuda_ipc: device uuid must be 16 bytes or empty");
  }
  if (buffer.offset_bytes < 0 || buffer.size_bytes < 0 || buffer.device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc: buffer '", buffer.label, "' has a negative field"));
  }
  Desc d;
  d.inst = buffer.owner_instance;
  d.node = buffer.node_id;
  d.region_id = 0;
  d.size = buffer.size_bytes;
  d.label = buffer.label;
  d.handle = buffer.ipc_handle;
  d.alloc_offset = buffer.offset_bytes;
  d.device = static_cast<uint32_t>(buffer.device);
  d.uuid = buffer.device_uuid;
  return EncodeDescriptor(d);
}

}  // namespace wb::transport
