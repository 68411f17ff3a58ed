#include "planner/fragments.h"

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "planner/box.h"

namespace wb::planner {
namespace {

inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The pieces of one side (sources or destinations) of a tensor, grouped by their box clipped to
// the destinations' hull: the grid is walked once per group, and a fragment's holders (needers)
// are the members of the groups containing it. Pieces that miss the hull are in no group.
struct Groups {
  std::vector<int64_t> box;       // per group: rank begins, then rank ends (clipped)
  std::vector<int64_t> lo, hi;    // per group: its grid index range, rank values each
  std::vector<uint32_t> mem_off;  // group g's members are mem[mem_off[g], mem_off[g + 1])
  std::vector<PieceRef> mem;      // (worker, piece) order within a group
  std::vector<uint32_t> by_row;   // group ids by lo[0]: the merge's row sweep adds them in order
  std::vector<uint32_t> active;   // groups whose rows include the sweep's current row
  size_t next = 0;                // by_row[next] is the next group to activate
  size_t size() const { return mem_off.size() - 1; }
};

struct Scratch {
  TensorGrid grid;
  std::vector<uint64_t> sig_a, sig_b;
  std::vector<int32_t> dcount, scount;
  std::vector<uint8_t> assigned;
  std::vector<int64_t> lo, hi, idx, ext, slab_lo, slab_hi;
  std::vector<int64_t> clip;
  std::vector<uint32_t> order;
  Groups src, dst;
  int64_t row = -1;  // the sweep's current row (dim-0 cell index)
  // Cancellation (FragmentOptions::cancel): Tick counts work; once the check said stop, `stopped`
  // is set and the helpers return at once (BuildFragments turns that into the check's error).
  CancelPoll* cancel = nullptr;
  bool stopped = false;
  bool Tick(int64_t units) {
    if (cancel == nullptr || cancel->Tick(units)) return true;
    stopped = true;
    return false;
  }
};

// Counts the work of one BuildFragments call against its budget.
class WorkMeter {
 public:
  explicit WorkMeter(int64_t budget) : budget_(budget) {}
  // Adds `units`; false once the total passes the budget (then Exhausted() is the error).
  bool Charge(int64_t units) {
    if (__builtin_add_overflow(used_, units, &used_)) used_ = std::numeric_limits<int64_t>::max();
    return used_ <= budget_;
  }
  // RESOURCE_EXHAUSTED naming the tensor, `who` (a piece to blame; may be empty) and `what` ran out.
  absl::Status Exhausted(const TensorSpec& ts, absl::string_view who, absl::string_view what) const {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tensor ", ts.name, who.empty() ? "" : " (", who, who.empty() ? "" : ")", ": ", what,
        " exceeds the planner's work budget of ", budget_,
        " units (boxes overlap far more than any framework's layout; docs/planner.md \"Work bounds\")"));
  }
  int64_t used() const { return used_; }

 private:
  int64_t used_ = 0;
  const int64_t budget_;
};

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

