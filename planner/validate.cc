#include "planner/validate.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/box.h"
#include "planner/grid.h"
#include "planner/quantized.h"
#include "base/status_macros.h"

namespace wb::planner {

namespace {

// Caps the bytes-run enumeration used to settle overlapping extents of strided pieces.
constexpr int64_t kMaxRuns = int64_t{1} << 22;

std::string Where(absl::string_view worker, const Inventory& inv, const Piece& p, size_t index) {
  std::string tensor = (p.tensor >= 0 && static_cast<size_t>(p.tensor) < inv.tensors.size())
                           ? inv.tensors[p.tensor].name
                           : absl::StrCat("#", p.tensor);
  const std::string box =
      p.box.begin.size() == p.box.end.size() ? BoxToString(p.box) : std::string("<malformed box>");
  return absl::StrCat("worker `", worker, "` piece ", index, " (tensor `", tensor, "` box ", box, ")");
}

struct Extent {
  int64_t lo, hi;  // bytes [lo, hi)
  size_t piece;
  bool scales = false;  // the piece's scale region (one contiguous run), not its elements
};

// Contiguous byte runs of a (validated, non-aliasing) piece.
void AppendRuns(const Piece& p, int es, size_t piece, std::vector<Extent>& out) {
  const size_t r = p.strides.size();
  std::vector<size_t> dims;
  for (size_t d = 0; d < r; ++d) {
    if (p.box.end[d] - p.box.begin[d] > 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(), [&](size_t a, size_t b) { return p.strides[a] < p.strides[b]; });
  // Merge the innermost dims while they are dense.
  int64_t run = 1;  // elements
  size_t k = 0;
  while (k < dims.size() && p.strides[dims[k]] == run) {
    run *= p.box.end[dims[k]] - p.box.begin[dims[k]];
    ++k;
  }
  std::vector<size_t> outer(dims.begin() + k, dims.end());
  std::vector<int64_t> idx(outer.size(), 0);
  while (true) {
    int64_t off = p.offset_bytes;
    for (size_t i = 0; i < outer.size(); ++i) off += idx[i] * p.strides[outer[i]] * es;
    out.push_back(Extent{off, off + run * es, piece});
    size_t i = 0;
    for (; i < outer.size(); ++i) {
      if (++idx[i] < p.box.end[outer[i]] - p.box.begin[outer[i]]) break;
      idx[i] = 0;
    }
    if (i == outer.size()) break;
  }
}

int64_t RunCount(const Piece& p) {
  const size_t r = p.strides.size();
  std::vector<size_t> dims;
  for (size_t d = 0; d < r; ++d) {
    if (p.box.end[d] - p.box.begin[d] > 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(), [&](size_t a, size_t b) { return p.strides[a] < p.strides[b]; });
  int64_t run = 1, vol = BoxVolume(p.box);
  for (size_t k = 0; k < dims.size() && p.strides[dims[k]] == run; ++k) run *= p.box.end[dims[k]] - p.box.begin[dims[k]];
  return vol / run;
}

// Dims >= 0 and at most 2^62 elements, so that volumes and byte offsets inside the tensor fit int64.
bool ShapeFits(const std::vector<int64_t>& shape) {
  int64_t v = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && v > (int64_t{1} << 62) / d)) return false;
    v *= d;
  }
  return true;
}

}  // namespace

