#pragma once
// The explicit transport factory: which implementations exist is decided here, from the config and
// from what the machine has (built with CUDA/NCCL? GPU visible?). No static registration: adding a
// transport means adding a line to factory.cc.
//
// Kinds:
//   "host_shm"  same node, host memory: memcpy between mapped POSIX shm regions on a thread pool.
//   "host_tcp"  across nodes, host memory: TCP with parallel streams, optional xxh3 checksums.
//   "cuda_ipc"  same node, CUDA memory: CUDA IPC handles + cudaMemcpy*Async on dedicated streams.
//   "nccl"      across nodes, CUDA memory: grouped ncclSend/ncclRecv on non-blocking communicators.
//
// Contract: CreateTransport() fails with UNIMPLEMENTED for a kind not built into this binary,
// FAILED_PRECONDITION for a kind built in but unusable here (e.g. no GPU visible; the message says
// why), INVALID_ARGUMENT for an unknown kind or a bad option. CreateTransports() with an empty
// `kinds` list creates every usable kind and silently skips unusable ones; with an explicit list
// it fails if any listed kind cannot be created.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace wb::transport {

struct HostShmOptions {
  int threads = 4;                          // copy thread pool size
  int64_t split_bytes = int64_t{4} << 20;   // contiguous runs longer than this are split across threads
};

struct TcpOptions {
  std::string bind_address = "127.0.0.1";  // data-channel listen address (port chosen by the kernel)
  std::string advertise_address;           // address peers dial; empty = bind_address
  int streams = 4;                         // parallel TCP connections per peer
  int64_t chunk_bytes = int64_t{1} << 20;  // max payload per frame
};

struct CudaIpcOptions {
  int streams = 2;  // dedicated copy streams per device
};

struct NcclOptions {
  int device = 0;  // CUDA device the communicators live on
};

struct TransportConfig {
  std::vector<std::string> kinds;  // empty = every usable kind
  // Identity of this node; descriptors from another node are rejected by same-node transports.
  // Empty = derived from the kernel boot id (shared by every process/container of one machine).
  std::string node_id;
  HostShmOptions host_shm;
  TcpOptions tcp;
  CudaIpcOptions cuda_ipc;
  NcclOptions nccl;
  // TEST ONLY: flip one payload byte of every checksummed batch after the sender's checksum is
  // taken, so tests can prove mismatches are detected. Never set in production.
  bool test_corrupt_checksummed_payload = false;
};

// Kinds compiled into this binary, in preference order.
std::vector<std::string> BuiltInKinds();
// OK if `kind` is built in and usable on this machine right now, else why not.
absl::Status KindUsable(absl::string_view kind);

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(absl::string_view kind,
                                                           const TransportConfig& config);

// A set of transports and the rule the executor uses to choose one per op route.
class TransportSet {
 public:
  void Add(std::unique_ptr<Transport> t) { transports_.push_back(std::move(t)); }
  // The first transport (in creation order) that reaches both memory kinds and the given locality;
  // nullptr if none.
  Transport* Pick(MemoryKind src, MemoryKind dst, bool cross_node) const {
    for (const auto& t : transports_) {
      Capabilities c = t->capabilities();
      if (!c.Reaches(src) || !c.Reaches(dst)) continue;
      if (cross_node ? c.cross_node : c.same_node) return t.get();
    }
    return nullptr;
  }
  Transport* Find(absl::string_view kind) const {
    for (const auto& t : transports_) {
      if (t->capabilities().kind == kind) return t.get();
    }
    return nullptr;
  }
  const std::vector<std::unique_ptr<Transport>>& all() const { return transports_; }

 private:
  std::vector<std::unique_ptr<Transport>> transports_;
};

absl::StatusOr<TransportSet> CreateTransports(const TransportConfig& config);

}  // namespace wb::transport