// Groups refs[a, b) by their box clipped to [hull_lo, hull_hi) (see Groups). With
// `one_per_worker`, a group keeps one member per worker (its lowest piece): a source worker
// holding the same box twice is one choice of sender, not two.
void GroupBoxes(const Problem& p, const std::vector<PieceRef>& refs, uint32_t a, uint32_t b, size_t rank, bool one_per_worker,
                Scratch& s, Groups* g) {
  const size_t w = 2 * rank;
  s.clip.resize(size_t{b - a} * w);
  s.order.clear();
  for (uint32_t k = a; k < b; ++k) {
    const Box& box = BoxOf(p, refs[k]);
    int64_t* c = s.clip.data() + size_t{k - a} * w;
    bool empty = false;
    for (size_t d = 0; d < rank; ++d) {
      c[d] = std::max(box.begin[d], s.grid.hull_lo[d]);
      c[rank + d] = std::min(box.end[d], s.grid.hull_hi[d]);
      empty = empty || c[d] >= c[rank + d];
    }
    if (!empty) s.order.push_back(k - a);
  }
  // Ties (equal boxes) keep ref order, which is (worker, piece) order.
  std::sort(s.order.begin(), s.order.end(), [&](uint32_t x, uint32_t y) {
    const int64_t* cx = s.clip.data() + size_t{x} * w;
    const int64_t* cy = s.clip.data() + size_t{y} * w;
    for (size_t i = 0; i < w; ++i) {
      if (cx[i] != cy[i]) return cx[i] < cy[i];
    }
    return x < y;
  });
  g->box.clear();
  g->mem_off.assign(1, 0);
  g->mem.clear();
  for (size_t i = 0; i < s.order.size(); ++i) {
    const int64_t* c = s.clip.data() + size_t{s.order[i]} * w;
    const bool same = i > 0 && std::equal(c, c + w, s.clip.data() + size_t{s.order[i - 1]} * w);
    if (!same) {
      if (i > 0) g->mem_off.push_back(static_cast<uint32_t>(g->mem.size()));
      g->box.insert(g->box.end(), c, c + w);
    }
    const PieceRef r = refs[a + s.order[i]];
    if (same && one_per_worker && g->mem.back().worker == r.worker) continue;
    g->mem.push_back(r);
  }
  if (!s.order.empty()) g->mem_off.push_back(static_cast<uint32_t>(g->mem.size()));
}

// The grid index range of every group, and the cells their walks will visit (saturating).
int64_t IndexGroups(size_t rank, Scratch& s, Groups* g, uint32_t* largest) {
  const size_t n = g->size();
  g->lo.resize(n * rank);
  g->hi.resize(n * rank);
  int64_t total = 0, most = -1;
  for (size_t k = 0; k < n; ++k) {
    const int64_t vol = s.grid.IndexRange(g->box.data() + k * 2 * rank, g->lo.data() + k * rank,
                                          g->hi.data() + k * rank);  // <= kMaxGridCells
    if (vol > most) {
      most = vol;
      *largest = static_cast<uint32_t>(k);
    }
    if (__builtin_add_overflow(total, vol, &total)) total = std::numeric_limits<int64_t>::max();
  }
  g->by_row.resize(n);
  for (size_t k = 0; k < n; ++k) g->by_row[k] = static_cast<uint32_t>(k);
  if (rank > 0) {
    std::stable_sort(g->by_row.begin(), g->by_row.end(),
                     [&](uint32_t x, uint32_t y) { return g->lo[x * rank] < g->lo[y * rank]; });
  }
  g->active.clear();
  g->next = 0;
  return total;
}

// Adds every cell of each group's range to the cells' signature (one 128-bit hash per group,
// sources and destinations apart) and count. Polls s.cancel after each group (false: stopped).
bool WalkGroups(const Groups& g, size_t rank, bool dst, Scratch& s) {
  for (size_t k = 0; k < g.size(); ++k) {
    const uint64_t ha = Mix(2 * uint64_t{k} + (dst ? 1 : 0));
    const uint64_t hb = Mix(ha ^ (dst ? 0x5bd1e995ULL : 0x27d4eb2fULL));
    std::vector<int32_t>& count = dst ? s.dcount : s.scount;
    int64_t walked = 0;
    ForEachGridCell(s.grid.dims, g.lo.data() + k * rank, g.hi.data() + k * rank, [&](int64_t c) {
      s.sig_a[c] += ha;
      s.sig_b[c] += hb;
      ++count[c];
      ++walked;
    });
    if (!s.Tick(1 + walked)) return false;
  }
  return true;
}

