#include "transport/cuda_status.h"

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

}  // namespace wb::transport