absl::Status ValidateLayout(const Inventory& inv, const WorkerLayout& layout, Role role, absl::string_view worker) {
  for (size_t b = 0; b < layout.buffers.size(); ++b) {
    if (layout.buffers[b].size_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("worker `", worker, "` buffer ", b, " has negative size"));
    }
  }
  std::vector<std::vector<Extent>> extents(layout.buffers.size());
  std::set<std::pair<int32_t, int64_t>> global_scales;  // (scale buffer, offset) of NVFP4 global scales
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    const Piece& p = layout.pieces[i];
    if (p.tensor < 0 || static_cast<size_t>(p.tensor) >= inv.tensors.size()) {
      return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": no such tensor"));
    }
    const TensorSpec& t = inv.tensors[p.tensor];
    const size_t r = t.shape.size();
    if (p.box.begin.size() != r || p.box.end.size() != r || p.strides.size() != r) {
      return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": rank mismatch (tensor rank ", r,
                                                     ", box rank ", p.box.begin.size(), "/", p.box.end.size(),
                                                     ", strides rank ", p.strides.size(), ")"));
    }
    if (!ShapeFits(t.shape)) {
      return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": tensor shape ",
                                                     BoxToString(FullBox(t.shape)),
                                                     " has a negative dim or more than 2^62 elements"));
    }
    if (!BoxInside(p.box, t.shape)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(worker, inv, p, i), ": box outside the tensor shape ", BoxToString(FullBox(t.shape))));
    }
    if (BoxEmpty(p.box)) return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": empty box"));
    if (DTypeSize(t.dtype) <= 0) return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": invalid dtype"));
    if (p.quant.has_value() && role != Role::kRollout) {
      return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i),
                                                     ": only rollout workers may hold a quantised piece"));
    }
    if (p.quant.has_value() && p.quant->dtype != DType::kF8E4M3 && p.quant->dtype != DType::kI4 && p.quant->dtype != DType::kF4E2M1) {
      return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": quantised dtype ", DTypeName(p.quant->dtype),
                                                     " is not supported (float8_e4m3, int4 or float4_e2m1)"));
    }
    // Bounds are checked on the bytes the piece occupies (int4: two elements per byte).
    RETURN_IF_ERROR(CheckInt4Packing(p, Where(worker, inv, p, i)));
    const ByteView view = StoredBytes(inv, p);
    const Piece& bp = view.piece;
    const int es = view.element_size;
    if (p.buffer < 0 || static_cast<size_t>(p.buffer) >= layout.buffers.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(worker, inv, p, i), ": buffer ", p.buffer, " not registered (", layout.buffers.size(),
                       " buffers)"));
    }
    if (p.offset_bytes < 0 || p.offset_bytes % es != 0) {
      return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": offset ", p.offset_bytes,
                                                     " negative or not a multiple of the element size ", es));
    }
    // Strides: non-negative and nested (no two elements share an address).
    std::vector<size_t> dims;
    for (size_t d = 0; d < r; ++d) {
      if (bp.strides[d] < 0) {
        return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": negative stride"));
      }
      if (bp.box.end[d] - bp.box.begin[d] > 1) dims.push_back(d);
    }
    std::sort(dims.begin(), dims.end(), [&](size_t a, size_t b) { return bp.strides[a] < bp.strides[b]; });
    int64_t span = 0;  // elements: max offset reachable by the dims processed so far
    for (size_t d : dims) {
      if (bp.strides[d] <= span) {
        return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": strides alias elements"));
      }
      const int64_t ext = bp.box.end[d] - bp.box.begin[d];
      if (bp.strides[d] > (int64_t{1} << 62) / ext) {
        return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": strides overflow"));
      }
      // Each term is <= 2^62 (checked above) but their sum over several dims may not fit.
      if (__builtin_add_overflow(span, (ext - 1) * bp.strides[d], &span)) {
        return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": strides overflow"));
      }
    }
    int64_t last = 0;  // one past the farthest element's last byte
    if (__builtin_add_overflow(span, 1, &last) || __builtin_mul_overflow(last, es, &last) ||
        __builtin_add_overflow(last, p.offset_bytes, &last)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(worker, inv, p, i), ": offset ", p.offset_bytes, " + extent overflows 64 bits"));
    }
    if (last > layout.buffers[p.buffer].size_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(Where(worker, inv, p, i), ": reaches byte ", last,
                                                     " beyond buffer ", p.buffer, " of ",
                                                     layout.buffers[p.buffer].size_bytes, " bytes"));
    }
    if (role == Role::kRollout) extents[p.buffer].push_back(Extent{p.offset_bytes, last, i});
    if (p.quant.has_value()) {
      // After the bounds checks above: the grid rules need a valid box.
      RETURN_IF_ERROR(CheckQuantization(inv, layout, p, Where(worker, inv, p, i)));
      const int64_t lo = p.quant->scale_offset_bytes;
      extents[p.quant->scale_buffer].push_back(Extent{lo, lo + ScaleCount(p) * ScaleElementSize(*p.quant), i, true});
      // An NVFP4 global scale: one float32 that every piece naming the same place shares (its
      // group), so it is one extent, added by the first piece that names it.
      const int64_t g = p.quant->global_scale_offset_bytes;
      if (g >= 0 && global_scales.insert({p.quant->scale_buffer, g}).second) {
        extents[p.quant->scale_buffer].push_back(Extent{g, g + 4, i, true});
      }
    }
  }
  if (role != Role::kRollout) return absl::OkStatus();

  // Destination pieces must not overlap. Sort extents; only clusters whose extents intersect need
  // the exact (byte-run) check, which matters for interleaved strided pieces.
  for (auto& ex : extents) {
    std::sort(ex.begin(), ex.end(), [](const Extent& a, const Extent& b) { return a.lo < b.lo; });
    size_t s = 0;
    while (s < ex.size()) {
      size_t e = s + 1;
      int64_t hi = ex[s].hi;
      while (e < ex.size() && ex[e].lo < hi) hi = std::max(hi, ex[e++].hi);
      if (e - s > 1) {
        int64_t total = 0;
        for (size_t k = s; k < e; ++k) total += ex[k].scales ? 1 : RunCount(StoredBytes(inv, layout.pieces[ex[k].piece]).piece);
        if (total > kMaxRuns) {
          const Piece& p = layout.pieces[ex[s].piece];
          return absl::InvalidArgumentError(absl::StrCat(
              Where(worker, inv, p, ex[s].piece), ": interleaves with ", e - s - 1,
              " other pieces in too many runs to verify that they do not overlap"));
        }
        std::vector<Extent> runs;
        runs.reserve(total);
        for (size_t k = s; k < e; ++k) {
          if (ex[k].scales) {
            runs.push_back(ex[k]);
            continue;
          }
          const Piece& p = layout.pieces[ex[k].piece];
          const ByteView v = StoredBytes(inv, p);
          AppendRuns(v.piece, v.element_size, ex[k].piece, runs);
        }
        std::sort(runs.begin(), runs.end(), [](const Extent& a, const Extent& b) { return a.lo < b.lo; });
        for (size_t k = 1; k < runs.size(); ++k) {
          if (runs[k].lo < runs[k - 1].hi) {
            size_t a = runs[k - 1].piece, b = runs[k].piece;
            return absl::InvalidArgumentError(absl::StrCat(
                runs[k].scales ? "the scales of " : "", Where(worker, inv, layout.pieces[b], b), " overlap",
                runs[k].scales ? "" : "s", " ", runs[k - 1].scales ? "the scales of " : "",
                Where(worker, inv, layout.pieces[a], a), " at byte ", runs[k].lo));
          }
        }
      }
      s = e;
    }
  }
  return absl::OkStatus();
}