// Tensor t's grid in `s`: the breakpoints of its destination boxes (and of source boxes inside
// their hull) per dimension, the pieces grouped by clipped box, and per cell the signatures and
// counts of the source and destination groups covering it. Returns the number of cells.
absl::StatusOr<int64_t> BuildGrid(const Problem& p, const PieceIndex& ix, size_t t, WorkMeter& meter, Scratch& s) {
  const uint32_t d0 = ix.dst_off[t], d1 = ix.dst_off[t + 1];
  const uint32_t s0 = ix.src_off[t], s1 = ix.src_off[t + 1];
  const TensorSpec& ts = p.inventory.tensors[t];
  const size_t rank = ts.shape.size();
  // The grid (planner/grid.h): hull of the destination boxes, breakpoints clipped to it.
  s.grid.Reset(rank);
  for (uint32_t k = d0; k < d1; ++k) s.grid.AddNeeded(BoxOf(p, ix.dsts[k]));
  for (uint32_t k = s0; k < s1; ++k) s.grid.AddHeld(BoxOf(p, ix.srcs[k]));
  const int64_t cells = s.grid.Finish();
  if (cells < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tensor ", ts.name, ": piece boundaries form more than 2^24 grid cells"));
  }
  GroupBoxes(p, ix.srcs, s0, s1, rank, /*one_per_worker=*/true, s, &s.src);
  GroupBoxes(p, ix.dsts, d0, d1, rank, /*one_per_worker=*/false, s, &s.dst);
  // Charged before walking, so a hostile layout fails at once instead of after the budget's time.
  uint32_t big_src = 0, big_dst = 0;
  const int64_t src_walk = IndexGroups(rank, s, &s.src, &big_src);
  const int64_t dst_walk = IndexGroups(rank, s, &s.dst, &big_dst);
  if (!meter.Charge(cells)) return meter.Exhausted(ts, "", absl::StrCat("merging ", cells, " grid cells"));
  if (!meter.Charge(src_walk)) {
    return meter.Exhausted(ts, absl::StrCat("largest box: ", PieceName(p, s.src.mem[s.src.mem_off[big_src]])),
                           absl::StrCat("walking ", s.src.size(), " distinct source boxes over ", src_walk, " cells"));
  }
  if (!meter.Charge(dst_walk)) {
    return meter.Exhausted(ts, absl::StrCat("largest box: ", PieceName(p, s.dst.mem[s.dst.mem_off[big_dst]])),
                           absl::StrCat("walking ", s.dst.size(), " distinct destination boxes over ", dst_walk, " cells"));
  }
  s.sig_a.assign(cells, 0);
  s.sig_b.assign(cells, 0);
  s.dcount.assign(cells, 0);
  s.scount.assign(cells, 0);
  s.assigned.assign(cells, 0);
  s.lo.resize(rank);
  s.hi.resize(rank);
  if (!WalkGroups(s.dst, rank, /*dst=*/true, s) || !WalkGroups(s.src, rank, /*dst=*/false, s)) {
    return absl::CancelledError();  // s.stopped: BuildFragments returns the check's error
  }
  s.row = -1;
  return cells;
}

// Moves the row sweep of `g` to `row` (non-decreasing): activates the groups starting at or before
// it and drops those ending at or before it. Rank 0: every group is active.
void SweepTo(Groups& g, size_t rank, int64_t row) {
  if (rank == 0) {
    if (g.next == 0) {
      for (uint32_t k = 0; k < g.size(); ++k) g.active.push_back(k);
      g.next = g.size();
    }
    return;
  }
  size_t keep = 0;
  for (uint32_t k : g.active) {
    if (g.hi[k * rank] > row) g.active[keep++] = k;
  }
  g.active.resize(keep);
  while (g.next < g.by_row.size() && g.lo[g.by_row[g.next] * rank] <= row) {
    const uint32_t k = g.by_row[g.next++];
    if (g.hi[k * rank] > row) g.active.push_back(k);
  }
}

bool GroupContains(const int64_t* c, size_t rank, const Box& b) {
  for (size_t d = 0; d < rank; ++d) {
    if (c[d] > b.begin[d] || b.end[d] > c[rank + d]) return false;
  }
  return true;
}

bool GroupOverlaps(const int64_t* c, size_t rank, const Box& b) {
  for (size_t d = 0; d < rank; ++d) {
    if (std::max(c[d], b.begin[d]) >= std::min(c[rank + d], b.end[d])) return false;
  }
  return true;
}

