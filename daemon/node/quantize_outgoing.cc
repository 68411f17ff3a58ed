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

struct OutgoingQuantization::Chunk {
  uint32_t bucket = 0;
  size_t job = 0;          // index into jobs_
  const uint8_t* src = nullptr;  // base of the source region
  uint8_t* q = nullptr;          // base of the q region
  int64_t lo = 0, hi = 0;  // dim-0 rows of the job's box, relative to its begin
  int64_t elements_offset = 0, scales_offset = 0;  // in the q region
  int es = 0;                                      // canonical element size
};

namespace {

std::string TensorName(const planner::Inventory& inventory, int32_t tensor) {
  return tensor >= 0 && static_cast<size_t>(tensor) < inventory.tensors.size() ? inventory.tensors[static_cast<size_t>(tensor)].name : "?";
}

// The dim-0 row ranges a job's box is cut into, each of whole block rows (the last may end at the
// box's end) with its elements' and scales' byte offsets in the job's q bytes. One range (the whole
// box) where the byte arithmetic does not divide evenly (never for today's formats).
struct Cut {
  int64_t lo, hi, elements, scales;
};
std::vector<Cut> CutRows(const QuantJob& j, int es, int64_t chunk_bytes) {
  const size_t rank = j.box.begin.size();
  std::vector<Cut> whole = {{0, rank == 0 ? 1 : j.box.end[0] - j.box.begin[0], 0, 0}};
  if (rank == 0 || j.quant.block.size() != rank || j.quant.block[0] <= 0) return whole;
  const int64_t rows = j.box.end[0] - j.box.begin[0];
  int64_t inner = 1;  // elements per dim-0 row
  for (size_t d = 1; d < rank; ++d) inner *= j.box.end[d] - j.box.begin[d];
  const int64_t bits = j.quant.dtype == planner::DType::kI4 ? 4 : 8;
  const int64_t b0 = j.quant.block[0];
  const int64_t grid0 = (rows + b0 - 1) / b0;
  if (rows <= 0 || inner <= 0 || rows * inner * bits != j.elements_bytes * 8 || j.scales_bytes % grid0 != 0) return whole;
  const int64_t per_grid_row = j.scales_bytes / grid0;
  const int64_t step = b0 * std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(1, b0 * inner * es));
  std::vector<Cut> cuts;
  for (int64_t lo = 0; lo < rows; lo += step) {
    if ((lo * inner * bits) % 8 != 0) return whole;
    cuts.push_back({lo, std::min(rows, lo + step), lo * inner * bits / 8, lo / b0 * per_grid_row});
  }
  return cuts;
}

// Source rows [lo, hi) of the job's box: a contiguous row-major run in the source buffer (its
// address), or null when they must be gathered.
const uint8_t* ContiguousRows(const uint8_t* base, const planner::Piece& src, const planner::Box& box, int64_t lo, int es) {
  const size_t rank = box.begin.size();
  if (src.strides.size() != rank || rank == 0 || src.strides[rank - 1] != 1) return nullptr;
  for (size_t d = 1; d < rank; ++d) {
    if (src.strides[d - 1] != src.strides[d] * (box.end[d] - box.begin[d])) return nullptr;
  }
  int64_t off = 0;
  for (size_t d = 0; d < rank; ++d) off += (box.begin[d] + (d == 0 ? lo : 0) - src.box.begin[d]) * src.strides[d];
  return base + src.offset_bytes + off * es;
}

}  // namespace

OutgoingQuantization::OutgoingQuantization(const planner::Inventory& inventory, std::string label, absl::Time deadline)
    : inventory_(inventory), label_(std::move(label)), deadline_(deadline), start_(absl::Now()) {}

