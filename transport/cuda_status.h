#pragma once
// The one place CUDA and NCCL return codes become absl::Status. Built only with CUDA (see BUILD).
// CudaStatus clears CUDA's per-thread last error (cudaGetLastError) so a later call does not report
// an old failure; sticky errors (e.g. cudaErrorIllegalAddress) leave the context unusable and are
// reported as INTERNAL with "(sticky: context unusable)" so callers know to rebuild.

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace wb::transport {

absl::Status CudaStatus(cudaError_t err, absl::string_view what);

}  // namespace wb::transport

#define WB_CUDA_RETURN_IF_ERROR(expr, what)                                  \
  do {                                                                       \
    const ::absl::Status wb_cuda_status_ = ::wb::transport::CudaStatus((expr), (what)); \
    if (!wb_cuda_status_.ok()) return wb_cuda_status_;                       \
  } while (0)
