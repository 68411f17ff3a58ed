#include "daemon/node/quantize_outgoing.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/parallel_for.h"
#include "base/status_macros.h"
#include "daemon/box_copy.h"
#include "daemon/quantize.h"
#include "planner/box.h"

namespace wb::daemon::node {

absl::StatusOr<OutgoingStaging> OutgoingQuantizer::Quantize(const planner::Inventory& inventory,
                                                            const std::map<std::string, QuantRegion>& regions,
                                                            const std::map<std::string, RegionMemory>& memory, const std::string& label,
                                                            absl::Time deadline) const {
  OutgoingStaging out;
  if (regions.empty()) return out;
  struct Job {
    const QuantJob* job;
    const uint8_t* src;  // base of the source region
    uint8_t* q;          // base of the q region
  };
  std::vector<Job> jobs;
  auto buffers = std::make_shared<std::vector<std::unique_ptr<uint8_t[]>>>();
  for (const auto& [key, region] : regions) {
    // Uninitialised: every byte a copy reads is written below (gaps are alignment only).
    buffers->emplace_back(new uint8_t[static_cast<size_t>(std::max<int64_t>(region.size, 1))]);
    uint8_t* q = buffers->back().get();
    out.regions[key] = RegionMemory{transport::MemoryKind::kHost, q, region.size, -1, {}};
    for (const QuantJob& j : region.jobs) {
      const std::string what = absl::StrCat(label, ": sender-side quantisation of op ", j.op_index, " (tensor ",
                                            j.src.tensor >= 0 && static_cast<size_t>(j.src.tensor) < inventory.tensors.size()
                                                ? inventory.tensors[static_cast<size_t>(j.src.tensor)].name
                                                : "?",
                                            " box ", planner::BoxToString(j.box), ", region ", j.src_key, ")");
      auto m = memory.find(j.src_key);
      if (m == memory.end()) return absl::InternalError(absl::StrCat(what, ": source region missing"));
      if (m->second.kind != transport::MemoryKind::kHost || m->second.base == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(what, ": the source is device memory (sender-side quantisation reads host memory)"));
      }
      if (j.src.tensor < 0 || static_cast<size_t>(j.src.tensor) >= inventory.tensors.size() || !planner::BoxContains(j.src.box, j.box)) {
        return absl::InternalError(absl::StrCat(what, ": the box is not in the source piece"));
      }
      const int es = planner::DTypeSize(inventory.tensors[static_cast<size_t>(j.src.tensor)].dtype);
      RETURN_IF_ERROR(CheckPieceInBuffer(j.src, es, m->second.size, what));
      if (j.elements_offset < 0 || j.scales_offset < j.elements_offset + j.elements_bytes || j.scales_offset + j.scales_bytes > region.size) {
        return absl::InternalError(absl::StrCat(what, ": outside its q region of ", region.size, " bytes"));
      }
      jobs.push_back(Job{&j, m->second.base, q});
      out.canonical_bytes += planner::BoxVolume(j.box) * es;
      out.wire_bytes += j.elements_bytes + j.scales_bytes;
    }
  }
  out.ops = static_cast<int64_t>(jobs.size());
  out.hold = buffers;
  const absl::Time t0 = absl::Now();
  const size_t threads = std::min<size_t>(jobs.size(), std::max<size_t>(1, std::min<size_t>(max_threads_, std::thread::hardware_concurrency())));
  absl::Mutex mu;
  absl::Status first;
  ParallelFor(jobs.size(), threads, [&](size_t i) {
    {
      absl::MutexLock l(&mu);
      if (!first.ok()) return;
    }
    absl::Status s;
    if (absl::Now() > deadline) {
      s = absl::DeadlineExceededError(absl::StrCat(label, ": sender-side quantisation did not finish before the transfer deadline"));
    } else {
      const QuantJob& j = *jobs[i].job;
      const int es = planner::DTypeSize(inventory.tensors[static_cast<size_t>(j.src.tensor)].dtype);
      // The box row-major in the canonical dtype (what a receiver's shadow would hold), then the
      // receiver's quantiser over a piece that is exactly the box, written into the q region.
      std::vector<uint8_t> canonical(static_cast<size_t>(planner::BoxVolume(j.box) * es));
      GatherBox(jobs[i].src, j.src, j.box, es, canonical.data());
      planner::Piece piece;
      piece.tensor = j.src.tensor;
      piece.box = j.box;
      piece.offset_bytes = 0;
      std::vector<int64_t> extents;
      for (size_t d = 0; d < j.box.begin.size(); ++d) extents.push_back(j.box.end[d] - j.box.begin[d]);
      piece.strides = planner::ContiguousStrides(extents);
      piece.quant = j.quant;
      piece.quant->scale_buffer = 0;
      piece.quant->scale_offset_bytes = 0;
      s = QuantizePiece(inventory, piece, canonical.data(), jobs[i].q + j.elements_offset, jobs[i].q + j.scales_offset);
      if (!s.ok()) s = absl::Status(s.code(), absl::StrCat(label, ": op ", j.op_index, ": ", s.message()));
    }
    if (!s.ok()) {
      absl::MutexLock l(&mu);
      if (first.ok()) first = s;
    }
  });
  RETURN_IF_ERROR(first);
  out.seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  out.threads = static_cast<int>(threads);
  return out;
}

