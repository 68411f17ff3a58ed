#pragma once
// The one place CUDA and NCCL return codes become absl::Status. Built only with CUDA (see BUILD).
// CudaStatus clears CUDA's per-thread last error (cudaGetLastError) so a later call does not report
// an old failure; sticky errors (e.g. cudaErrorIllegalAddress) leave the context unusable and are
// reported as INTERNAL with "(sticky: context unusable)" so callers know to rebuild.
// NcclStatus does the same for ncclResult_t (when NCCL headers are present): ncclRemoteError and
// ncclSystemError (peer gone / network) are UNAVAILABLE, ncclInvalidArgument/ncclInvalidUsage are
// INVALID_ARGUMENT, and the communicator's last error text is appended when `comm` is given.

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace wb::transport {

absl::Status CudaStatus(cudaError_t err, absl::string_view what);

}  // namespace wb::transport

#if __has_include(<nccl.h>)
#include <nccl.h>
namespace wb::transport {
// ncclInProgress is not an error for non-blocking communicators: callers poll it themselves and
// must not pass it here (it maps to UNAVAILABLE "still in progress" if they do).
absl::Status NcclStatus(ncclResult_t res, absl::string_view what, ncclComm_t comm = nullptr);
}  // namespace wb::transport
#endif

namespace wb::transport {

}  // namespace wb::transport

#define WB_CUDA_RETURN_IF_ERROR(expr, what)                                  \
  do {                                                                       \
    const ::absl::Status wb_cuda_status_ = ::wb::transport::CudaStatus((expr), (what)); \
    if (!wb_cuda_status_.ok()) return wb_cuda_status_;                       \
  } while (0)