namespace {

// One piece of one worker (messages name both).
struct PieceAt {
  const Worker* worker;
  size_t index;
  const Piece& piece() const { return worker->layout.pieces[index]; }
};

struct CoverageScratch {
  TensorGrid grid;
  std::vector<int64_t> clip, lo, hi;
  std::vector<uint32_t> order;
  std::vector<uint8_t> covered;
};

// Clips `boxes` to the hull (flat: rank begins, rank ends each, into s.clip) and returns the
// indices of the distinct non-empty ones, each the first of its equals in `boxes` order.
std::vector<uint32_t> DistinctClipped(const std::vector<PieceAt>& boxes, size_t rank, CoverageScratch& s) {
  const size_t w = 2 * rank;
  s.clip.resize(boxes.size() * w);
  s.order.clear();
  for (size_t k = 0; k < boxes.size(); ++k) {
    const Box& b = boxes[k].piece().box;
    int64_t* c = s.clip.data() + k * w;
    bool empty = false;
    for (size_t d = 0; d < rank; ++d) {
      c[d] = std::max(b.begin[d], s.grid.hull_lo[d]);
      c[rank + d] = std::min(b.end[d], s.grid.hull_hi[d]);
      empty = empty || c[d] >= c[rank + d];
    }
    if (!empty) s.order.push_back(static_cast<uint32_t>(k));
  }
  auto box_of = [&](uint32_t k) { return s.clip.data() + size_t{k} * w; };
  std::sort(s.order.begin(), s.order.end(), [&](uint32_t x, uint32_t y) {
    for (size_t i = 0; i < w; ++i) {
      if (box_of(x)[i] != box_of(y)[i]) return box_of(x)[i] < box_of(y)[i];
    }
    return x < y;
  });
  std::vector<uint32_t> distinct;
  for (size_t i = 0; i < s.order.size(); ++i) {
    if (i == 0 || !std::equal(box_of(s.order[i]), box_of(s.order[i]) + w, box_of(s.order[i - 1]))) {
      distinct.push_back(s.order[i]);
    }
  }
  return distinct;
}

// Grid index range of clipped box k (s.clip) into s.lo / s.hi; returns the cells it covers.
int64_t IndexRange(uint32_t k, size_t rank, CoverageScratch& s) {
  return s.grid.IndexRange(s.clip.data() + size_t{k} * 2 * rank, s.lo.data(), s.hi.data());
}

// Tensor t's grid (planner/grid.h, the one BuildFragments uses): breakpoints of the needed boxes
// and of the held boxes inside their hull. Returns the number of cells, RESOURCE_EXHAUSTED past
// kMaxGridCells.
absl::StatusOr<int64_t> CoverageGrid(const TensorSpec& ts, const std::vector<PieceAt>& held,
                                     const std::vector<PieceAt>& needed, CoverageScratch& s) {
  const size_t rank = ts.shape.size();
  s.grid.Reset(rank);
  for (const PieceAt& n : needed) s.grid.AddNeeded(n.piece().box);
  for (const PieceAt& h : held) s.grid.AddHeld(h.piece().box);
  const int64_t cells = s.grid.Finish();
  if (cells < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("tensor `", ts.name, "`: piece boundaries form more than 2^24 grid cells"));
  }
  s.lo.resize(rank);
  s.hi.resize(rank);
  return cells;
}

