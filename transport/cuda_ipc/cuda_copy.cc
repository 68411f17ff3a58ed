#include "transport/cuda_ipc/cuda_copy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "transport/cuda_ipc/cuda_status.h"

namespace wb::transport {
namespace {

// cudaMemcpy2D/3D take pitches as size_t but devices cap them (cudaDevAttrMaxPitch, 2^31-1 or
// more on current GPUs); stay under the smallest value any device reports.
constexpr int64_t kMaxPitch = kMaxCopyPitch;

bool PitchOk(int64_t pitch, int64_t width) { return pitch >= width && pitch <= kMaxPitch; }

bool Contiguous(const CanonicalBox& box, bool src) {
  int64_t expect = box.width;
  for (auto it = box.outer.rbegin(); it != box.outer.rend(); ++it) {
    if ((src ? it->src_stride : it->dst_stride) != expect) return false;
    expect *= it->extent;
  }
  return true;
}

}  // namespace

CanonicalBox Canonicalize(const std::vector<int64_t>& shape, const std::vector<int64_t>& src_strides,
                          const std::vector<int64_t>& dst_strides, int64_t element_size) {
  CanonicalBox box;
  box.width = element_size;
  std::vector<BoxDim> dims;  // outermost first
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) {
      box.empty = true;
      return box;
    }
    if (shape[d] == 1) continue;
    dims.push_back({shape[d], src_strides[d] * element_size, dst_strides[d] * element_size});
  }
  // Fold innermost dims contiguous on both sides into the row width.
  while (!dims.empty() && dims.back().src_stride == box.width && dims.back().dst_stride == box.width) {
    box.width *= dims.back().extent;
    dims.pop_back();
  }
  // Merge dim i into i-1 when (i-1) steps exactly over all of i on both sides.
  for (const BoxDim& d : dims) {
    if (!box.outer.empty()) {
      BoxDim& prev = box.outer.back();
      // prev is the outer one; d the inner one (we append inner dims after outer ones).
      if (prev.src_stride == d.src_stride * d.extent && prev.dst_stride == d.dst_stride * d.extent) {
        prev.extent *= d.extent;
        prev.src_stride = d.src_stride;
        prev.dst_stride = d.dst_stride;
        continue;
      }
    }
    box.outer.push_back(d);
  }
  return box;
}

bool SrcContiguous(const CanonicalBox& box) { return Contiguous(box, true); }
bool DstContiguous(const CanonicalBox& box) { return Contiguous(box, false); }