// Appends to out->refs the members of the active groups of `g` that contain `box`, in (worker,
// piece) order. An active group that overlaps the box without containing it means the merge
// joined cells of different coverage (impossible with equal counts; kept as a guard).
absl::Status CollectHolders(const Problem& p, const Groups& g, size_t rank, const Box& box, const TensorSpec& ts,
                            WorkMeter& meter, FragmentSet* out) {
  const size_t first = out->refs.size();
  int contributing = 0;
  for (uint32_t k : g.active) {
    const int64_t* c = g.box.data() + size_t{k} * 2 * rank;
    const PieceRef* m0 = g.mem.data() + g.mem_off[k];
    const PieceRef* m1 = g.mem.data() + g.mem_off[k + 1];
    if (GroupContains(c, rank, box)) {
      out->refs.insert(out->refs.end(), m0, m1);
      ++contributing;
    } else if (GroupOverlaps(c, rank, box)) {
      return absl::InternalError(absl::StrCat("fragment signature collision on tensor ", ts.name, " box ",
                                              BoxToString(box), " (", PieceName(p, *m0), ")"));
    }
  }
  if (contributing > 1) {
    std::sort(out->refs.begin() + first, out->refs.end(), [](const PieceRef& a, const PieceRef& b) {
      return a.worker != b.worker ? a.worker < b.worker : a.piece < b.piece;
    });
  }
  if (!meter.Charge(static_cast<int64_t>(g.active.size() + (out->refs.size() - first)))) {
    return meter.Exhausted(ts, "", "testing the candidate holders and needers of its fragments");
  }
  return absl::OkStatus();
}

// Files fragment `f` of tensor t (its box and bytes set): its holders and needers by exact
// containment among the sweep's active groups, split into pieces of at most `max_fragment_bytes`
// when that is set.
absl::Status EmitFragment(const Problem& p, size_t t, Fragment f, int64_t max_fragment_bytes,
                          const FragmentOptions& options, WorkMeter& meter, Scratch& s, FragmentSet* out) {
  const TensorSpec& ts = p.inventory.tensors[t];
  const size_t rank = ts.shape.size();
  f.src_begin = static_cast<uint32_t>(out->refs.size());
  RETURN_IF_ERROR(CollectHolders(p, s.src, rank, f.box, ts, meter, out));
  f.src_end = static_cast<uint32_t>(out->refs.size());
  f.dst_begin = f.src_end;
  RETURN_IF_ERROR(CollectHolders(p, s.dst, rank, f.box, ts, meter, out));
  f.dst_end = static_cast<uint32_t>(out->refs.size());

  if (!s.Tick(1 + (f.dst_end - f.src_begin))) return absl::CancelledError();  // s.stopped

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
  // A tiny grain (a tiny staging budget) must not turn one box into billions of chunks unnoticed.
  int64_t extent = 1;  // of the dim SplitBox cuts: it makes at most that many chunks
  for (size_t d = 0; d < rank && extent <= 1; ++d) extent = f.box.end[d] - f.box.begin[d];
  if (!meter.Charge(std::min(n, extent))) {
    return meter.Exhausted(ts, "", absl::StrCat("splitting fragments at a grain of ", max_fragment_bytes, " bytes"));
  }
  if (!s.Tick(std::min(n, extent))) return absl::CancelledError();  // s.stopped
  const int64_t esize = DTypeSize(ts.dtype);
  for (Box& b : SplitBox(f.box, n, quantum)) {
    Fragment g = f;
    g.box = std::move(b);
    g.bytes = BoxVolume(g.box) * esize;
    out->fragments.push_back(std::move(g));
  }
  return absl::OkStatus();
}

