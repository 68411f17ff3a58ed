// Canonical forms of strided boxes and the CUDA copy calls planned for them (pure; no GPU needed):
// the planned calls are replayed on host memory with cudaMemcpy / 2D / 3D semantics and checked
// against an element-by-element reference and against CUDA's parameter rules. The copies on a GPU
// are exercised by the cuda_ipc / nccl conformance tests on a GPU machine.
#include "transport/cuda_ipc/cuda_copy.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"

namespace wb::transport {
namespace {

TEST(CanonicalizeTest, ContiguousFoldsIntoOneRow) {
  CanonicalBox b = Canonicalize({4, 5, 6}, {30, 6, 1}, {30, 6, 1}, 2);
  EXPECT_FALSE(b.empty);
  EXPECT_EQ(b.width, 4 * 5 * 6 * 2);
  EXPECT_TRUE(b.outer.empty());
  EXPECT_TRUE(SrcContiguous(b));
  EXPECT_TRUE(DstContiguous(b));
}

TEST(CanonicalizeTest, PaddedRowsStayTwoD) {
  // 300 x 200 bf16 box of a 1000-wide matrix -> dense.
  CanonicalBox b = Canonicalize({300, 200}, {1000, 1}, {200, 1}, 2);
  EXPECT_EQ(b.width, 400);
  ASSERT_EQ(b.outer.size(), 1u);
  EXPECT_EQ(b.outer[0].extent, 300);
  EXPECT_EQ(b.outer[0].src_stride, 2000);
  EXPECT_EQ(b.outer[0].dst_stride, 400);
  EXPECT_FALSE(SrcContiguous(b));
  EXPECT_TRUE(DstContiguous(b));
  EXPECT_EQ(b.bytes(), 300 * 200 * 2);
}

TEST(CanonicalizeTest, ThreeDAndMergesNestedDims) {
  CanonicalBox b = Canonicalize({7, 9, 33}, {9 * 40, 40, 1}, {10 * 33, 33, 1}, 4);
  EXPECT_EQ(b.width, 132);
  ASSERT_EQ(b.outer.size(), 2u);
  EXPECT_EQ(b.outer[0].extent, 7);
  EXPECT_EQ(b.outer[1].extent, 9);
  // Dims that nest exactly on both sides merge: [2][3][4] padded only at the row level.
  CanonicalBox m = Canonicalize({2, 3, 4}, {3 * 8, 8, 1}, {3 * 8, 8, 1}, 1);
  ASSERT_EQ(m.outer.size(), 1u);
  EXPECT_EQ(m.outer[0].extent, 6);
  EXPECT_EQ(m.outer[0].src_stride, 8);
  EXPECT_EQ(m.width, 4);
}

TEST(CanonicalizeTest, TransposeAndDegenerateDims) {
  CanonicalBox t = Canonicalize({64, 48}, {48, 1}, {1, 64}, 2);
  EXPECT_EQ(t.width, 2);
  ASSERT_EQ(t.outer.size(), 2u);
  CanonicalBox z = Canonicalize({0, 5}, {5, 1}, {5, 1}, 2);
  EXPECT_TRUE(z.empty);
  EXPECT_EQ(z.bytes(), 0);
  CanonicalBox ones = Canonicalize({1, 1, 7}, {100, 50, 1}, {3, 2, 1}, 8);
  EXPECT_TRUE(ones.outer.empty());
  EXPECT_EQ(ones.width, 56);
  CanonicalBox scalar = Canonicalize({}, {}, {}, 4);
  EXPECT_EQ(scalar.width, 4);
  EXPECT_EQ(scalar.bytes(), 4);
}

// Replays `call` on host buffers the way CUDA executes it; "" or what breaks CUDA's parameter rules.
std::string Replay(const CopyCall& c, const std::vector<uint8_t>& src, std::vector<uint8_t>& dst) {
  if (c.width <= 0) return "width must be positive";
  auto row = [&](int64_t so, int64_t dof) -> std::string {
    if (so < 0 || dof < 0 || so + c.width > static_cast<int64_t>(src.size()) ||
        dof + c.width > static_cast<int64_t>(dst.size())) {
      return absl::StrCat("row out of bounds (src ", so, ", dst ", dof, ", width ", c.width, ")");
    }
    std::memcpy(&dst[dof], &src[so], c.width);
    return "";
  };
  switch (c.kind) {
    case CopyCall::k1D:
      return row(c.src_off, c.dst_off);
    case CopyCall::k2D:
      // cudaMemcpy2D: spitch, dpitch >= width (else cudaErrorInvalidPitchValue) and <= max pitch.
      if (c.src_pitch < c.width || c.dst_pitch < c.width) return "2D pitch < width";
      if (c.src_pitch > kMaxCopyPitch || c.dst_pitch > kMaxCopyPitch) return "2D pitch > max pitch";
      for (int64_t y = 0; y < c.height; ++y) {
        if (auto e = row(c.src_off + y * c.src_pitch, c.dst_off + y * c.dst_pitch); !e.empty()) return e;
      }
      return "";
    case CopyCall::k3D:
      // cudaMemcpy3D on linear memory: pitch >= extent.width (bytes), ysize >= extent.height.
      if (c.src_pitch < c.width || c.dst_pitch < c.width) return "3D pitch < width";
      if (c.src_pitch > kMaxCopyPitch || c.dst_pitch > kMaxCopyPitch) return "3D pitch > max pitch";
      if (c.src_rows_per_slice < c.height || c.dst_rows_per_slice < c.height) return "3D ysize < extent.height";
      for (int64_t z = 0; z < c.depth; ++z) {
        for (int64_t y = 0; y < c.height; ++y) {
          if (auto e = row(c.src_off + (z * c.src_rows_per_slice + y) * c.src_pitch,
                           c.dst_off + (z * c.dst_rows_per_slice + y) * c.dst_pitch);
              !e.empty()) {
            return e;
          }
        }
      }
      return "";
  }
  return "unknown kind";
}

struct Layout {
  std::vector<int64_t> shape, src_strides, dst_strides;
  int64_t elem = 1;
};

// Element-by-element reference (independent of cuda_copy).
void Reference(const Layout& l, const std::vector<uint8_t>& src, std::vector<uint8_t>& dst) {
  int64_t n = 1;
  for (auto d : l.shape) n *= d;
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, so = 0, dof = 0;
    for (int d = static_cast<int>(l.shape.size()) - 1; d >= 0; --d) {
      const int64_t idx = rem % l.shape[d];
      rem /= l.shape[d];
      so += idx * l.src_strides[d] * l.elem;
      dof += idx * l.dst_strides[d] * l.elem;
    }
    std::memcpy(&dst[dof], &src[so], l.elem);
  }
}

// Strides (elements) of a padded layout of `shape` whose dims are laid out in order `perm`
// (perm[0] outermost in memory); pads[d] extra elements after each run of dim d.
std::vector<int64_t> PaddedStrides(const std::vector<int64_t>& shape, const std::vector<int>& perm,
                                   const std::vector<int64_t>& pads) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(perm.size()) - 1; i >= 0; --i) {
    const int d = perm[i];
    strides[d] = s;
    s = s * shape[d] + pads[d];
  }
  return strides;
}

