#include "planner/validate.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/box.h"
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

// Appends (rem - cut) to `out` (rem and cut intersect in `in`).
void Subtract(Box rem, const Box& in, std::vector<Box>& out) {
  for (size_t d = 0; d < rem.begin.size(); ++d) {
    if (rem.begin[d] < in.begin[d]) {
      Box b = rem;
      b.end[d] = in.begin[d];
      out.push_back(std::move(b));
      rem.begin[d] = in.begin[d];
    }
    if (in.end[d] < rem.end[d]) {
      Box b = rem;
      b.begin[d] = in.end[d];
      out.push_back(std::move(b));
      rem.end[d] = in.end[d];
    }
  }
}

bool BoxLess(const Box& a, const Box& b) {
  if (a.begin != b.begin) return a.begin < b.begin;
  return a.end < b.end;
}

}  // namespace

absl::Status ValidateCoverage(const Inventory& inv, const std::vector<const Worker*>& sources,
                              const std::vector<const Worker*>& destinations) {
  const size_t nt = inv.tensors.size();
  std::vector<std::vector<Box>> held(nt);
  for (const Worker* w : sources) {
    for (const Piece& p : w->layout.pieces) {
      if (p.tensor >= 0 && static_cast<size_t>(p.tensor) < nt) held[p.tensor].push_back(p.box);
    }
  }
  for (auto& boxes : held) {
    std::sort(boxes.begin(), boxes.end(), BoxLess);
    boxes.erase(std::unique(boxes.begin(), boxes.end(), BoxEqual), boxes.end());
  }
  std::vector<Box> rem, next;
  for (const Worker* w : destinations) {
    for (size_t i = 0; i < w->layout.pieces.size(); ++i) {
      const Piece& p = w->layout.pieces[i];
      if (p.tensor < 0 || static_cast<size_t>(p.tensor) >= nt) {
        return absl::InvalidArgumentError(absl::StrCat(Where(w->id, inv, p, i), ": no such tensor"));
      }
      const std::vector<Box>& src = held[p.tensor];
      bool covered = false;
      for (const Box& s : src) {
        if (BoxContains(s, p.box)) {
          covered = true;
          break;
        }
      }
      if (covered) continue;
      rem.assign(1, p.box);
      for (const Box& s : src) {
        if (rem.empty()) break;
        next.clear();
        for (const Box& r : rem) {
          std::optional<Box> in = Intersect(r, s);
          if (!in) {
            next.push_back(r);
          } else {
            Subtract(r, *in, next);
          }
        }
        std::swap(rem, next);
      }
      if (!rem.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(Where(w->id, inv, p, i), ": elements ",
                                                       BoxToString(rem[0]), " are held by no source"));
      }
    }
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
