#include "planner/index_probe.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "planner/box.h"

namespace wb::planner {

namespace {

struct Level {
  int64_t lstride;  // local element stride of the local dim
  int64_t cdelta;   // canonical index step
  int64_t count;    // extent
};

// Calls fn(local_offset, canonical_delta) for every element of the block spanned by `levels`
// (relative to the seed); stops early when fn returns false. Returns false if stopped.
template <typename Fn>
bool ForEachInBlock(const std::vector<Level>& levels, Fn&& fn) {
  const size_t n = levels.size();
  std::vector<int64_t> idx(n, 0);
  int64_t loff = 0, coff = 0;
  while (true) {
    if (!fn(loff, coff)) return false;
    size_t k = 0;
    for (; k < n; ++k) {
      if (++idx[k] < levels[k].count) {
        loff += levels[k].lstride;
        coff += levels[k].cdelta;
        break;
      }
      loff -= (levels[k].count - 1) * levels[k].lstride;
      coff -= (levels[k].count - 1) * levels[k].cdelta;
      idx[k] = 0;
    }
    if (k == n) return true;
  }
}

}  // namespace

namespace {

// Tensor of a canonical index, with a one-entry cache: neighbours usually share a tensor.
class TensorOfIndex {
 public:
  explicit TensorOfIndex(const std::vector<int64_t>& bases) : bases_(bases) {}
  size_t operator()(int64_t idx) {
    if (cached_ + 1 < bases_.size() && bases_[cached_] <= idx && idx < bases_[cached_ + 1]) return cached_;
    cached_ = std::upper_bound(bases_.begin(), bases_.end(), idx) - bases_.begin() - 1;
    return cached_;
  }

 private:
  const std::vector<int64_t>& bases_;
  size_t cached_ = 0;
};

// ExtractPieces' arguments and every probe value (-1, or a canonical index of a tensor of
// `element_size`); returns the local element count.
absl::StatusOr<int64_t> CheckProbe(const Inventory& inv, const std::vector<int64_t>& bases, absl::Span<const int64_t> probe,
                                   const std::vector<int64_t>& local_shape, int64_t offset_bytes, int element_size) {
  if (bases.size() != inv.tensors.size() + 1) {
    return absl::InvalidArgumentError("index probe: bases do not match the inventory (use TensorBases)");
  }
  int64_t n = 1;
  for (int64_t d : local_shape) {
    if (d < 0 || (d > 0 && n > (int64_t{1} << 50) / d)) {
      return absl::InvalidArgumentError(absl::StrCat("index probe: bad local shape ", BoxToString(FullBox(local_shape))));
    }
    n *= d;
  }
  if (static_cast<int64_t>(probe.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("index probe: ", probe.size(), " values for local shape with ", n,
                                                   " elements"));
  }
  if (offset_bytes < 0 || element_size <= 0) {
    return absl::InvalidArgumentError("index probe: negative offset or non-positive element size");
  }
  // Pieces get offsets offset_bytes + k * element_size: they must be aligned (ValidateLayout demands
  // it) and must not overflow.
  if (offset_bytes % element_size != 0 ||
      static_cast<int64_t>(probe.size()) > (std::numeric_limits<int64_t>::max() - offset_bytes) / element_size) {
    return absl::InvalidArgumentError(absl::StrCat("index probe: offset ", offset_bytes,
                                                   " is not a multiple of the element size ", element_size,
                                                   " or the tensor's bytes pass 2^63"));
  }
  const int64_t total = bases.back();
  TensorOfIndex tensor_of(bases);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = probe[i];
    if (v == -1) continue;
    if (v < -1 || v >= total) {
      return absl::InvalidArgumentError(absl::StrCat("index probe: element ", i, " holds ", v,
                                                     ", outside [-1, ", total, ")"));
    }
    const size_t t = tensor_of(v);
    if (DTypeSize(inv.tensors[t].dtype) != element_size) {
      return absl::InvalidArgumentError(absl::StrCat("index probe: element ", i, " maps to tensor `",
                                                     inv.tensors[t].name, "` of ", DTypeName(inv.tensors[t].dtype),
                                                     " but the local element size is ", element_size));
    }
  }
  return n;
}

}  // namespace