int64_t Span(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, int64_t elem) {
  int64_t last = 0;
  for (size_t d = 0; d < shape.size(); ++d) last += (shape[d] - 1) * strides[d];
  return (last + 1) * elem;
}

// Plans `l`, replays the calls on host memory and compares with the reference; returns the calls.
std::vector<CopyCall> CheckLayout(const Layout& l, const std::string& what) {
  CanonicalBox box = Canonicalize(l.shape, l.src_strides, l.dst_strides, l.elem);
  const int64_t src_n = Span(l.shape, l.src_strides, l.elem), dst_n = Span(l.shape, l.dst_strides, l.elem);
  std::vector<uint8_t> src(src_n), want(dst_n, 0xEE), got(dst_n, 0xEE);
  for (int64_t i = 0; i < src_n; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  Reference(l, src, want);
  std::vector<CopyCall> calls;
  int64_t bytes = 0;
  ForEachCopyCall(box, [&](const CopyCall& c) {
    calls.push_back(c);
    bytes += c.width * c.height * c.depth;
    const std::string e = Replay(c, src, got);
    EXPECT_EQ(e, "") << what << " call " << calls.size() - 1;
    return e.empty();
  });
  EXPECT_EQ(bytes, box.bytes()) << what;
  EXPECT_TRUE(got == want) << what;
  return calls;
}

TEST(ForEachCopyCallTest, ShapesOfTheConformanceSuite) {
  // Contiguous: one 1-D call.
  auto c = CheckLayout({{4, 5, 6}, {30, 6, 1}, {30, 6, 1}, 2}, "contiguous");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].kind, CopyCall::k1D);
  EXPECT_EQ(c[0].width, 240);
  // Padded matrix -> dense: one 2-D call with the row pitches.
  c = CheckLayout({{300, 200}, {1000, 1}, {200, 1}, 2}, "2d");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].kind, CopyCall::k2D);
  EXPECT_EQ(c[0].src_pitch, 2000);
  EXPECT_EQ(c[0].dst_pitch, 400);
  EXPECT_EQ(c[0].height, 300);
  // 3-D padded on both sides: one 3-D call; ysize = rows per slice of each side, not the extent.
  c = CheckLayout({{7, 9, 33}, {9 * 40, 40, 1}, {10 * 33, 33, 1}, 4}, "3d");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].kind, CopyCall::k3D);
  EXPECT_EQ(c[0].width, 132);
  EXPECT_EQ(c[0].height, 9);
  EXPECT_EQ(c[0].depth, 7);
  EXPECT_EQ(c[0].src_pitch, 160);
  EXPECT_EQ(c[0].dst_pitch, 132);
  EXPECT_EQ(c[0].src_rows_per_slice, 9);
  EXPECT_EQ(c[0].dst_rows_per_slice, 10);
  // Transpose (element-wide rows): 2-D over one dim, looping over the other.
  c = CheckLayout({{64, 48}, {48, 1}, {1, 64}, 2}, "transpose");
  EXPECT_EQ(c.size(), 48u);
  EXPECT_EQ(c[0].kind, CopyCall::k2D);
}

