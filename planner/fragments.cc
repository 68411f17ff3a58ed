#include "planner/fragments.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "planner/box.h"

namespace wb::planner {
namespace {

inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Calls fn(cell_index) for every cell of the index box [lo, hi) of a row-major grid with `dims`.
template <typename Fn>
void ForEachCell(const std::vector<int64_t>& dims, const int64_t* lo, const int64_t* hi, Fn&& fn) {
  const size_t rank = dims.size();
  for (size_t d = 0; d < rank; ++d) {
    if (lo[d] >= hi[d]) return;
  }
  if (rank == 0) {
    fn(0);
    return;
  }
  int64_t idx[16];
  for (size_t d = 0; d < rank; ++d) idx[d] = lo[d];
  while (true) {
    int64_t c = 0;
    for (size_t d = 0; d < rank; ++d) c = c * dims[d] + idx[d];
    // The last dimension is contiguous in cell order.
    const int64_t run = hi[rank - 1] - lo[rank - 1];
    for (int64_t k = 0; k < run; ++k) fn(c + k);
    if (rank == 1) return;
    size_t d = rank - 2;
    while (true) {
      if (++idx[d] < hi[d]) break;
      idx[d] = lo[d];
      if (d == 0) return;
      --d;
    }
  }
}

struct Scratch {
  std::vector<std::vector<int64_t>> bp;
  std::vector<int64_t> dims;
  std::vector<uint64_t> sig_a, sig_b;
  std::vector<int32_t> dcount, scount;
  std::vector<uint8_t> assigned;
  std::vector<int64_t> lo, hi, hull_lo, hull_hi, idx, ext, slab_lo, slab_hi;
};

// Allocation-free: do two boxes of equal rank share an element?
bool Overlaps(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.begin.size(); ++d) {
    if (std::max(a.begin[d], b.begin[d]) >= std::min(a.end[d], b.end[d])) return false;
  }
  return true;
}

std::string PieceName(const Problem& p, PieceRef r) {
  return absl::StrCat("worker ", p.workers[r.worker].id, " piece ", r.piece);
}

}  // namespace

std::vector<Box> SplitBox(const Box& box, int64_t n, const std::vector<int64_t>* quantum) {
  std::vector<Box> out;
  size_t dim = 0;
  while (dim < box.begin.size() && box.end[dim] - box.begin[dim] <= 1) ++dim;
  if (n <= 1 || dim == box.begin.size()) {
    out.push_back(box);
    return out;
  }
  const int64_t extent = box.end[dim] - box.begin[dim];
  // Cut on multiples of the quantum (when the box starts on one), in units of whole quanta.
  int64_t q = 1;
  if (quantum != nullptr && dim < quantum->size() && (*quantum)[dim] > 1 && box.begin[dim] % (*quantum)[dim] == 0) {
    q = (*quantum)[dim];
  }
  const int64_t units = (extent + q - 1) / q;
  n = std::min(n, units);
  for (int64_t i = 0; i < n; ++i) {
    Box b = box;
    b.begin[dim] = box.begin[dim] + std::min(extent, units * i / n * q);
    b.end[dim] = box.begin[dim] + std::min(extent, units * (i + 1) / n * q);
    out.push_back(std::move(b));
  }
  return out;
}