bool ForEachCopyCall(const CanonicalBox& box, absl::FunctionRef<bool(const CopyCall&)> fn) {
  if (box.empty || box.width == 0) return true;
  const int k = static_cast<int>(box.outer.size());
  if (k == 0) {
    CopyCall c;
    c.width = box.width;
    return fn(c);
  }
  // Choose the copy shape: 3-D over the two innermost outer dims, or 2-D over one dim, or rows.
  int plane_dim = -1;  // 2-D: the dim copied as rows of a pitched plane
  bool use3d = false;
  if (k >= 2) {
    const BoxDim& mid = box.outer[k - 1];
    const BoxDim& out = box.outer[k - 2];
    // cudaMemcpy3D addresses slice z as z * pitch * ysize: the outer stride must be a whole number
    // of rows (ysize) and at least the rows copied (ysize >= extent.height), on both sides.
    const bool nests_src = mid.src_stride > 0 && out.src_stride % mid.src_stride == 0 &&
                           out.src_stride / mid.src_stride >= mid.extent;
    const bool nests_dst = mid.dst_stride > 0 && out.dst_stride % mid.dst_stride == 0 &&
                           out.dst_stride / mid.dst_stride >= mid.extent;
    use3d = nests_src && nests_dst && PitchOk(mid.src_stride, box.width) && PitchOk(mid.dst_stride, box.width) &&
            out.src_stride <= kMaxPitch * int64_t{65536} && out.dst_stride <= kMaxPitch * int64_t{65536};
  }
  if (!use3d) {
    for (int d = 0; d < k; ++d) {
      if (PitchOk(box.outer[d].src_stride, box.width) && PitchOk(box.outer[d].dst_stride, box.width) &&
          (plane_dim < 0 || box.outer[d].extent > box.outer[plane_dim].extent)) {
        plane_dim = d;
      }
    }
  }
  // Dims covered by one call; the others are looped over.
  std::vector<int> loop_dims;
  for (int d = 0; d < k; ++d) {
    if (use3d && d >= k - 2) continue;
    if (!use3d && d == plane_dim) continue;
    loop_dims.push_back(d);
  }
  std::vector<int64_t> idx(loop_dims.size(), 0);
  while (true) {
    CopyCall c;
    for (size_t i = 0; i < loop_dims.size(); ++i) {
      c.src_off += idx[i] * box.outer[loop_dims[i]].src_stride;
      c.dst_off += idx[i] * box.outer[loop_dims[i]].dst_stride;
    }
    c.width = box.width;
    if (use3d) {
      const BoxDim& mid = box.outer[k - 1];
      const BoxDim& out = box.outer[k - 2];
      c.kind = CopyCall::k3D;
      c.height = mid.extent;
      c.depth = out.extent;
      c.src_pitch = mid.src_stride;
      c.dst_pitch = mid.dst_stride;
      c.src_rows_per_slice = out.src_stride / mid.src_stride;
      c.dst_rows_per_slice = out.dst_stride / mid.dst_stride;
    } else if (plane_dim >= 0) {
      const BoxDim& pd = box.outer[plane_dim];
      c.kind = CopyCall::k2D;
      c.height = pd.extent;
      c.src_pitch = pd.src_stride;
      c.dst_pitch = pd.dst_stride;
    }
    if (!fn(c)) return false;
    // Next index (row-major over loop_dims).
    int i = static_cast<int>(loop_dims.size()) - 1;
    for (; i >= 0; --i) {
      if (++idx[i] < box.outer[loop_dims[i]].extent) break;
      idx[i] = 0;
    }
    if (i < 0) return true;
  }
}

absl::Status EnqueueBoxCopy(char* dst, const char* src, const CanonicalBox& box, cudaStream_t stream, int64_t* calls) {
  int64_t n_calls = 0;
  absl::Status status;
  ForEachCopyCall(box, [&](const CopyCall& c) {
    cudaError_t err = cudaSuccess;
    const char* what = "cudaMemcpyAsync";
    switch (c.kind) {
      case CopyCall::k1D:
        err = cudaMemcpyAsync(dst + c.dst_off, src + c.src_off, c.width, cudaMemcpyDefault, stream);
        break;
      case CopyCall::k2D:
        what = "cudaMemcpy2DAsync";
        err = cudaMemcpy2DAsync(dst + c.dst_off, c.dst_pitch, src + c.src_off, c.src_pitch, c.width, c.height,
                                cudaMemcpyDefault, stream);
        break;
      case CopyCall::k3D: {
        what = "cudaMemcpy3DAsync";
        cudaMemcpy3DParms p = {};  // zeroed: no arrays, positions 0 (offsets are in the pointers)
        p.srcPtr = make_cudaPitchedPtr(const_cast<char*>(src + c.src_off), c.src_pitch, c.width, c.src_rows_per_slice);
        p.dstPtr = make_cudaPitchedPtr(dst + c.dst_off, c.dst_pitch, c.width, c.dst_rows_per_slice);
        p.extent = make_cudaExtent(c.width, c.height, c.depth);  // width in bytes: linear memory
        p.kind = cudaMemcpyDefault;
        err = cudaMemcpy3DAsync(&p, stream);
        break;
      }
    }
    ++n_calls;
    if (err != cudaSuccess) {
      status = CudaStatus(err, absl::StrCat(what, " of a ", c.width, "-byte-wide box (", c.height, " rows, ", c.depth,
                                            " slices)"));
      return false;
    }
    return true;
  });
  if (calls) *calls += n_calls;
  return status;
}

}  // namespace wb::transport