absl::Status DigestSenderQuantized(const Slice& slice, const std::string& me, const std::map<std::string, digest::RegionBytes>& regions,
                                   int threads, absl::Time deadline, digest::OpDigests& digests) {
  bool any = false;
  for (const SliceOp& op : slice.ops) any = any || op.sender_quantized;
  if (!any) return absl::OkStatus();
  ASSIGN_OR_RETURN(SenderQuant sq, PlanSenderQuant(slice, me));
  auto local = [&](uint32_t w) { return w < slice.workers.size() && slice.workers[w].node_id == me; };
  std::vector<digest::StridedBox> boxes;
  struct Want {
    std::map<uint32_t, digest::Digest>* into;
    uint32_t op;
    size_t elements;  // index into boxes; the scales are the next one
  };
  std::vector<Want> wanted;
  // The box a copy side covers, from its region's host bytes; false when it is device memory.
  auto add = [&](uint32_t op, const std::string& key, const transport::CopyOp& c, const transport::StridedRef& ref) -> absl::StatusOr<bool> {
    auto r = regions.find(key);
    if (r == regions.end()) return absl::InternalError(absl::StrCat("digests: sender-quantised op ", op, ": region ", key, " is not a region of node ", me));
    if (r->second.host == nullptr) return false;
    int64_t last = ref.offset_bytes;
    bool empty = false;
    for (size_t d = 0; d < c.shape.size(); ++d) {
      empty = empty || c.shape[d] <= 0;
      last += (c.shape[d] - 1) * ref.strides[d] * c.element_size;
    }
    if (!empty && (ref.offset_bytes < 0 || last + c.element_size > r->second.size)) {
      return absl::InternalError(absl::StrCat("digests: sender-quantised op ", op, ": reaches byte ", last + c.element_size, " of region ", key,
                                              " (", r->second.size, " bytes)"));
    }
    boxes.push_back({empty ? nullptr : r->second.host + ref.offset_bytes, c.shape, ref.strides, c.element_size});
    return true;
  };
  std::map<uint32_t, const SliceOp*> by_index;
  for (const SliceOp& o : slice.ops) by_index[o.index] = &o;
  for (const auto& [index, copies] : sq.copies) {
    const SliceOp* op = by_index.at(index);  // PlanSenderQuant made copies for slice ops only
    const auto& [el, sc] = copies;
    for (bool src : {true, false}) {
      if (!local(src ? op->src_worker : op->dst_worker)) continue;
      const size_t at = boxes.size();
      ASSIGN_OR_RETURN(bool a, add(index, src ? el.src_key : el.dst_key, el.copy, src ? el.copy.src : el.copy.dst));
      ASSIGN_OR_RETURN(bool b, add(index, src ? sc.src_key : sc.dst_key, sc.copy, src ? sc.copy.src : sc.copy.dst));
      std::map<uint32_t, digest::Digest>& into = src ? digests.source : digests.landed;
      if (!a || !b) {
        boxes.resize(at);
        into.erase(index);
        ++digests.skipped_sides;
        continue;
      }
      wanted.push_back({&into, index, at});
    }
  }
  ASSIGN_OR_RETURN(std::vector<digest::Digest> d, digest::DigestMany(boxes, threads, deadline));
  for (const Want& w : wanted) {
    const uint64_t pair[2] = {d[w.elements], d[w.elements + 1]};
    ASSIGN_OR_RETURN((*w.into)[w.op], digest::BoxDigest({reinterpret_cast<const uint8_t*>(pair), {2}, {1}, 8}));
  }
  for (const digest::StridedBox& b : boxes) {
    int64_t n = b.element_size;
    for (int64_t x : b.shape) n *= std::max<int64_t>(x, 0);
    digests.bytes += n;
  }
  return absl::OkStatus();
}

}  // namespace wb::daemon::node
