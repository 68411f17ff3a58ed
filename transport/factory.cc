#include "transport/factory.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "transport/cpu_affinity.h"
#include "transport/gpu_transports.h"
#include "transport/host_shm/host_shm.h"
#include "transport/host_tcp/host_tcp.h"
#include "transport/gpu_info.h"
#include "base/status_macros.h"

namespace wb::transport {

std::vector<std::string> BuiltInKinds() {
  // Host transports first: TransportSet::Pick takes the first match, and cuda_ipc also reaches
  // host memory (for host <-> device ops), so host <-> host routes must find host_shm/host_tcp
  // before it. Device routes still get cuda_ipc / nccl: the host transports do not reach kCuda.
  std::vector<std::string> kinds = {"host_shm", "host_tcp"};
  if (CudaIpcBuiltIn()) kinds.push_back("cuda_ipc");
  if (NcclBuiltIn()) kinds.push_back("nccl");
  return kinds;
}

absl::Status KindUsable(absl::string_view kind) {
  if (kind == "host_shm" || kind == "host_tcp") return absl::OkStatus();
  if (kind == "cuda_ipc" || kind == "nccl") {
    if (kind == "cuda_ipc" ? !CudaIpcBuiltIn() : !NcclBuiltIn()) {
      return absl::UnimplementedError(absl::StrCat(kind, ": not built into this binary"));
    }
    if (GpuInfo g = ProbeGpus(); g.device_count == 0) {
      return absl::FailedPreconditionError(absl::StrCat(kind, ": no CUDA device visible (", g.unavailable_reason, ")"));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown transport kind '", kind, "' (known: ",
                                                 absl::StrJoin(BuiltInKinds(), ", "), ")"));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(absl::string_view kind, const TransportConfig& config) {
  if (absl::Status s = KindUsable(kind); !s.ok()) return s;
  if ((kind == "host_shm" || kind == "host_tcp") && !config.cpus.empty()) {
    if (absl::Status s = ValidateCpuSet(config.cpus); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(kind, ": cpus ", FormatCpuList(config.cpus), ": ", s.message()));
    }
  }
  if (kind == "host_shm") {
    if (config.host_shm.threads < 1 || config.host_shm.threads > 256) {
      return absl::InvalidArgumentError("host_shm.threads must be in [1, 256]");
    }
    return NewHostShmTransport(config);
  }
  if (kind == "host_tcp") return NewHostTcpTransport(config);
  if (kind == "cuda_ipc") return NewCudaIpcTransport(config);
  return NewNcclTransport(config);
}

absl::StatusOr<TransportSet> CreateTransports(const TransportConfig& config) {
  TransportSet set;
  const bool explicit_kinds = !config.kinds.empty();
  for (const std::string& kind : explicit_kinds ? config.kinds : BuiltInKinds()) {
    if (kind == "nccl") {
      if (absl::Status s = KindUsable(kind); !s.ok()) {
        if (explicit_kinds) return s;
        continue;
      }
      std::vector<int> devices = config.nccl.devices;
      if (devices.empty()) {
        for (int d = 0; d < ProbeGpus().device_count; ++d) devices.push_back(d);
      }
      for (size_t i = 0; i < devices.size(); ++i) {
        for (size_t j = 0; j < i; ++j) {
          if (devices[i] == devices[j]) return absl::InvalidArgumentError(absl::StrCat("nccl: device ", devices[i], " listed twice"));
        }
      }
      for (int d : devices) {
        TransportConfig one = config;
        one.nccl.device = d;
        auto t = CreateTransport(kind, one);
        if (!t.ok()) return Annotate(t.status(), absl::StrCat("nccl lane on GPU ", d));
        set.Add(std::move(*t), d);
      }
      continue;
    }
    auto t = CreateTransport(kind, config);
    if (!t.ok()) {
      // The host kinds are always usable, so their failure is a bad option (an address no NIC
      // has, a CPU set this process may not use): an error even when kinds were not listed, or a
      // misconfigured data plane would silently vanish.
      if (explicit_kinds || kind == "host_shm" || kind == "host_tcp") return t.status();
      continue;
    }
    set.Add(std::move(*t));
  }
  return set;
}

}  // namespace wb::transport
