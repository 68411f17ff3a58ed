#include "planner/box.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace wb::planner {

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
      return 4;
    case DType::kF8E4M3:
    case DType::kE8M0:
      return 1;
    case DType::kI64:
      return 8;
    case DType::kI4:
    case DType::kF4E2M1:
      return 0;  // sub-byte
  }
  return 0;
}

int DTypeBits(DType dtype) { return IsPacked4(dtype) ? 4 : 8 * DTypeSize(dtype); }

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF32:
      return "float32";
    case DType::kF8E4M3:
      return "float8_e4m3";
    case DType::kI64:
      return "int64";
    case DType::kE8M0:
      return "float8_e8m0";
    case DType::kI4:
      return "int4";
    case DType::kF4E2M1:
      return "float4_e2m1";
  }
  return "unknown";
}

const char* StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kWeightBridge:
      return "weightbridge";
    case Strategy::kRank0Broadcast:
      return "rank0_broadcast";
    case Strategy::kOwnerBroadcast:
      return "owner_broadcast";
    case Strategy::kP2PNoDedup:
      return "p2p_no_dedup";
  }
  return "unknown";
}

int64_t BoxVolume(const Box& box) {
  int64_t v = 1;
  for (size_t i = 0; i < box.begin.size(); ++i) {
    int64_t d = box.end[i] - box.begin[i];
    if (d <= 0) return 0;
    v *= d;
  }
  return v;
}

bool BoxEmpty(const Box& box) { return BoxVolume(box) == 0; }

Box FullBox(const std::vector<int64_t>& shape) {
  Box b;
  b.begin.assign(shape.size(), 0);
  b.end = shape;
  return b;
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  if (a.begin.size() != b.begin.size()) return std::nullopt;
  Box r;
  r.begin.resize(a.begin.size());
  r.end.resize(a.begin.size());
  for (size_t i = 0; i < a.begin.size(); ++i) {
    r.begin[i] = std::max(a.begin[i], b.begin[i]);
    r.end[i] = std::min(a.end[i], b.end[i]);
    if (r.begin[i] >= r.end[i]) return std::nullopt;
  }
  return r;
}

bool BoxContains(const Box& outer, const Box& inner) {
  if (outer.begin.size() != inner.begin.size()) return false;
  for (size_t i = 0; i < outer.begin.size(); ++i) {
    if (inner.begin[i] < outer.begin[i] || inner.end[i] > outer.end[i]) return false;
  }
  return true;
}

bool BoxInside(const Box& box, const std::vector<int64_t>& shape) {
  if (box.begin.size() != shape.size() || box.end.size() != shape.size()) return false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (box.begin[i] < 0 || box.end[i] > shape[i] || box.begin[i] > box.end[i]) return false;
  }
  return true;
}

bool BoxEqual(const Box& a, const Box& b) { return a.begin == b.begin && a.end == b.end; }

std::string BoxToString(const Box& box) {
  std::string s = "[";
  for (size_t i = 0; i < box.begin.size(); ++i) {
    absl::StrAppend(&s, i ? ", " : "", box.begin[i], ":", box.end[i]);
  }
  s += "]";
  return s;
}

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * shape[i + 1];
  return s;
}

namespace {

// Appends boxes covering flat range [lo, hi) of the sub-tensor spanning dims [dim, rank) whose
// leading coordinates (dims < dim) are fixed in `prefix`.
void Decompose(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, size_t dim,
               std::vector<int64_t>& prefix, int64_t lo, int64_t hi, std::vector<Box>& out) {
  if (lo >= hi) return;
  const size_t rank = shape.size();
  const int64_t row = strides[dim];  // elements per index of this dim
  auto emit = [&](int64_t b, int64_t e) {
    Box box;
    box.begin = prefix;
    box.end = prefix;
    for (size_t i = 0; i < prefix.size(); ++i) box.end[i] = prefix[i] + 1;
    box.begin.push_back(b);
    box.end.push_back(e);
    for (size_t i = dim + 1; i < rank; ++i) {
      box.begin.push_back(0);
      box.end.push_back(shape[i]);
    }
    out.push_back(std::move(box));
  };
  int64_t first_full = (lo + row - 1) / row;
  int64_t last_full = hi / row;  // exclusive
  if (first_full > last_full) {
    // Entirely inside one index of this dim.
    int64_t idx = lo / row;
    prefix.push_back(idx);
    Decompose(shape, strides, dim + 1, prefix, lo - idx * row, hi - idx * row, out);
    prefix.pop_back();
    return;
  }
  if (lo % row != 0) {
    int64_t idx = lo / row;
    prefix.push_back(idx);
    Decompose(shape, strides, dim + 1, prefix, lo - idx * row, row, out);
    prefix.pop_back();
  }
  if (first_full < last_full) emit(first_full, last_full);
  if (hi % row != 0 && last_full < shape[dim]) {
    prefix.push_back(last_full);
    Decompose(shape, strides, dim + 1, prefix, 0, hi - last_full * row, out);
    prefix.pop_back();
  }
}

}  // namespace

