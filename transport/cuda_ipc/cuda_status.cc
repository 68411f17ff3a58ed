#include "transport/cuda_ipc/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace wb::transport {

absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();  // clear the per-thread error so it is not reported twice
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case cudaErrorMemoryAllocation:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      code = absl::StatusCode::kFailedPrecondition;
      break;
    case cudaErrorNotReady:
      code = absl::StatusCode::kUnavailable;
      break;
    default:
      break;
  }
  const bool sticky = err == cudaErrorIllegalAddress || err == cudaErrorLaunchFailure ||
                      err == cudaErrorHardwareStackError || err == cudaErrorIllegalInstruction ||
                      err == cudaErrorMisalignedAddress || err == cudaErrorInvalidAddressSpace ||
                      err == cudaErrorInvalidPc;
  return absl::Status(code, absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")",
                                         sticky ? " (sticky: context unusable)" : ""));
}

#if __has_include(<nccl.h>)
absl::Status NcclStatus(ncclResult_t res, absl::string_view what, ncclComm_t comm) {
  if (res == ncclSuccess) return absl::OkStatus();
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (res) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case ncclRemoteError:
    case ncclSystemError:
    case ncclInProgress:
      code = absl::StatusCode::kUnavailable;
      break;
    case ncclUnhandledCudaError:
      (void)cudaGetLastError();  // NCCL left a CUDA error behind; do not report it twice
      break;
    default:
      break;
  }
  std::string detail;
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') detail = absl::StrCat(" [", last, "]");
  }
  return absl::Status(code, absl::StrCat(what, ": ", ncclGetErrorString(res), detail));
}
#endif

}  // namespace wb::transport