absl::StatusOr<std::vector<Piece>> ExtractPieces(const Inventory& inv, const std::vector<int64_t>& bases,
                                                 absl::Span<const int64_t> probe,
                                                 const std::vector<int64_t>& local_shape, int64_t offset_bytes,
                                                 int element_size, int32_t buffer) {
  absl::StatusOr<int64_t> checked = CheckProbe(inv, bases, probe, local_shape, offset_bytes, element_size);
  if (!checked.ok()) return checked.status();
  const int64_t n = *checked;
  TensorOfIndex tensor_of(bases);

  const size_t lr = local_shape.size();
  const std::vector<int64_t> lstrides = ContiguousStrides(local_shape);
  std::vector<uint8_t> taken(n, 0);
  std::vector<Piece> pieces;
  std::vector<int64_t> lc(lr), c;
  std::vector<Level> levels;
  std::vector<int> cdim_of_level;
  for (int64_t i = 0; i < n; ++i) {
    if (taken[i]) continue;
    // The probe may be shared memory its worker can still write (the node daemon reads it in
    // place): CheckProbe's verdict on this value no longer holds, so it is read once and the value
    // that indexes the inventory is checked again. Every other read below is only compared.
    const int64_t v = *static_cast<const volatile int64_t*>(&probe[i]);
    if (v < 0) continue;
    if (v >= bases.back() || DTypeSize(inv.tensors[tensor_of(v)].dtype) != element_size) {
      return absl::InvalidArgumentError(absl::StrCat("index probe: element ", i, " changed to ", v,
                                                     " after it was checked (was the probe written while it was read?)"));
    }
    const size_t t = tensor_of(v);
    const std::vector<int64_t>& cshape = inv.tensors[t].shape;
    const size_t cr = cshape.size();
    const std::vector<int64_t> cstrides = ContiguousStrides(cshape);
    const int64_t f0 = v - bases[t];
    const int64_t numel = bases[t + 1] - bases[t];
    c.assign(cr, 0);
    int64_t rem = f0;
    for (size_t d = 0; d < cr; ++d) {
      c[d] = rem / cstrides[d];
      rem %= cstrides[d];
    }
    rem = i;
    for (size_t j = 0; j < lr; ++j) {
      lc[j] = rem / lstrides[j];
      rem %= lstrides[j];
    }
    auto usable = [&](int64_t x) { return x >= 0 && x < n && !taken[x] && probe[x] >= 0; };

    levels.clear();
    cdim_of_level.clear();
    bool flat_done = false;
    for (int j = static_cast<int>(lr) - 1; j >= 0; --j) {
      if (lc[j] + 1 >= local_shape[j]) continue;
      const int64_t nb = i + lstrides[j];
      if (!usable(nb)) continue;
      const int64_t delta = probe[nb] - v;
      int d = -1;
      for (int k = static_cast<int>(cr) - 1; k >= 0; --k) {
        if (cstrides[k] == delta && c[k] + 1 < cshape[k] &&
            std::find(cdim_of_level.begin(), cdim_of_level.end(), k) == cdim_of_level.end()) {
          d = k;
          break;
        }
      }
      if (levels.empty() && delta == 1 && cr > 0) {
        // A flat run (FSDP-style) may cross canonical rows: decompose it into boxes.
        int64_t k = 1;
        while (lc[j] + k < local_shape[j] && f0 + k < numel && usable(i + k * lstrides[j]) &&
               probe[i + k * lstrides[j]] == v + k) {
          ++k;
        }
        if (c[cr - 1] + k > cshape[cr - 1]) {
          std::vector<int64_t> strides = cstrides;
          for (int64_t& s : strides) s *= lstrides[j];
          for (Box& b : FlatRangeToBoxes(cshape, f0, f0 + k)) {
            int64_t fb = 0;
            for (size_t q = 0; q < cr; ++q) fb += b.begin[q] * cstrides[q];
            Piece p;
            p.tensor = static_cast<int32_t>(t);
            p.box = std::move(b);
            p.buffer = buffer;
            p.offset_bytes = offset_bytes + (i + (fb - f0) * lstrides[j]) * element_size;
            p.strides = strides;
            pieces.push_back(std::move(p));
          }
          for (int64_t q = 0; q < k; ++q) taken[i + q * lstrides[j]] = 1;
          flat_done = true;
          break;
        }
      }
      if (d < 0) continue;
      // Extend along local dim j while the whole current block repeats shifted by delta.
      int64_t k = 1;
      while (lc[j] + k < local_shape[j] && c[d] + k < cshape[d]) {
        const int64_t lbase = i + k * lstrides[j], cbase = v + k * delta;
        bool ok = ForEachInBlock(levels, [&](int64_t lo, int64_t co) {
          const int64_t x = lbase + lo;
          return usable(x) && probe[x] == cbase + co;
        });
        if (!ok) break;
        ++k;
      }
      levels.push_back(Level{lstrides[j], delta, k});
      cdim_of_level.push_back(d);
    }
    if (flat_done) continue;
    Piece p;
    p.tensor = static_cast<int32_t>(t);
    p.box.begin = c;
    p.box.end = c;
    for (int64_t& e : p.box.end) ++e;
    p.strides.assign(cr, 0);
    for (size_t q = 0; q < levels.size(); ++q) {
      p.box.end[cdim_of_level[q]] = c[cdim_of_level[q]] + levels[q].count;
      p.strides[cdim_of_level[q]] = levels[q].lstride;
    }
    p.buffer = buffer;
    p.offset_bytes = offset_bytes + i * element_size;
    ForEachInBlock(levels, [&](int64_t lo, int64_t) {
      taken[i + lo] = 1;
      return true;
    });
    pieces.push_back(std::move(p));
  }
  return pieces;
}

}  // namespace wb::planner
