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
// `kinds` list creates every usable kind and silently skips unusable ones (a host kind is always
// usable, so its creation failure, e.g. a TcpOptions::local_addresses entry no NIC has, is still
// returned); with an explicit list it fails if any listed kind cannot be created.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/config.h"
#include "transport/transport.h"

namespace wb::transport {

// Kinds compiled into this binary, in preference order.
std::vector<std::string> BuiltInKinds();
// OK if `kind` is built in and usable on this machine right now, else why not.
absl::Status KindUsable(absl::string_view kind);

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(absl::string_view kind,
                                                           const TransportConfig& config);

// A set of transports and the rule the executor uses to choose one per op route. A transport may
// be bound to one CUDA device (nccl: one transport per GPU, a "lane"); the others reach every
// device or none (device -1).
class TransportSet {
 public:
  void Add(std::unique_ptr<Transport> t, int device = -1) {
    transports_.push_back(std::move(t));
    devices_.push_back(device);
  }
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
  // The first transport of `kind`, or nullptr.
  Transport* Find(absl::string_view kind) const {
    for (const auto& t : transports_) {
      if (t->capabilities().kind == kind) return t.get();
    }
    return nullptr;
  }
  // The device-bound transports of `kind`, by device (empty when there are none).
  std::map<int, Transport*> ByDevice(absl::string_view kind) const {
    std::map<int, Transport*> out;
    for (size_t i = 0; i < transports_.size(); ++i) {
      if (devices_[i] >= 0 && transports_[i]->capabilities().kind == kind) out.emplace(devices_[i], transports_[i].get());
    }
    return out;
  }
  // The device `t` is bound to, or -1.
  int DeviceOf(const Transport* t) const {
    for (size_t i = 0; i < transports_.size(); ++i) {
      if (transports_[i].get() == t) return devices_[i];
    }
    return -1;
  }
  const std::vector<std::unique_ptr<Transport>>& all() const { return transports_; }

 private:
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<int> devices_;  // parallel to transports_
};

// Every kind of config.kinds (empty: every usable kind, unusable ones skipped); "nccl" once per
// device of config.nccl.devices (empty: per visible GPU), each bound to its device.
absl::StatusOr<TransportSet> CreateTransports(const TransportConfig& config);

}  // namespace wb::transport