TEST(ForEachCopyCallTest, BroadcastSourceFallsBackToRows) {
  // Source stride 0 (the same row read 5 times): no valid pitch, one call per row.
  auto c = CheckLayout({{5, 8}, {0, 1}, {8, 1}, 4}, "broadcast");
  EXPECT_EQ(c.size(), 5u);
  for (const CopyCall& call : c) EXPECT_EQ(call.kind, CopyCall::k1D);
}

TEST(ForEachCopyCallTest, StopsWhenTheCallbackSaysSo) {
  CanonicalBox box = Canonicalize({10, 4}, {0, 1}, {4, 1}, 1);
  int seen = 0;
  EXPECT_FALSE(ForEachCopyCall(box, [&](const CopyCall&) { return ++seen < 3; }));
  EXPECT_EQ(seen, 3);
  EXPECT_TRUE(ForEachCopyCall(Canonicalize({0, 4}, {4, 1}, {4, 1}, 1), [](const CopyCall&) {
    ADD_FAILURE() << "an empty box issues no call";
    return true;
  }));
}

TEST(ForEachCopyCallTest, RandomPaddedPermutedBoxesMatchTheReference) {
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 400; ++iter) {
    Layout l;
    const int rank = 1 + static_cast<int>(rng() % 4);
    l.elem = std::vector<int64_t>{1, 2, 4, 8}[rng() % 4];
    for (int d = 0; d < rank; ++d) l.shape.push_back(1 + static_cast<int64_t>(rng() % 6));
    std::vector<int> sp(rank), dp(rank);
    std::iota(sp.begin(), sp.end(), 0);
    std::iota(dp.begin(), dp.end(), 0);
    if (rng() % 3 == 0) std::shuffle(sp.begin(), sp.end(), rng);
    if (rng() % 3 == 0) std::shuffle(dp.begin(), dp.end(), rng);
    std::vector<int64_t> spad(rank), dpad(rank);
    for (int d = 0; d < rank; ++d) {
      spad[d] = rng() % 2 ? static_cast<int64_t>(rng() % 5) : 0;
      dpad[d] = rng() % 2 ? static_cast<int64_t>(rng() % 5) : 0;
    }
    l.src_strides = PaddedStrides(l.shape, sp, spad);
    l.dst_strides = PaddedStrides(l.shape, dp, dpad);
    if (rng() % 10 == 0) l.src_strides[rng() % rank] = 0;  // broadcast read
    CheckLayout(l, absl::StrCat("iter ", iter, " shape [", absl::StrJoin(l.shape, ","), "] src [",
                                absl::StrJoin(l.src_strides, ","), "] dst [", absl::StrJoin(l.dst_strides, ","),
                                "] elem ", l.elem));
    if (HasFailure()) return;
  }
}

}  // namespace
}  // namespace wb::transport