namespace {

// Every worker's non-empty pieces indexed per tensor (CSR: tensor t's are [off[t], off[t + 1])),
// sources and destinations apart, in worker order.
struct PieceIndex {
  std::vector<uint32_t> src_off, dst_off;
  std::vector<PieceRef> srcs, dsts;
};

const Box& BoxOf(const Problem& p, PieceRef r) { return p.workers[r.worker].layout.pieces[r.piece].box; }

// Validates every piece (a known tensor, a box inside it) and builds the index; adds the
// destinations' bytes to `total_dst_bytes`.
absl::Status IndexPieces(const Problem& p, PieceIndex* ix, int64_t* total_dst_bytes) {
  const auto& tensors = p.inventory.tensors;
  const size_t nt = tensors.size();
  ix->src_off.assign(nt + 1, 0);
  ix->dst_off.assign(nt + 1, 0);
  std::vector<uint8_t> skip;  // per piece in worker order: empty box, not indexed
  for (size_t w = 0; w < p.workers.size(); ++w) {
    const Worker& worker = p.workers[w];
    for (size_t i = 0; i < worker.layout.pieces.size(); ++i) {
      const Piece& piece = worker.layout.pieces[i];
      if (piece.tensor < 0 || static_cast<size_t>(piece.tensor) >= nt) {
        return absl::InvalidArgumentError(absl::StrCat("worker ", worker.id, " piece ", i,
                                                       ": unknown tensor index ", piece.tensor));
      }
      const TensorSpec& ts = tensors[piece.tensor];
      if (ts.shape.size() > 16 || !BoxInside(piece.box, ts.shape)) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker ", worker.id, " piece ", i, ": box ", BoxToString(piece.box),
                         " is not inside tensor ", ts.name, " of rank ", ts.shape.size()));
      }
      const int64_t vol = BoxVolume(piece.box);
      skip.push_back(vol == 0);
      if (vol == 0) continue;
      if (worker.role == Role::kTrainer) {
        ++ix->src_off[piece.tensor + 1];
      } else {
        ++ix->dst_off[piece.tensor + 1];
        *total_dst_bytes += vol * DTypeSize(ts.dtype);
      }
    }
  }
  for (size_t t = 0; t < nt; ++t) {
    ix->src_off[t + 1] += ix->src_off[t];
    ix->dst_off[t + 1] += ix->dst_off[t];
  }
  ix->srcs.assign(ix->src_off[nt], PieceRef{});
  ix->dsts.assign(ix->dst_off[nt], PieceRef{});
  std::vector<uint32_t> sfill(ix->src_off.begin(), ix->src_off.end() - 1);
  std::vector<uint32_t> dfill(ix->dst_off.begin(), ix->dst_off.end() - 1);
  size_t flat = 0;
  for (size_t w = 0; w < p.workers.size(); ++w) {
    const Worker& worker = p.workers[w];
    for (size_t i = 0; i < worker.layout.pieces.size(); ++i) {
      const Piece& piece = worker.layout.pieces[i];
      if (skip[flat++]) continue;
      PieceRef r{static_cast<int32_t>(w), static_cast<int32_t>(i)};
      if (worker.role == Role::kTrainer) {
        ix->srcs[sfill[piece.tensor]++] = r;
      } else {
        ix->dsts[dfill[piece.tensor]++] = r;
      }
    }
  }
  return absl::OkStatus();
}

// Tensor t's grid in `s`: the breakpoints of its destination boxes (and of source boxes inside
// their hull) per dimension, and per cell the signatures and counts of the destination and source
// pieces covering it. Returns the number of cells.
absl::StatusOr<int64_t> BuildGrid(const Problem& p, const PieceIndex& ix, size_t t, Scratch& s) {
  const uint32_t d0 = ix.dst_off[t], d1 = ix.dst_off[t + 1];
  const uint32_t s0 = ix.src_off[t], s1 = ix.src_off[t + 1];
  const TensorSpec& ts = p.inventory.tensors[t];
  const size_t rank = ts.shape.size();
  // Hull of the destination boxes, and the grid breakpoints clipped to it.
  s.bp.resize(rank);
  std::vector<int64_t>& hull_lo = s.hull_lo;
  std::vector<int64_t>& hull_hi = s.hull_hi;
  hull_lo.resize(rank);
  hull_hi.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    hull_lo[d] = ts.shape[d];
    hull_hi[d] = 0;
    s.bp[d].clear();
  }
  for (uint32_t k = d0; k < d1; ++k) {
    const Box& b = BoxOf(p, ix.dsts[k]);
    for (size_t d = 0; d < rank; ++d) {
      hull_lo[d] = std::min(hull_lo[d], b.begin[d]);
      hull_hi[d] = std::max(hull_hi[d], b.end[d]);
      s.bp[d].push_back(b.begin[d]);
      s.bp[d].push_back(b.end[d]);
    }
  }
  for (uint32_t k = s0; k < s1; ++k) {
    const Box& b = BoxOf(p, ix.srcs[k]);
    for (size_t d = 0; d < rank; ++d) {
      if (b.begin[d] > hull_lo[d] && b.begin[d] < hull_hi[d]) s.bp[d].push_back(b.begin[d]);
      if (b.end[d] > hull_lo[d] && b.end[d] < hull_hi[d]) s.bp[d].push_back(b.end[d]);
    }
  }
  s.dims.assign(rank, 0);
  int64_t cells = 1;
  for (size_t d = 0; d < rank; ++d) {
    auto& v = s.bp[d];
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    s.dims[d] = static_cast<int64_t>(v.size()) - 1;
    cells *= s.dims[d];
    if (cells > (int64_t{1} << 24)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tensor ", ts.name, ": piece boundaries form more than 2^24 grid cells"));
    }
  }
  s.sig_a.assign(cells, 0);
  s.sig_b.assign(cells, 0);
  s.dcount.assign(cells, 0);
  s.scount.assign(cells, 0);
  s.assigned.assign(cells, 0);
  s.lo.resize(rank);
  s.hi.resize(rank);

  auto index_range = [&](const Box& b) -> bool {
    for (size_t d = 0; d < rank; ++d) {
      const int64_t lo = std::max(b.begin[d], hull_lo[d]);
      const int64_t hi = std::min(b.end[d], hull_hi[d]);
      if (lo >= hi) return false;
      s.lo[d] = std::lower_bound(s.bp[d].begin(), s.bp[d].end(), lo) - s.bp[d].begin();
      s.hi[d] = std::lower_bound(s.bp[d].begin(), s.bp[d].end(), hi) - s.bp[d].begin();
    }
    return true;
  };
  for (uint32_t k = d0; k < d1; ++k) {
    if (!index_range(BoxOf(p, ix.dsts[k]))) continue;
    const uint64_t ha = Mix(2 * uint64_t{k} + 1), hb = Mix(ha ^ 0x5bd1e995ULL);
    ForEachCell(s.dims, s.lo.data(), s.hi.data(), [&](int64_t c) {
      s.sig_a[c] += ha;
      s.sig_b[c] += hb;
      ++s.dcount[c];
    });
  }
  for (uint32_t k = s0; k < s1; ++k) {
    if (!index_range(BoxOf(p, ix.srcs[k]))) continue;
    const uint64_t ha = Mix(2 * uint64_t{k}), hb = Mix(ha ^ 0x27d4eb2fULL);
    ForEachCell(s.dims, s.lo.data(), s.hi.data(), [&](int64_t c) {
      s.sig_a[c] += ha;
      s.sig_b[c] += hb;
      ++s.scount[c];
    });
  }
  return cells;
}