// Greedy merge of tensor t's cells (BuildGrid) of equal signature and equal group counts into
// boxes, row-major: each box grows along the last dimension first, then the earlier ones, while
// every cell it takes in is unassigned, needed and alike. Equal counts make the holders exact
// (CollectHolders): every cell of a box is covered by the groups covering its first cell, which
// contain the box, and by no others.
absl::Status MergeCells(const Problem& p, size_t t, int64_t cells, int64_t max_fragment_bytes,
                        const FragmentOptions& options, WorkMeter& meter, Scratch& s, FragmentSet* out) {
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
    if (!s.Tick(1)) return absl::CancelledError();  // s.stopped
    if (s.assigned[c] || s.dcount[c] == 0) continue;
    int64_t rem = c;
    for (size_t d = rank; d-- > 0;) {
      idx[d] = rem % s.grid.dims[d];
      rem /= s.grid.dims[d];
    }
    if (s.scount[c] == 0) {
      Box cell;
      for (size_t d = 0; d < rank; ++d) {
        cell.begin.push_back(s.grid.bp[d][idx[d]]);
        cell.end.push_back(s.grid.bp[d][idx[d] + 1]);
      }
      return absl::FailedPreconditionError(absl::StrCat("tensor ", ts.name, " box ", BoxToString(cell),
                                                        " is needed by a destination but held by no source"));
    }
    const uint64_t sa = s.sig_a[c], sb = s.sig_b[c];
    const int32_t sn = s.scount[c], dn = s.dcount[c];
    for (size_t d = 0; d < rank; ++d) ext[d] = 1;
    for (size_t d = rank; d-- > 0;) {
      while (idx[d] + ext[d] < s.grid.dims[d]) {
        for (size_t e = 0; e < rank; ++e) {
          slab_lo[e] = idx[e];
          slab_hi[e] = idx[e] + ext[e];
        }
        slab_lo[d] = idx[d] + ext[d];
        slab_hi[d] = slab_lo[d] + 1;
        bool ok = true;
        ForEachGridCell(s.grid.dims, slab_lo.data(), slab_hi.data(), [&](int64_t x) {
          if (s.assigned[x] || s.dcount[x] != dn || s.scount[x] != sn || s.sig_a[x] != sa || s.sig_b[x] != sb) ok = false;
        });
        if (!ok) break;
        ++ext[d];
      }
    }
    for (size_t e = 0; e < rank; ++e) {
      slab_lo[e] = idx[e];
      slab_hi[e] = idx[e] + ext[e];
    }
    ForEachGridCell(s.grid.dims, slab_lo.data(), slab_hi.data(), [&](int64_t x) { s.assigned[x] = 1; });

    Fragment f;
    f.tensor = static_cast<int32_t>(t);
    f.box.begin.resize(rank);
    f.box.end.resize(rank);
    for (size_t d = 0; d < rank; ++d) {
      f.box.begin[d] = s.grid.bp[d][idx[d]];
      f.box.end[d] = s.grid.bp[d][idx[d] + ext[d]];
    }
    f.bytes = BoxVolume(f.box) * DTypeSize(ts.dtype);
    const int64_t row = rank > 0 ? idx[0] : 0;
    if (row != s.row) {
      SweepTo(s.src, rank, row);
      SweepTo(s.dst, rank, row);
      s.row = row;
    }
    RETURN_IF_ERROR(EmitFragment(p, t, std::move(f), max_fragment_bytes, options, meter, s, out));
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
  int64_t pieces = 0;
  for (const Worker& w : p.workers) pieces += static_cast<int64_t>(w.layout.pieces.size());
  WorkMeter meter(options.work_budget > 0 ? options.work_budget : FragmentWorkBudget(pieces));
  Scratch s;
  s.cancel = options.cancel;
  const size_t nt = p.inventory.tensors.size();
  for (size_t t = 0; t < nt; ++t) {
    if (ix.dst_off[t] == ix.dst_off[t + 1]) continue;
    absl::StatusOr<int64_t> cells = BuildGrid(p, ix, t, meter, s);
    absl::Status st = cells.ok() ? MergeCells(p, t, *cells, max_fragment_bytes, options, meter, s, &out) : cells.status();
    if (s.stopped) {
      return s.cancel->Stopped(absl::StrCat("building fragments: tensor ", p.inventory.tensors[t].name, " (", t + 1, " of ",
                                            nt, "), ", out.fragments.size(), " fragments so far"));
    }
    RETURN_IF_ERROR(st);
  }
  out.work = meter.used();
  return out;
}

}  // namespace wb::planner
