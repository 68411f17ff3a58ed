#pragma once
// The NCCL building blocks of the nccl transport (nccl.cc), split out so that a one-GPU smoke test
// (nccl_smoke_test.cc) runs the very code the transport runs: NCCL refuses two ranks of one
// communicator on the same GPU, so the transport's conformance suite needs two GPUs, but a 1-rank
// communicator with send/recv to itself exercises communicator creation, grouped send/recv and the
// completion polling on one. Not part of the public transport interface (use nccl.h). Built only
// with CUDA and NCCL.

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/cuda_ipc/cuda_copy.h"

namespace wb::transport::nccl_internal {

// Creates rank `rank` of an `nranks`-rank communicator on `device` (made current) with
// config.blocking = 0 and polls ncclCommGetAsyncError (backoff up to 5 ms) until it is ready.
// Returns DEADLINE_EXCEEDED if it is not ready at `deadline`, or the NCCL error. On any failure
// *comm may be set (init in progress or failed): the caller must ncclCommAbort it (never
// ncclCommDestroy: it can block on a peer that never came). `what` prefixes every error.
absl::Status InitComm(int device, int nranks, int rank, const ncclUniqueId& uid, absl::Time deadline,
                      absl::string_view what, ncclComm_t* comm);

// Called between polls; a non-OK status ends the wait with that status (the transport's cancel /
// deadline / peer-liveness checks).
using Interrupt = absl::FunctionRef<absl::Status()>;

// InitComm whose wait also ends when `interrupt()` returns a non-OK status (checked between
// polls; that status is returned as is): the transport's CancelRound.
absl::Status InitComm(int device, int nranks, int rank, const ncclUniqueId& uid, absl::Time deadline,
                      absl::string_view what, ncclComm_t* comm, Interrupt interrupt);

// Polls until `event` has completed or, with event == nullptr, until `comm` has no operation in
// progress (ncclCommGetAsyncError leaves ncclInProgress). Backoff 5 us .. 1 ms. An NCCL async error
// is UNAVAILABLE, a CUDA error on the event is CudaStatus's code; `interrupt()`'s non-OK status is
// returned as is. Never blocks in a synchronize; the caller bounds it through `interrupt`.
absl::Status Await(ncclComm_t comm, cudaEvent_t event, absl::string_view what, Interrupt interrupt);

// ncclGroupEnd, then Await(comm, nullptr): on a non-blocking communicator ncclGroupEnd may return
// ncclInProgress before the group's operations are on the stream, so nothing else may be enqueued
// on that stream until this returns OK. An error of ncclGroupEnd itself (a malformed group, e.g. a
// receive from self with no matching send) is INTERNAL: our own call sequence was wrong.
absl::Status GroupEnd(ncclComm_t comm, absl::string_view what, Interrupt interrupt);

// ncclSend (send) or ncclRecv of `n` bytes with rank `peer_rank` on `stream`; call inside
// ncclGroupStart / GroupEnd. ncclInProgress counts as success (non-blocking communicator).
absl::Status P2P(ncclComm_t comm, bool send, void* ptr, int64_t n, int peer_rank, cudaStream_t stream,
                 absl::string_view what);

// `box` with one side (dst if dense_dst, else src) replaced by a dense row-major layout: the
// packing copy into / unpacking copy out of a staging buffer.
CanonicalBox WithDenseSide(const CanonicalBox& box, bool dense_dst);

}  // namespace wb::transport::nccl_internal
