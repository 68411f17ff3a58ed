#include "daemon/node/live_copy.h"

#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/quantized.h"
#include "base/status_macros.h"

namespace wb::daemon {

CudaImport::~CudaImport() {
  if (t != nullptr) (void)t->Release(h);
}

transport::StridedRef RefFor(const planner::Piece& piece, const planner::Box& box, int elem, transport::RegionHandle region) {
  transport::StridedRef r;
  r.region = region;
  int64_t off = 0;
  for (size_t d = 0; d < box.begin.size(); ++d) off += (box.begin[d] - piece.box.begin[d]) * piece.strides[d];
  r.offset_bytes = piece.offset_bytes + off * elem;
  r.strides = piece.strides;
  return r;
}

absl::Status LiveCopier::Run(std::map<transport::Transport*, transport::Batch>& batches, const std::string& label, absl::Time deadline,
                             bool* wrote) const {
  absl::Status injected = fault_ ? fault_(label) : absl::OkStatus();
  if (!injected.ok()) {
    // Fault injection: a copy that fails midway (half of every batch lands).
    for (auto& [t, batch] : batches) batch.ops.resize(batch.ops.size() / 2);
  } else if (fault_) {
    // Tests: the first half of every batch lands, then the hook sees "<label> midway" (a test
    // kills the daemon there: live memory is part new, part old); an error fails the copy there.
    std::map<transport::Transport*, transport::Batch> rest;
    for (auto& [t, batch] : batches) {
      transport::Batch& r = rest[t];
      r = batch;
      const size_t half = batch.ops.size() / 2;
      r.ops.erase(r.ops.begin(), r.ops.begin() + static_cast<std::ptrdiff_t>(half));
      batch.ops.resize(half);
    }
    const LiveCopier plain(node_id_, host_);  // the halves themselves run without the hook
    RETURN_IF_ERROR(plain.Run(batches, label, deadline, wrote));
    if (absl::Status midway = fault_(absl::StrCat(label, " midway")); !midway.ok()) {
      *wrote = true;
      return midway;
    }
    return plain.Run(rest, label, deadline, wrote);
  }
  std::vector<std::pair<transport::Transport*, transport::BatchId>> posted;
  absl::Status first;
  for (auto& [t, batch] : batches) {
    if (batch.ops.empty()) continue;
    auto id = t->Post(batch);
    if (!id.ok()) {
      first = id.status();
      break;
    }
    *wrote = true;
    posted.push_back({t, *id});
  }
  for (auto& [t, id] : posted) {
    absl::Status s = t->Wait(id, deadline);
    if (first.ok()) first = s;
  }
  if (!injected.ok()) {
    *wrote = true;
    return injected;
  }
  return first;
}

absl::Status LiveCopier::CopyToLive(const StagedBytes& staging, const LiveBuffers& live, const planner::WorkerLayout& layout,
                                    const planner::Inventory& inventory, const std::string& label, absl::Time deadline, bool* wrote) const {
  *wrote = false;
  if (host_ == nullptr) return absl::FailedPreconditionError(absl::StrCat("node ", node_id_, " has no same-node host transport"));
  const auto& buffers = live.host;
  const auto& cuda = live.cuda;
  // Host live buffers go through host_shm (its copy threads); CUDA ones through cuda_ipc (from
  // host staging registered with it, or device to device from GPU staging).
  std::vector<std::pair<transport::Transport*, transport::RegionHandle>> regions;
  absl::Cleanup cleanup = [&] {
    for (auto& [t, h] : regions) (void)t->Release(h);
  };
  struct Target {
    transport::Transport* t;
    transport::RegionHandle src, dst;
  };
  std::map<int32_t, Target> by_buffer;
  std::map<transport::Transport*, transport::Batch> batches;
  std::vector<const planner::Piece*> scale_regions;
  // Registers staging buffer `b` and the live buffer `b` with the transport that reaches it.
  auto register_buffer = [&](int32_t b) -> absl::StatusOr<Target> {
    const bool on_gpu = buffers[b] == nullptr;
    if (on_gpu && (static_cast<size_t>(b) >= cuda.size() || cuda[b] == nullptr)) {
      return absl::InternalError(absl::StrCat(label, ": buffer ", b, " is neither host nor CUDA memory"));
    }
    const StagedBuffer& sb = staging[b];
    if (sb.device != nullptr && !on_gpu) {
      return absl::InternalError(absl::StrCat(label, ": buffer ", b, " is staged on a GPU but lives in host memory"));
    }
    transport::Transport* t = on_gpu ? cuda[b]->t : host_;
    transport::MemorySpec s;
    if (sb.device != nullptr) {
      s.kind = transport::MemoryKind::kCuda;
      s.base = sb.device->data();
      s.device = sb.device->device();
    } else {
      s.kind = transport::MemoryKind::kHost;
      s.base = const_cast<uint8_t*>(sb.host.data());  // only read
    }
    s.size_bytes = sb.size();
    s.label = absl::StrCat(label, " staging b", b);
    ASSIGN_OR_RETURN(transport::RegionHandle sh, t->RegisterMemory(s));
    regions.push_back({t, sh});
    transport::RegionHandle dh;
    if (on_gpu) {
      dh = cuda[b]->h;
    } else {
      transport::MemorySpec d;
      d.kind = transport::MemoryKind::kHost;
      d.base = buffers[b]->data();
      d.size_bytes = buffers[b]->size();
      d.label = absl::StrCat(label, " live b", b);
      ASSIGN_OR_RETURN(dh, t->RegisterMemory(d));
      regions.push_back({t, dh});
    }
    return Target{t, sh, dh};
  };
  // The worker's segments must still be whole before a byte is written (a worker may truncate its
  // own memory); a fault during the copy is caught by ShmSegment's SIGBUS guard and checked after.
  RETURN_IF_ERROR(CheckLive(buffers, label));
  for (const planner::Piece& piece : layout.pieces) {
    if (piece.buffer < 0 || piece.buffer >= static_cast<int32_t>(buffers.size()) || piece.buffer >= static_cast<int32_t>(staging.size())) {
      return absl::InternalError(absl::StrCat(label, ": piece of tensor ", inventory.tensors[piece.tensor].name, " names buffer ",
                                              piece.buffer, " that the worker does not have"));
    }
    if (planner::BoxEmpty(piece.box)) continue;
    auto it = by_buffer.find(piece.buffer);
    if (it == by_buffer.end()) {
      ASSIGN_OR_RETURN(Target t, register_buffer(piece.buffer));
      it = by_buffer.emplace(piece.buffer, t).first;
    }
    // The bytes the piece occupies (quantised pieces: e4m3 bytes, or int4 pairs as bytes).
    const planner::ByteView view = planner::StoredBytes(inventory, piece);
    const int elem = view.element_size;
    transport::CopyOp op;
    for (size_t d = 0; d < view.piece.box.begin.size(); ++d) op.shape.push_back(view.piece.box.end[d] - view.piece.box.begin[d]);
    op.element_size = elem;
    // Staging mirrors the live layout byte for byte: same offset and strides on both sides (the
    // shadows of quantised pieces lie past the end of the live buffer and are not copied).
    op.src = RefFor(view.piece, view.piece.box, elem, it->second.src);
    op.dst = RefFor(view.piece, view.piece.box, elem, it->second.dst);
    batches[it->second.t].ops.push_back(std::move(op));
    if (piece.quant.has_value()) scale_regions.push_back(&piece);
  }
  // The scales of quantised pieces: one contiguous run each, same offset in staging and live
  // memory. Their buffer has a target already when a piece lives in it; else register it.
  std::set<std::pair<int32_t, int64_t>> global_scales;  // (scale buffer, offset) already copied
  for (const planner::Piece* piece : scale_regions) {
    const int32_t sb = piece->quant->scale_buffer;
    auto it = by_buffer.find(sb);
    if (it == by_buffer.end()) {
      if (sb < 0 || sb >= static_cast<int32_t>(buffers.size()) || sb >= static_cast<int32_t>(staging.size())) {
        return absl::InternalError(absl::StrCat(label, ": scales of tensor ", inventory.tensors[piece->tensor].name, " name buffer ", sb,
                                                " that the worker does not have"));
      }
      ASSIGN_OR_RETURN(Target t, register_buffer(sb));
      it = by_buffer.emplace(sb, t).first;
    }
    transport::CopyOp op;
    op.shape = {planner::ScaleCount(*piece)};
    op.element_size = planner::ScaleElementSize(*piece->quant);
    op.src = {it->second.src, piece->quant->scale_offset_bytes, {1}};
    op.dst = {it->second.dst, piece->quant->scale_offset_bytes, {1}};
    batches[it->second.t].ops.push_back(std::move(op));
    // NVFP4: the float32 global scale its group shares, copied once per place.
    const int64_t g = piece->quant->global_scale_offset_bytes;
    if (g >= 0 && global_scales.insert({sb, g}).second) {
      transport::CopyOp gop;
      gop.shape = {1};
      gop.element_size = 4;
      gop.src = {it->second.src, g, {1}};
      gop.dst = {it->second.dst, g, {1}};
      batches[it->second.t].ops.push_back(std::move(gop));
    }
  }
  RETURN_IF_ERROR(Run(batches, label, deadline, wrote));
  return CheckLive(buffers, label);
}

absl::Status LiveCopier::CopyRelaysToLive(const std::vector<RelayAtCommit>& relays,
                                          const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming,
                                          const std::vector<std::shared_ptr<transport::ShmSegment>>& live, const std::string& label,
                                          absl::Time deadline, bool* wrote) const {
  *wrote = false;
  if (relays.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(CheckLive(live, label));
  std::vector<std::pair<uint8_t*, int64_t>> dst;
  for (const auto& seg : live) dst.push_back(seg == nullptr ? std::pair<uint8_t*, int64_t>{nullptr, 0}
                                                            : std::pair<uint8_t*, int64_t>{static_cast<uint8_t*>(seg->data()), seg->size()});
  RETURN_IF_ERROR(CopyRelays(relays, incoming, dst, "live", label, deadline, wrote));
  return CheckLive(live, label);
}

absl::Status LiveCopier::CopyRelaysToStaging(const std::vector<RelayAtCommit>& relays,
                                             const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming, StagedBytes& staging,
                                             const std::string& label, absl::Time deadline) const {
  std::vector<std::pair<uint8_t*, int64_t>> dst;
  for (StagedBuffer& b : staging) dst.push_back(b.device != nullptr ? std::pair<uint8_t*, int64_t>{nullptr, 0}
                                                                    : std::pair<uint8_t*, int64_t>{b.host.data(), static_cast<int64_t>(b.host.size())});
  bool wrote = false;
  return CopyRelays(relays, incoming, dst, "staging", label, deadline, &wrote);
}

absl::Status LiveCopier::CopyRelays(const std::vector<RelayAtCommit>& relays, const std::map<std::string, std::shared_ptr<StagedBytes>>& incoming,
                                    const std::vector<std::pair<uint8_t*, int64_t>>& dst, const std::string& dst_what,
                                    const std::string& label, absl::Time deadline, bool* wrote) const {
  *wrote = false;
  if (relays.empty()) return absl::OkStatus();
  if (host_ == nullptr) return absl::FailedPreconditionError(absl::StrCat("node ", node_id_, " has no same-node host transport"));
  transport::Transport* t = host_;
  std::vector<transport::RegionHandle> regions;
  absl::Cleanup cleanup = [&] {
    for (auto& h : regions) (void)t->Release(h);
  };
  std::map<std::pair<std::string, int32_t>, transport::RegionHandle> src_h;  // (rollout, staging buffer)
  std::map<int32_t, transport::RegionHandle> dst_h;                         // destination buffer
  std::map<transport::Transport*, transport::Batch> batches;
  transport::Batch& batch = batches[t];
  for (const RelayAtCommit& r : relays) {
    auto s = src_h.find({r.src_worker, r.src_buffer});
    if (s == src_h.end()) {
      auto in = incoming.find(r.src_worker);
      if (in == incoming.end() || r.src_buffer < 0 || r.src_buffer >= static_cast<int32_t>(in->second->size()) ||
          (*in->second)[r.src_buffer].device != nullptr) {
        return absl::InternalError(absl::StrCat(label, ": relay source ", r.src_worker, " buffer ", r.src_buffer, " is not in host staging"));
      }
      std::vector<uint8_t>& bytes = (*in->second)[r.src_buffer].host;
      transport::MemorySpec spec;
      spec.kind = transport::MemoryKind::kHost;
      spec.base = bytes.data();  // only read
      spec.size_bytes = static_cast<int64_t>(bytes.size());
      spec.label = absl::StrCat(label, " relay source ", r.src_worker, " b", r.src_buffer);
      ASSIGN_OR_RETURN(transport::RegionHandle h, t->RegisterMemory(spec));
      regions.push_back(h);
      s = src_h.emplace(std::pair{r.src_worker, r.src_buffer}, h).first;
    }
    auto d = dst_h.find(r.dst_buffer);
    if (d == dst_h.end()) {
      if (r.dst_buffer < 0 || r.dst_buffer >= static_cast<int32_t>(dst.size()) || dst[r.dst_buffer].first == nullptr) {
        return absl::InternalError(absl::StrCat(label, ": ", dst_what, " buffer ", r.dst_buffer, " is not host memory"));
      }
      transport::MemorySpec spec;
      spec.kind = transport::MemoryKind::kHost;
      spec.base = dst[r.dst_buffer].first;
      spec.size_bytes = dst[r.dst_buffer].second;
      spec.label = absl::StrCat(label, " ", dst_what, " b", r.dst_buffer);
      ASSIGN_OR_RETURN(transport::RegionHandle h, t->RegisterMemory(spec));
      regions.push_back(h);
      d = dst_h.emplace(r.dst_buffer, h).first;
    }
    transport::CopyOp op = r.op;
    op.src.region = s->second;
    op.dst.region = d->second;
    batch.ops.push_back(std::move(op));
  }
  return Run(batches, label, deadline, wrote);
}

absl::Status CheckLive(const std::vector<std::shared_ptr<transport::ShmSegment>>& segments, const std::string& label) {
  for (size_t b = 0; b < segments.size(); ++b) {
    if (segments[b] == nullptr) continue;
    if (absl::Status s = segments[b]->CheckIntact(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(label, ": live buffer ", b, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status LiveCopier::CopyFlat(const std::vector<const uint8_t*>& src, const std::vector<uint8_t*>& dst, const std::vector<int64_t>& size,
                                  const std::string& label, absl::Time deadline) const {
  transport::Transport* t = host_;
  if (t == nullptr) return absl::FailedPreconditionError(absl::StrCat("node ", node_id_, " has no same-node host transport"));
  std::vector<transport::RegionHandle> regions;
  absl::Cleanup cleanup = [&] {
    for (auto& h : regions) (void)t->Release(h);
  };
  transport::Batch batch;
  for (size_t i = 0; i < src.size(); ++i) {
    if (size[i] == 0) continue;
    transport::MemorySpec s, d;
    s.kind = d.kind = transport::MemoryKind::kHost;
    s.base = const_cast<uint8_t*>(src[i]);  // only read
    d.base = dst[i];
    s.size_bytes = d.size_bytes = size[i];
    s.label = absl::StrCat(label, " src ", i);
    d.label = absl::StrCat(label, " dst ", i);
    ASSIGN_OR_RETURN(transport::RegionHandle sh, t->RegisterMemory(s));
    regions.push_back(sh);
    ASSIGN_OR_RETURN(transport::RegionHandle dh, t->RegisterMemory(d));
    regions.push_back(dh);
    transport::CopyOp op;
    op.shape = {size[i]};
    op.element_size = 1;
    op.src = {sh, 0, {1}};
    op.dst = {dh, 0, {1}};
    batch.ops.push_back(std::move(op));
  }
  if (batch.ops.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(transport::BatchId id, t->Post(batch));
  return t->Wait(id, deadline);
}

// ------------------------------------------------------------------------------- LiveState
bool LiveState::Begin(const std::string& worker, uint64_t writing, uint64_t over) {
  Info& i = info_[worker];
  if (i.state == State::kCopying) return false;
  before_[worker] = i;
  // Torn weights hold neither version: a copy over them is "over" what they were last meant to be.
  i = Info{State::kCopying, writing, i.state == State::kTorn ? i.over : over, ""};
  return true;
}

bool LiveState::Copying(const std::string& worker) const {
  auto it = info_.find(worker);
  return it != info_.end() && it->second.state == State::kCopying;
}

void LiveState::End(const std::string& worker, const absl::Status& result, bool wrote) {
  auto it = info_.find(worker);
  if (it == info_.end() || it->second.state != State::kCopying) return;  // forgotten meanwhile
  auto b = before_.find(worker);
  if (result.ok()) {
    info_.erase(it);
  } else if (wrote) {
    it->second.state = State::kTorn;
    it->second.reason = std::string(result.message());
  } else if (b != before_.end() && b->second.state == State::kTorn) {
    it->second = b->second;  // still torn as before; this copy changed nothing
  } else {
    info_.erase(it);
  }
  if (b != before_.end()) before_.erase(b);
  if (markers_ == nullptr) return;
  // The durable record follows the state: gone when whole, the failure's versions and reason when torn.
  auto now = info_.find(worker);
  if (now == info_.end()) {
    markers_->Clear(worker);
  } else {
    markers_->MarkFailed(worker, now->second.writing, now->second.over, now->second.reason);
  }
}

absl::Status LiveState::Mark(const std::string& model, const std::string& worker,
                             const std::vector<std::shared_ptr<transport::ShmSegment>>& live) {
  if (markers_ == nullptr) return absl::OkStatus();
  auto segments = IdentifySegments(live);
  if (!segments.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker, " of model ", model, ": its live memory cannot be identified (",
                                                      segments.status().message(), "); nothing was copied"));
  }
  if (segments->empty()) return absl::OkStatus();  // CUDA buffers only: not covered (docs/daemon.md)
  const Info i = Get(worker);
  LiveMarker m;
  m.model = model;
  m.worker = worker;
  m.writing = i.writing;
  m.over = i.over;
  m.segments = std::move(*segments);
  if (absl::Status s = markers_->Record(m); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("worker ", worker, " of model ", model, ": the copy into its live weights was not started because it could not be recorded first in ",
                                               markers_->dir(), ": ", s.message(), "; nothing was copied"));
  }
  return absl::OkStatus();
}

void LiveState::Adopt(const std::string& model, const std::string& worker, const std::vector<std::shared_ptr<transport::ShmSegment>>& live,
                      const std::string& node) {
  if (markers_ == nullptr) return;
  auto segments = IdentifySegments(live);
  if (!segments.ok()) return;
  std::optional<LiveMarker> m = markers_->Claim(model, worker, *segments);
  if (!m.has_value()) return;
  before_.erase(worker);
  info_[worker] = Info{State::kTorn, m->writing, m->over,
                       absl::StrCat("the node daemon (pid ", m->daemon_pid, ") ended during the copy",
                                    m->reason.empty() ? "" : absl::StrCat(", after it had failed: ", m->reason), "; node ", node,
                                    " restarted since")};
}

LiveState::Info LiveState::Get(const std::string& worker) const {
  auto it = info_.find(worker);
  return it == info_.end() ? Info{} : it->second;
}

void LiveState::Forget(const std::string& worker) {
  info_.erase(worker);
  before_.erase(worker);
  if (markers_ != nullptr) markers_->Clear(worker);
}

absl::Status LiveState::TornError(const std::string& worker, const std::string& node) const {
  const Info i = Get(worker);
  if (i.state != State::kTorn) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("live weights of worker ", worker, " on node ", node, " are TORN: version ", i.writing,
                                          " was being copied over version ", i.over, " when the copy failed (", i.reason,
                                          "); they hold neither version until a later Apply or commit into this worker succeeds"));
}

const char* LiveState::Name(State s) {
  switch (s) {
    case State::kWhole:
      return "whole";
    case State::kCopying:
      return "copying";
    case State::kTorn:
      return "torn";
  }
  return "whole";
}

}  // namespace wb::daemon