absl::StatusOr<std::unique_ptr<OutgoingQuantization>> OutgoingQuantization::Start(const planner::Inventory& inventory,
                                                                                  const std::map<std::string, QuantRegion>& regions,
                                                                                  const std::map<uint32_t, uint32_t>& bucket_of,
                                                                                  const std::map<std::string, RegionMemory>& memory,
                                                                                  const std::string& label, absl::Time deadline,
                                                                                  const OutgoingOptions& options) {
  std::unique_ptr<OutgoingQuantization> out(new OutgoingQuantization(inventory, label, deadline));
  if (regions.empty()) return out;
  // Checked before anything is charged or allocated.
  int64_t total = 0;
  for (const auto& [key, region] : regions) {
    total += std::max<int64_t>(region.size, 1);
    for (const QuantJob& j : region.jobs) {
      const std::string what = absl::StrCat(label, ": sender-side quantisation of op ", j.op_index, " (tensor ", TensorName(inventory, j.src.tensor),
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
    }
  }
  // Charged like incoming staging, for as long as the q memory lives (the charge travels in hold).
  std::shared_ptr<StagingBudget::Charge> charge;
  if (options.budget != nullptr) {
    ASSIGN_OR_RETURN(charge, options.budget->Reserve(total, absl::StrCat(label, " outgoing quantised staging (sender-side quantisation, ",
                                                                         regions.size(), " q region(s))")));
  }
  auto holds = std::make_shared<std::vector<std::shared_ptr<void>>>();
  std::map<std::string, uint8_t*> q_base;
  for (const auto& [key, region] : regions) {
    const int64_t size = std::max<int64_t>(region.size, 1);
    QStaging q;
    if (options.allocate) {
      ASSIGN_OR_RETURN(q, options.allocate(size, absl::StrCat(label, " outgoing ", key)));
    } else {
      // Uninitialised: every byte a copy reads is written (gaps are alignment only).
      std::shared_ptr<uint8_t[]> mem(new uint8_t[static_cast<size_t>(size)]);
      q = QStaging{mem.get(), mem};
    }
    if (q.base == nullptr) return absl::InternalError(absl::StrCat(label, ": no memory for outgoing ", key));
    holds->push_back(q.hold);
    q_base[key] = q.base;
    out->regions_[key] = RegionMemory{transport::MemoryKind::kHost, q.base, region.size, -1, {}};
  }
  holds->push_back(std::move(charge));  // after the memory: released once it is gone
  out->hold_ = holds;
  for (const auto& [key, region] : regions) {
    for (const QuantJob& j : region.jobs) {
      const size_t job = out->jobs_.size();
      out->jobs_.push_back(j);
      const int es = planner::DTypeSize(inventory.tensors[static_cast<size_t>(j.src.tensor)].dtype);
      auto b = bucket_of.find(j.op_index);
      const uint32_t bucket = b == bucket_of.end() ? 0 : b->second;
      for (const Cut& c : CutRows(j, es, options.chunk_bytes)) {
        out->chunks_.push_back(Chunk{bucket, job, memory.at(j.src_key).base, q_base.at(key), c.lo, c.hi, j.elements_offset + c.elements,
                                     j.scales_offset + c.scales, es});
      }
      ++out->base_.ops;
      out->base_.canonical_bytes += planner::BoxVolume(j.box) * es;
      out->base_.wire_bytes += j.elements_bytes + j.scales_bytes;
    }
  }
  // Bucket order (stable: op order within a bucket), so the first bucket's chunks go first.
  std::stable_sort(out->chunks_.begin(), out->chunks_.end(), [](const Chunk& x, const Chunk& y) { return x.bucket < y.bucket; });
  out->base_.chunks = static_cast<int64_t>(out->chunks_.size());
  {
    absl::MutexLock l(&out->mu_);
    for (const Chunk& c : out->chunks_) ++out->remaining_[c.bucket];
    out->last_done_ = out->start_;
  }
  const size_t threads = std::min<size_t>(out->chunks_.size(), HardwareThreads(static_cast<size_t>(std::max(1, options.max_threads))));
  out->base_.threads = static_cast<int>(threads);
  out->before_chunk_ = options.before_chunk;
  for (size_t t = 0; t < threads; ++t) out->threads_.emplace_back([p = out.get()] { p->Work(); });
  return out;
}

OutgoingQuantization::~OutgoingQuantization() {
  stop_ = true;
  for (std::thread& t : threads_) t.join();
}

absl::Status OutgoingQuantization::Run(const Chunk& c, std::vector<uint8_t>& scratch, int64_t& gathered) const {
  const QuantJob& j = jobs_[c.job];
  planner::Piece piece;  // exactly the chunk's rows, row-major
  piece.tensor = j.src.tensor;
  piece.box = j.box;
  const size_t rank = j.box.begin.size();
  if (rank > 0) {
    piece.box.begin[0] = j.box.begin[0] + c.lo;
    piece.box.end[0] = j.box.begin[0] + c.hi;
  }
  std::vector<int64_t> extents;
  for (size_t d = 0; d < rank; ++d) extents.push_back(piece.box.end[d] - piece.box.begin[d]);
  piece.strides = planner::ContiguousStrides(extents);
  piece.offset_bytes = 0;
  piece.quant = j.quant;
  piece.quant->scale_buffer = 0;
  piece.quant->scale_offset_bytes = 0;
  const uint8_t* canonical = ContiguousRows(c.src, j.src, j.box, c.lo, c.es);
  if (canonical == nullptr) {
    const size_t n = static_cast<size_t>(planner::BoxVolume(piece.box) * c.es);
    if (scratch.size() < n) scratch.resize(n);  // reused across chunks: no per-chunk allocation
    GatherBox(c.src, j.src, piece.box, c.es, scratch.data());
    canonical = scratch.data();
    gathered += static_cast<int64_t>(n);
  }
  absl::Status s = QuantizePiece(inventory_, piece, canonical, c.q + c.elements_offset, c.q + c.scales_offset);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(label_, ": sender-side quantisation of op ", j.op_index, " (tensor ", TensorName(inventory_, j.src.tensor),
                                               " rows ", piece.box.begin.empty() ? 0 : piece.box.begin[0], "..",
                                               piece.box.end.empty() ? 0 : piece.box.end[0], "): ", s.message()));
  }
  return absl::OkStatus();
}

