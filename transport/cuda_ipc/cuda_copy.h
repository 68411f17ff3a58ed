#pragma once
// Strided box copies on a CUDA stream (built only with CUDA). Shared by the cuda_ipc transport
// (the copies themselves) and the nccl transport (packing / unpacking staging buffers).
//
// A CopyOp is first brought into a canonical form: dims of extent 1 dropped, the innermost dims
// that are contiguous on BOTH sides folded into one row of `width` bytes, adjacent dims that nest
// exactly on both sides merged. EnqueueBoxCopy then issues as few copies as it can:
//   no outer dim            -> one cudaMemcpyAsync
//   two outer dims that nest as a pitched 3-D volume on both sides (outer stride a multiple of the
//                              inner one, pitch >= width) -> cudaMemcpy3DAsync per remaining index
//   otherwise               -> cudaMemcpy2DAsync over the outer dim with the largest extent whose
//                              pitches are valid (>= width), looping over the other dims
//   nothing valid (e.g. stride 0 / overlapping rows) -> one cudaMemcpyAsync per row.
// All copies use cudaMemcpyDefault (unified addressing decides host/device direction).

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace wb::transport {

struct BoxDim {
  int64_t extent = 1;
  int64_t src_stride = 0;  // bytes
  int64_t dst_stride = 0;  // bytes
};

struct CanonicalBox {
  bool empty = false;          // some extent was 0: nothing to copy
  int64_t width = 0;           // bytes of the innermost run, contiguous on both sides
  std::vector<BoxDim> outer;   // outermost first
  int64_t bytes() const {
    if (empty) return 0;
    int64_t n = width;
    for (const BoxDim& d : outer) n *= d.extent;
    return n;
  }
};

// Canonical form of (shape, src strides, dst strides) in elements of `element_size` bytes.
// Requires a validated op (ranks equal, non-negative values).
CanonicalBox Canonicalize(const std::vector<int64_t>& shape, const std::vector<int64_t>& src_strides,
                          const std::vector<int64_t>& dst_strides, int64_t element_size);

// True if every row of the box is laid out back to back on the source (dst) side, i.e. the side
// is one contiguous run of bytes().
bool SrcContiguous(const CanonicalBox& box);
bool DstContiguous(const CanonicalBox& box);

// Restores the calling thread's current CUDA device on scope exit, so transport calls that switch
// devices (cudaSetDevice) do not change the caller's device as a side effect.
class ScopedCudaDevice {
 public:
  ScopedCudaDevice() {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      (void)cudaGetLastError();
      prev_ = -1;
    }
  }
  ~ScopedCudaDevice() {
    if (prev_ >= 0) (void)cudaSetDevice(prev_);
  }
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;

 private:
  int prev_ = -1;
};

// One CUDA copy call of a box copy, with exactly the parameters EnqueueBoxCopy passes to CUDA.
// Pure data, so the planning can be checked without a GPU (cuda_copy_test replays the calls on host
// memory with CUDA's semantics and checks CUDA's parameter rules).
//   k1D: cudaMemcpyAsync(dst + dst_off, src + src_off, width)
//   k2D: cudaMemcpy2DAsync(dst + dst_off, dst_pitch, src + src_off, src_pitch, width, height)
//   k3D: cudaMemcpy3DAsync with pitched pointers (ptr + off, pitch, xsize = width,
//        ysize = *_rows_per_slice) and extent (width bytes, height rows, depth slices): slice z,
//        row y starts at off + (z * rows_per_slice + y) * pitch on each side (linear memory: the
//        extent's width is in BYTES).
struct CopyCall {
  enum Kind { k1D, k2D, k3D };
  Kind kind = k1D;
  int64_t src_off = 0;  // bytes from the box's first element
  int64_t dst_off = 0;
  int64_t width = 0;   // bytes per row (k1D: all bytes)
  int64_t height = 1;  // rows (k2D, k3D)
  int64_t depth = 1;   // slices (k3D)
  int64_t src_pitch = 0;
  int64_t dst_pitch = 0;
  int64_t src_rows_per_slice = 0;  // k3D only
  int64_t dst_rows_per_slice = 0;
};

// The largest pitch EnqueueBoxCopy passes to cudaMemcpy2D/3D (devices cap pitches; see .cc).
inline constexpr int64_t kMaxCopyPitch = (int64_t{1} << 31) - 1;

// Calls `fn` for every copy call of `box`, in issue order; stops (and returns false) as soon as
// `fn` returns false. Nothing for an empty box.
bool ForEachCopyCall(const CanonicalBox& box, absl::FunctionRef<bool(const CopyCall&)> fn);

// Enqueues the copy of `box` from `src` to `dst` on `stream` (the current device must be the
// stream's device). `calls`, if set, is incremented by the number of copy calls issued.
absl::Status EnqueueBoxCopy(char* dst, const char* src, const CanonicalBox& box, cudaStream_t stream,
                            int64_t* calls = nullptr);

}  // namespace wb::transport