// Files fragment `f` of tensor t (its box and bytes set): its holders and needers by exact
// containment (a partial overlap means the signature lied), split into pieces of at most
// `max_fragment_bytes` when that is set.
absl::Status EmitFragment(const Problem& p, const PieceIndex& ix, size_t t, Fragment f, int64_t max_fragment_bytes,
                          const FragmentOptions& options, FragmentSet* out) {
  const TensorSpec& ts = p.inventory.tensors[t];
  auto collect = [&](const std::vector<PieceRef>& refs, uint32_t a, uint32_t b) -> absl::Status {
    for (uint32_t k = a; k < b; ++k) {
      const Box& pb = BoxOf(p, refs[k]);
      if (BoxContains(pb, f.box)) {
        out->refs.push_back(refs[k]);
      } else if (Overlaps(pb, f.box)) {
        return absl::InternalError(absl::StrCat("fragment signature collision on tensor ", ts.name, " box ",
                                                BoxToString(f.box), " (", PieceName(p, refs[k]), ")"));
      }
    }
    return absl::OkStatus();
  };
  f.src_begin = static_cast<uint32_t>(out->refs.size());
  if (auto st = collect(ix.srcs, ix.src_off[t], ix.src_off[t + 1]); !st.ok()) return st;
  f.src_end = static_cast<uint32_t>(out->refs.size());
  f.dst_begin = f.src_end;
  if (auto st = collect(ix.dsts, ix.dst_off[t], ix.dst_off[t + 1]); !st.ok()) return st;
  f.dst_end = static_cast<uint32_t>(out->refs.size());

  if (max_fragment_bytes <= 0 || f.bytes <= max_fragment_bytes) {
    out->fragments.push_back(std::move(f));
    return absl::OkStatus();
  }
  const int64_t n = (f.bytes + max_fragment_bytes - 1) / max_fragment_bytes;
  // Sender-side quantisation needs ops on the destination's block grid: split on it.
  const std::vector<int64_t>* quantum = nullptr;
  if (options.align_splits_to_quant_blocks && f.dst_begin < f.dst_end) {
    const PieceRef r = out->refs[f.dst_begin];
    const Piece& pc = p.workers[r.worker].layout.pieces[r.piece];
    if (pc.quant.has_value()) quantum = &pc.quant->block;
  }
  const int64_t esize = DTypeSize(ts.dtype);
  for (Box& b : SplitBox(f.box, n, quantum)) {
    Fragment g = f;
    g.box = std::move(b);
    g.bytes = BoxVolume(g.box) * esize;
    out->fragments.push_back(std::move(g));
  }
  return absl::OkStatus();
}