// Checks one tensor: every cell of a distinct needed box lies in a held box. Charges `work` (cells,
// then the distinct boxes' walks, before walking) against `budget`.
absl::Status CoverTensor(const Inventory& inv, const TensorSpec& ts, const std::vector<PieceAt>& held,
                         const std::vector<PieceAt>& needed, int64_t budget, int64_t* work, CoverageScratch& s) {
  const size_t rank = ts.shape.size();
  if (rank > 16) return absl::InvalidArgumentError(absl::StrCat("tensor `", ts.name, "` has rank ", rank, " (at most 16)"));
  ASSIGN_OR_RETURN(const int64_t cells, CoverageGrid(ts, held, needed, s));
  const std::vector<uint32_t> held_boxes = DistinctClipped(held, rank, s);
  std::vector<int64_t> held_clip = s.clip;  // DistinctClipped below reuses s.clip
  int64_t walk = cells, most = -1;
  uint32_t largest = 0;
  for (uint32_t k : held_boxes) {
    const int64_t vol = s.grid.IndexRange(held_clip.data() + size_t{k} * 2 * rank, s.lo.data(), s.hi.data());
    if (vol > most) {
      most = vol;
      largest = k;
    }
    walk += vol;
  }
  const std::vector<uint32_t> needed_boxes = DistinctClipped(needed, rank, s);
  for (uint32_t k : needed_boxes) walk += IndexRange(k, rank, s);
  if (__builtin_add_overflow(*work, walk, work) || *work > budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tensor `", ts.name, "`", held_boxes.empty() ? "" : " (largest source box: ",
        held_boxes.empty() ? "" : Where(held[largest].worker->id, inv, held[largest].piece(), held[largest].index),
        held_boxes.empty() ? "" : ")", ": checking coverage of ", needed_boxes.size(), " distinct boxes by ",
        held_boxes.size(), " distinct source boxes over ", walk, " cells exceeds the work budget of ", budget,
        " units (docs/planner.md \"Work bounds\")"));
  }
  s.covered.assign(cells, 0);
  for (uint32_t k : held_boxes) {
    s.grid.IndexRange(held_clip.data() + size_t{k} * 2 * rank, s.lo.data(), s.hi.data());
    ForEachGridCell(s.grid.dims, s.lo.data(), s.hi.data(), [&](int64_t x) { s.covered[x] = 1; });
  }
  // Report the first uncovered piece in destination order (needed_boxes are the first of equals).
  uint32_t bad = std::numeric_limits<uint32_t>::max();
  int64_t bad_cell = -1;
  for (uint32_t k : needed_boxes) {
    if (k > bad) continue;
    IndexRange(k, rank, s);
    int64_t first = -1;
    ForEachGridCell(s.grid.dims, s.lo.data(), s.hi.data(), [&](int64_t x) {
      if (first < 0 && !s.covered[x]) first = x;
    });
    if (first >= 0) {
      bad = k;
      bad_cell = first;
    }
  }
  if (bad_cell < 0) return absl::OkStatus();
  Box cell;
  for (size_t d = rank; d-- > 0;) {
    const int64_t i = bad_cell % s.grid.dims[d];
    bad_cell /= s.grid.dims[d];
    cell.begin.insert(cell.begin.begin(), s.grid.bp[d][i]);
    cell.end.insert(cell.end.begin(), s.grid.bp[d][i + 1]);
  }
  const PieceAt& n = needed[bad];
  return absl::InvalidArgumentError(
      absl::StrCat(Where(n.worker->id, inv, n.piece(), n.index), ": elements ", BoxToString(cell), " are held by no source"));
}

}  // namespace

