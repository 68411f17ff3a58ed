#pragma once
// "host_shm": same-node host-memory transport. One-sided: the posting process (the node daemon)
// memcpy's between regions it registered or imported; imports map the exporter's POSIX shm segment
// (base/shm_segment.h). Copies run on a small thread pool; ops are cut into tasks of about
// HostShmOptions::split_bytes so one large contiguous run is spread over every thread and many
// small ops are grouped. Optional checksums hash the source and destination bytes of every task
// (XXH3_64) after copying and report DATA_LOSS on any difference.

#include <memory>

#include "transport/config.h"
#include "transport/transport.h"

namespace wb::transport {

std::unique_ptr<Transport> NewHostShmTransport(const TransportConfig& config);

}  // namespace wb::transport
