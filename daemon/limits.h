#pragma once
// Resource limits on what clients (workers) and peers (nodes) may ask of a daemon. Every check is
// done on the request as received, BEFORE anything is allocated from its numbers, so a hostile or
// buggy client gets INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming the field, never a crash or an
// allocation of the size it asked for (shape products are computed with overflow checks).
//
// INVALID_ARGUMENT: the request is malformed (zero/negative dims, overflowing products, mismatched
// box ranks, duplicate buffer ids). RESOURCE_EXHAUSTED: well-formed but over a configured limit.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "proto/weightbridge.pb.h"

namespace wb::daemon {

struct Limits {
  int64_t max_message_bytes = int64_t{256} << 20;  // gRPC receive limit on every server
  int max_tensors_per_model = 1 << 17;
  int max_dims = 8;                                  // rank of a tensor / box
  int64_t max_tensor_elements = int64_t{1} << 40;
  int max_pieces_per_layout = 1 << 20;
  int max_buffers_per_worker = 1024;
  int max_vmm_fds_per_worker = 8192;                 // fd channel: CUDA VMM allocations per worker (fds held)
  int max_vmm_fds_per_uid = 65536;                   // fd channel: all workers of one uid
  int max_vmm_fds_per_node = 131072;                 // fd channel: the node in total (and <= RLIMIT_NOFILE / 2)
  int64_t max_buffer_bytes = int64_t{1} << 40;       // one registered buffer
  int64_t max_worker_bytes = int64_t{1} << 40;       // all buffers of one worker (staging mirrors them)
  // GPU staging on (--gpu_staging_bytes): CUDA buffers are mirrored on the GPU, under the per-GPU
  // budget, so only host buffers count toward max_worker_bytes (the host staging budget).
  bool cuda_staged_on_gpu = false;
  int max_concurrent_versions = 16;                  // snapshots a trainer may hold (published, not sent)
  int max_name_bytes = 1024;                         // ids and tensor names
  int max_status_watchers = 64;                      // open CoordinatorService.WatchStatus streams
  // Calls that block until something happens (WaitVersion), per server: over it RESOURCE_EXHAUSTED
  // at once. Each holds a server thread; the servers' thread quota is this plus headroom for
  // short calls (heartbeats), so blocked calls can never starve them.
  int max_blocked_calls = 512;
  // Of those, what one caller may hold at once, so that no one caller starves the others: on the
  // worker socket one worker (its WaitVersion, Publish, Apply and BeginUpdate calls together; a
  // WaitVersion naming none of the caller's workers counts for its process); at the coordinator
  // one node (its WaitVersion, Publish and Drain calls; and of the ExchangeMagnitudes slots a
  // share computed the same way). 0 = max(16, max_blocked_calls / 4) (BlockedCallsPerNode).
  int max_blocked_calls_per_worker = 4;
  int max_blocked_calls_per_node = 0;
  // The longest a call may wait (timeout_ms of WaitVersion, Publish, Apply, BeginUpdate, Drain,
  // ExchangeMagnitudes): a longer timeout_ms is clamped to it when the call is
  // received, so a blocked call always ends (DEADLINE_EXCEEDED) and gives its slot back.
  int64_t max_wait_ms = int64_t{3600} * 1000;
  // Server threads beyond max_blocked_calls (ServerThreadBudget): room for short calls, including
  // a burst of calls refused at the blocked-call limit (each holds a thread while it is refused).
  // A call that finds no thread is answered RESOURCE_EXHAUSTED "Server Threadpool Exhausted" by
  // gRPC and sent again by the daemons' clients (proto/grpc_retry.h). Not a flag: tests shrink it.
  int server_thread_headroom = 256;
};

// The blocked-call slots one node may hold at the coordinator out of `total`:
// max_blocked_calls_per_node, or when 0, max(16, total / 4); never more than `total`.
int BlockedCallsPerNode(const Limits& limits, int total);

// The gRPC message size set on the daemons' TCP servers and their channels to each other (both
// directions): the larger of max_message_bytes and the worst inventory the limits allow
// (max_tensors_per_model tensors with max_name_bytes names and max_dims dims, twice: a
// JoinWorkerResponse carries the tensors and the spec), capped at INT32_MAX.
int64_t PeerMessageBytes(const Limits& limits);

// Threads a server may use (grpc::ResourceQuota::SetMaxThreads): max_blocked_calls + server_thread_headroom.
int ServerThreadBudget(const Limits& limits);

// Model spec: tensor count, names, dims > 0, element count and byte size without overflow,
// worker counts. hf_config_json size is bounded by max_message_bytes already.
absl::Status CheckModelSpec(const ::weightbridge::v1::ModelSpec& spec, const Limits& limits);

// A worker's buffers + layout (RegisterLayout / SubmitLayout carry the same two fields): buffer
// count, per-buffer and total size, duplicate ids, piece count, box/stride ranks, offsets.
absl::Status CheckLayoutRequest(const google::protobuf::RepeatedPtrField<::weightbridge::v1::BufferSpec>& buffers,
                                const ::weightbridge::v1::LayoutSpec& layout, const Limits& limits);

// Free text a node sends the coordinator (ReportDoneRequest.error): the coordinator keeps it in
// the version's record (status, wbctl), logs it, and sends it on to every node of the version in
// AbortVersion, so it is bounded where it enters (the thirty-eighth session's size probe: a 10 MB
// error was stored and forwarded whole).
constexpr size_t kMaxNodeTextBytes = 4096;

// `text` cut to its first kMaxNodeTextBytes bytes (never inside a UTF-8 sequence) and marked
// "... (truncated: N bytes)"; unchanged when it fits.
std::string BoundNodeText(std::string text);

// Ids chosen by callers (model, worker, node): non-empty, bounded, printable.
absl::Status CheckId(const std::string& what, const std::string& id, const Limits& limits);

// A plan slice installed on node `node_id` (NodeService.InstallPlan): every piece of each rollout
// on this node in the slice (a catch-up slice: each one it writes into, the destination of at
// least one op) is covered by the ops landing in that piece: their boxes, clipped to the piece, do
// not overlap (the planner writes each element once) and add up to its elements. A version
// committed from a slice that covers a rollout in part would make its next Apply part old, part
// new while reporting it whole (issue 15, found by tests/probe/rpc_probe_test; overlapping ops
// whose sum hid a hole, hostile review of the twenty-sixth session). INVALID_ARGUMENT naming
// model, epoch, node, rollout, piece and tensor (and the two overlapping ops); RESOURCE_EXHAUSTED
// when ruling out overlaps would take more than 2^27 box comparisons.
absl::Status CheckSliceCoversLocalRollouts(const ::weightbridge::v1::PlanSlice& slice, const std::string& node_id);

}  // namespace wb::daemon
