#pragma once
// "nccl": cross-node transport for CUDA device memory over NCCL (two-sided; see transport.h).
//
// Peers: one 2-rank communicator per peer, on NcclOptions::device. The peer with the smaller
// instance id is rank 0: its ExportEndpoint(peer) creates an ncclUniqueId and carries it in the
// endpoint bytes (a repeated export for that peer before its Connect returns the same id: each id
// runs an NCCL bootstrap root that cannot be cancelled); both sides then Connect, which calls ncclCommInitRankConfig with
// config.blocking = 0 and polls ncclCommGetAsyncError until the communicator is ready or the
// deadline passes (then ncclCommAbort, DEADLINE_EXCEEDED). Endpoints also carry the pid and pid
// namespace so that a peer on the same node and namespace is checked for liveness (kill(pid, 0))
// while a batch waits: NCCL's intra-node paths never report a dead peer themselves.
//
// Batches: each peer has one worker thread that runs its batches in post order (both sides must
// post mirrors in the same order) on a dedicated non-blocking stream:
//   1. mirror check: both sides exchange a 16-byte manifest (XXH3 of the batch as both sides see
//      it, + tag) with a grouped ncclSend/ncclRecv and compare it on the host; a mismatch fails the
//      batch with INVALID_ARGUMENT on both sides before any data moves (the channel stays usable).
//   2. data: every op's logical byte stream is cut into chunks identically on both sides (whole
//      op when it is contiguous on both sides; else sub-boxes of <= 8 MiB along its outer dims);
//      a chunk whose local side is strided is packed into / unpacked from a 64 MiB per-peer staging
//      buffer with cudaMemcpy2D/3DAsync (cuda_copy.h) around the NCCL group; chunks are sent in
//      rounds of grouped ncclSend/ncclRecv (ncclGroupStart/End, <= 256 calls and <= 64 MiB of
//      staging per round); one event at the end.
// Every wait polls cudaEventQuery + ncclCommGetAsyncError with a backoff up to 1 ms. Wait's
// deadline aborts the communicator (ncclCommAbort, from the worker), fails the batch with
// DEADLINE_EXCEEDED and every later batch of that peer with UNAVAILABLE; the peer stays
// UNAVAILABLE until a new ExportEndpoint/Connect. A NCCL async error (e.g. ncclRemoteError) or a
// dead peer process does the same with UNAVAILABLE. No checksums (Capabilities::checksums ==
// false). Only memory on NcclOptions::device can be registered.

#include <memory>

#include "absl/status/statusor.h"
#include "transport/config.h"
#include "transport/transport.h"

namespace wb::transport {

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportConfig& config);

}  // namespace wb::transport