std::vector<Box> FlatRangeToBoxes(const std::vector<int64_t>& shape, int64_t flat_begin,
                                  int64_t flat_end) {
  std::vector<Box> out;
  if (shape.empty()) {
    if (flat_begin < flat_end && flat_begin == 0) out.push_back(Box{});
    return out;
  }
  std::vector<int64_t> strides = ContiguousStrides(shape);
  std::vector<int64_t> prefix;
  Decompose(shape, strides, 0, prefix, flat_begin, flat_end, out);
  return out;
}

bool BoxesCover(const std::vector<Box>& boxes, const std::vector<int64_t>& shape, int64_t max_cells) {
  const size_t rank = shape.size();
  for (int64_t s : shape) {
    if (s <= 0) return true;  // nothing to cover
  }
  // Per dim the sorted distinct cut points (0, the shape and every box boundary inside it).
  std::vector<std::vector<int64_t>> cuts(rank);
  int64_t cells = 1;
  for (size_t d = 0; d < rank; ++d) {
    cuts[d] = {0, shape[d]};
    for (const Box& b : boxes) {
      if (b.begin.size() != rank || b.end.size() != rank) return false;
      for (int64_t c : {b.begin[d], b.end[d]}) {
        if (c > 0 && c < shape[d]) cuts[d].push_back(c);
      }
    }
    std::sort(cuts[d].begin(), cuts[d].end());
    cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
    const int64_t n = static_cast<int64_t>(cuts[d].size()) - 1;
    if (n > max_cells || cells > max_cells / n) return false;
    cells *= n;
  }
  // Mark each box's cells; a cell is inside a box exactly when its lower corner is. The marking
  // is bounded too (many boxes each over most of the grid): past 4 * max_cells, not decided.
  std::vector<uint8_t> covered(static_cast<size_t>(cells), 0);
  int64_t work = 0;
  for (const Box& b : boxes) {
    std::vector<int64_t> lo(rank), hi(rank);  // the box's cell range per dim
    bool empty = false;
    int64_t box_cells = 1;
    for (size_t d = 0; d < rank; ++d) {
      lo[d] = std::lower_bound(cuts[d].begin(), cuts[d].end(), std::max<int64_t>(b.begin[d], 0)) - cuts[d].begin();
      hi[d] = std::lower_bound(cuts[d].begin(), cuts[d].end(), std::min(b.end[d], shape[d])) - cuts[d].begin();
      empty = empty || lo[d] >= hi[d];
      box_cells *= std::max<int64_t>(hi[d] - lo[d], 0);  // <= cells <= max_cells: no overflow
    }
    if (empty) continue;
    work += box_cells;
    if (work > 4 * max_cells) return false;
    std::vector<int64_t> idx = lo;
    for (;;) {
      int64_t flat = 0;
      for (size_t d = 0; d < rank; ++d) flat = flat * (static_cast<int64_t>(cuts[d].size()) - 1) + idx[d];
      covered[static_cast<size_t>(flat)] = 1;
      bool done = true;  // odometer over [lo, hi): the last dim fastest
      for (size_t d = rank; d-- > 0;) {
        if (++idx[d] < hi[d]) {
          done = false;
          break;
        }
        idx[d] = lo[d];
      }
      if (done) break;
    }
  }
  return std::all_of(covered.begin(), covered.end(), [](uint8_t c) { return c != 0; });
}

}  // namespace wb::planner
