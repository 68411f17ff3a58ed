#include "transport/nccl/nccl_internal.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/cuda_ipc/cuda_status.h"

namespace wb::transport::nccl_internal {

absl::Status InitComm(int device, int nranks, int rank, const ncclUniqueId& uid, absl::Time deadline,
                      absl::string_view what, ncclComm_t* comm) {
  return InitComm(device, nranks, rank, uid, deadline, what, comm, [] { return absl::OkStatus(); });
}

absl::Status InitComm(int device, int nranks, int rank, const ncclUniqueId& uid, absl::Time deadline,
                      absl::string_view what, ncclComm_t* comm, Interrupt interrupt) {
  *comm = nullptr;
  WB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), absl::StrCat(what, ": cudaSetDevice(", device, ")"));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every NCCL call returns at once; we poll ncclCommGetAsyncError with deadlines
  ncclResult_t res = ncclCommInitRankConfig(comm, nranks, uid, rank, &config);
  if (res != ncclSuccess && res != ncclInProgress) {
    return NcclStatus(res, absl::StrCat(what, ": ncclCommInitRankConfig"), *comm);
  }
  if (*comm == nullptr) {
    return absl::InternalError(absl::StrCat(what, ": ncclCommInitRankConfig returned no communicator"));
  }
  absl::Duration backoff = absl::Microseconds(50);
  while (true) {
    ncclResult_t state = ncclSuccess;
    res = ncclCommGetAsyncError(*comm, &state);
    if (res != ncclSuccess) return NcclStatus(res, absl::StrCat(what, ": ncclCommGetAsyncError"), *comm);
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, absl::StrCat(what, ": communicator init"), *comm);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": the communicator was not up before the deadline (did every rank join with this unique id?)"));
    }
    if (absl::Status s = interrupt(); !s.ok()) return s;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(5));
  }
}

absl::Status Await(ncclComm_t comm, cudaEvent_t event, absl::string_view what, Interrupt interrupt) {
  absl::Duration backoff = absl::Microseconds(5);
  while (true) {
    if (event != nullptr) {
      const cudaError_t e = cudaEventQuery(event);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaStatus(e, what);
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t res = ncclCommGetAsyncError(comm, &state);
    if (res != ncclSuccess) state = res;
    if (state != ncclSuccess && state != ncclInProgress) {
      return absl::UnavailableError(NcclStatus(state, what, comm).message());
    }
    if (event == nullptr && state == ncclSuccess) return absl::OkStatus();
    if (absl::Status s = interrupt(); !s.ok()) return s;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(1));
  }
}

absl::Status GroupEnd(ncclComm_t comm, absl::string_view what, Interrupt interrupt) {
  const ncclResult_t res = ncclGroupEnd();
  if (res != ncclSuccess && res != ncclInProgress) {
    absl::Status s = NcclStatus(res, absl::StrCat(what, ": ncclGroupEnd"), comm);
    return s.code() == absl::StatusCode::kInvalidArgument ? absl::InternalError(s.message()) : s;
  }
  return Await(comm, nullptr, what, interrupt);
}

absl::Status P2P(ncclComm_t comm, bool send, void* ptr, int64_t n, int peer_rank, cudaStream_t stream,
                 absl::string_view what) {
  const ncclResult_t res = send ? ncclSend(ptr, static_cast<size_t>(n), ncclUint8, peer_rank, comm, stream)
                                : ncclRecv(ptr, static_cast<size_t>(n), ncclUint8, peer_rank, comm, stream);
  if (res == ncclSuccess || res == ncclInProgress) return absl::OkStatus();
  return NcclStatus(res, absl::StrCat(what, ": ", send ? "ncclSend" : "ncclRecv", " of ", n, " bytes"), comm);
}

CanonicalBox WithDenseSide(const CanonicalBox& box, bool dense_dst) {
  CanonicalBox b = box;
  int64_t stride = box.width;
  for (auto it = b.outer.rbegin(); it != b.outer.rend(); ++it) {
    (dense_dst ? it->dst_stride : it->src_stride) = stride;
    stride *= it->extent;
  }
  return b;
}

}  // namespace wb::transport::nccl_internal