// Greedy merge of tensor t's equal-signature cells (BuildGrid) into boxes, row-major: each box
// grows along the last dimension first, then the earlier ones, while every cell it takes in is
// unassigned, needed and of the same signature.
absl::Status MergeCells(const Problem& p, const PieceIndex& ix, size_t t, int64_t cells, int64_t max_fragment_bytes,
                        const FragmentOptions& options, Scratch& s, FragmentSet* out) {
  const TensorSpec& ts = p.inventory.tensors[t];
  const size_t rank = ts.shape.size();
  std::vector<int64_t>& idx = s.idx;
  std::vector<int64_t>& ext = s.ext;
  std::vector<int64_t>& slab_lo = s.slab_lo;
  std::vector<int64_t>& slab_hi = s.slab_hi;
  idx.resize(rank);
  ext.resize(rank);
  slab_lo.resize(rank);
  slab_hi.resize(rank);
  for (int64_t c = 0; c < cells; ++c) {
    if (s.assigned[c] || s.dcount[c] == 0) continue;
    int64_t rem = c;
    for (size_t d = rank; d-- > 0;) {
      idx[d] = rem % s.dims[d];
      rem /= s.dims[d];
    }
    if (s.scount[c] == 0) {
      Box cell;
      for (size_t d = 0; d < rank; ++d) {
        cell.begin.push_back(s.bp[d][idx[d]]);
        cell.end.push_back(s.bp[d][idx[d] + 1]);
      }
      return absl::FailedPreconditionError(absl::StrCat("tensor ", ts.name, " box ", BoxToString(cell),
                                                        " is needed by a destination but held by no source"));
    }
    const uint64_t sa = s.sig_a[c], sb = s.sig_b[c];
    for (size_t d = 0; d < rank; ++d) ext[d] = 1;
    for (size_t d = rank; d-- > 0;) {
      while (idx[d] + ext[d] < s.dims[d]) {
        for (size_t e = 0; e < rank; ++e) {
          slab_lo[e] = idx[e];
          slab_hi[e] = idx[e] + ext[e];
        }
        slab_lo[d] = idx[d] + ext[d];
        slab_hi[d] = slab_lo[d] + 1;
        bool ok = true;
        ForEachCell(s.dims, slab_lo.data(), slab_hi.data(), [&](int64_t x) {
          if (s.assigned[x] || s.dcount[x] == 0 || s.sig_a[x] != sa || s.sig_b[x] != sb) ok = false;
        });
        if (!ok) break;
        ++ext[d];
      }
    }
    for (size_t e = 0; e < rank; ++e) {
      slab_lo[e] = idx[e];
      slab_hi[e] = idx[e] + ext[e];
    }
    ForEachCell(s.dims, slab_lo.data(), slab_hi.data(), [&](int64_t x) { s.assigned[x] = 1; });

    Fragment f;
    f.tensor = static_cast<int32_t>(t);
    f.box.begin.resize(rank);
    f.box.end.resize(rank);
    for (size_t d = 0; d < rank; ++d) {
      f.box.begin[d] = s.bp[d][idx[d]];
      f.box.end[d] = s.bp[d][idx[d] + ext[d]];
    }
    f.bytes = BoxVolume(f.box) * DTypeSize(ts.dtype);
    if (absl::Status st = EmitFragment(p, ix, t, std::move(f), max_fragment_bytes, options, out); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<FragmentSet> BuildFragments(const Problem& p, const FragmentOptions& options) {
  FragmentSet out;
  PieceIndex ix;
  if (absl::Status st = IndexPieces(p, &ix, &out.total_dst_bytes); !st.ok()) return st;
  int64_t max_fragment_bytes = options.max_fragment_bytes;
  if (max_fragment_bytes == 0 && options.auto_grain_slots > 0) {
    const int64_t grain = out.total_dst_bytes / (options.auto_grain_slots * 64);
    max_fragment_bytes = std::max<int64_t>(std::min(std::max(grain, int64_t{4} << 20), options.auto_grain_cap), 1);
  }
  Scratch s;
  for (size_t t = 0; t < p.inventory.tensors.size(); ++t) {
    if (ix.dst_off[t] == ix.dst_off[t + 1]) continue;
    absl::StatusOr<int64_t> cells = BuildGrid(p, ix, t, s);
    if (!cells.ok()) return cells.status();
    if (absl::Status st = MergeCells(p, ix, t, *cells, max_fragment_bytes, options, s, &out); !st.ok()) return st;
  }
  return out;
}

}  // namespace wb::planner