absl::Status ValidateCoverage(const Inventory& inv, const std::vector<const Worker*>& sources,
                              const std::vector<const Worker*>& destinations, int64_t work_budget) {
  const size_t nt = inv.tensors.size();
  std::vector<std::vector<PieceAt>> held(nt), needed(nt);
  int64_t pieces = 0;
  for (const Worker* w : sources) {
    for (size_t i = 0; i < w->layout.pieces.size(); ++i) {
      const Piece& p = w->layout.pieces[i];
      ++pieces;
      // Malformed sources hold nothing (layouts are validated before; this keeps the grid in range).
      if (p.tensor < 0 || static_cast<size_t>(p.tensor) >= nt) continue;
      const size_t rank = inv.tensors[p.tensor].shape.size();
      if (p.box.begin.size() == rank && p.box.end.size() == rank) held[p.tensor].push_back({w, i});
    }
  }
  for (const Worker* w : destinations) {
    for (size_t i = 0; i < w->layout.pieces.size(); ++i) {
      const Piece& p = w->layout.pieces[i];
      ++pieces;
      if (p.tensor < 0 || static_cast<size_t>(p.tensor) >= nt) {
        return absl::InvalidArgumentError(absl::StrCat(Where(w->id, inv, p, i), ": no such tensor"));
      }
      const size_t rank = inv.tensors[p.tensor].shape.size();
      if (p.box.begin.size() != rank || p.box.end.size() != rank) {
        return absl::InvalidArgumentError(absl::StrCat(Where(w->id, inv, p, i), ": rank mismatch"));
      }
      needed[p.tensor].push_back({w, i});
    }
  }
  const int64_t budget = work_budget > 0 ? work_budget : CoverageWorkBudget(pieces);
  int64_t work = 0;
  CoverageScratch s;
  for (size_t t = 0; t < nt; ++t) {
    if (needed[t].empty()) continue;
    RETURN_IF_ERROR(CoverTensor(inv, inv.tensors[t], held[t], needed[t], budget, &work, s));
  }
  return absl::OkStatus();
}

absl::Status ValidateProblem(const Problem& problem) {
  std::vector<const Worker*> sources, destinations;
  for (const Worker& w : problem.workers) {
    RETURN_IF_ERROR(ValidateLayout(problem.inventory, w.layout, w.role, w.id));
    (w.role == Role::kTrainer ? sources : destinations).push_back(&w);
  }
  return ValidateCoverage(problem.inventory, sources, destinations);
}

}  // namespace wb::planner