void OutgoingQuantization::Work() {
  std::vector<uint8_t> scratch;
  for (size_t i = next_.fetch_add(1); i < chunks_.size(); i = next_.fetch_add(1)) {
    const Chunk& c = chunks_[i];
    absl::Status s;
    int64_t gathered = 0;
    bool failed;
    {
      absl::MutexLock l(&mu_);
      failed = !error_.ok();
    }
    if (stop_ || failed) {
      s = absl::CancelledError(absl::StrCat(label_, ": sender-side quantisation stopped"));
    } else if (absl::Now() > deadline_) {
      s = absl::DeadlineExceededError(absl::StrCat(label_, ": sender-side quantisation did not finish before the transfer deadline"));
    } else {
      if (before_chunk_) before_chunk_(c.bucket);
      s = Run(c, scratch, gathered);
    }
    absl::MutexLock l(&mu_);
    if (!s.ok() && error_.ok()) error_ = s;
    --remaining_[c.bucket];
    gathered_ += gathered;
    if (s.ok()) last_done_ = absl::Now();
  }
}

absl::Status OutgoingQuantization::Wait(uint32_t bucket, bool executor) {
  const absl::Time t0 = absl::Now();
  absl::MutexLock l(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!error_.ok()) return true;
    for (const auto& [b, n] : remaining_) {
      if (b > bucket) break;
      if (n > 0) return false;
    }
    return true;
  };
  const bool done = mu_.AwaitWithDeadline(absl::Condition(&ready), deadline_);
  if (executor) waited_ += absl::Now() - t0;
  if (!error_.ok()) return error_;
  if (!done) {
    return absl::DeadlineExceededError(
        absl::StrCat(label_, ": sender-side quantisation of bucket ", bucket, " did not finish before the transfer deadline"));
  }
  return absl::OkStatus();
}

OutgoingQuantization::Stats OutgoingQuantization::stats() const {
  Stats s = base_;
  absl::MutexLock l(&mu_);
  s.gathered_bytes = gathered_;
  s.seconds = absl::ToDoubleSeconds(last_done_ - start_);
  s.waited_seconds = absl::ToDoubleSeconds(waited_);
  return s;
}

std::map<uint32_t, uint32_t> QuantBuckets(const ExecPlan& plan) {
  std::map<uint32_t, uint32_t> out;
  for (uint32_t b = 0; b < plan.buckets.size(); ++b) {
    for (const Route& r : plan.buckets[b].routes) {
      for (const RouteOp& op : r.ops) {
        if (op.part == RouteOp::Part::kCanonical || plan.quant_out.count(op.src_key) == 0) continue;
        out.emplace(op.op_index, b);  // buckets ascend: the first one stays
      }
    }
  }
  return out;
}

absl::StatusOr<OutgoingStaging> OutgoingQuantizer::Quantize(const planner::Inventory& inventory,
                                                            const std::map<std::string, QuantRegion>& regions,
                                                            const std::map<std::string, RegionMemory>& memory, const std::string& label,
                                                            absl::Time deadline) const {
  OutgoingOptions o;
  o.max_threads = max_threads_;
  ASSIGN_OR_RETURN(std::unique_ptr<OutgoingQuantization> q, OutgoingQuantization::Start(inventory, regions, {}, memory, label, deadline, o));
  RETURN_IF_ERROR(q->WaitAll());
  const OutgoingQuantization::Stats st = q->stats();
  OutgoingStaging out;
  out.regions = q->regions();
  out.hold = q->hold();
  out.ops = st.ops;
  out.canonical_bytes = st.canonical_bytes;
  out.wire_bytes = st.wire_bytes;
  out.seconds = st.seconds;
  out.threads = st.threads;
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
  for (const Want& w : wanted) (*w.into)[w.op] = digest::QuantizedDigest(d[w.elements], d[w.elements + 1]);
  for (const digest::StridedBox& b : boxes) {
    int64_t n = b.element_size;
    for (int64_t x : b.shape) n *= std::max<int64_t>(x, 0);
    digests.bytes += n;
  }
  return absl::OkStatus();
}

}  // namespace wb::daemon::node
