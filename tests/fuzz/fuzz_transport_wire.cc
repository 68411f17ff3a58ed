// libFuzzer target: the transport wire decoders that read bytes from another process or node:
// host_shm Connect (endpoint) and ImportDescriptor (descriptor, maps a shm segment), host_tcp
// ImportDescriptor, the conformance peer's DecodeMirror/HexDecode. The first input byte picks the
// decoder. Contract: a status, never a crash or an out-of-range read or mapping.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "transport/config.h"
#include "transport/host_shm/host_shm.h"
#include "transport/host_tcp/host_tcp.h"
#include "transport/testing/peer_process.h"
#include "base/shm_segment.h"

namespace {

using namespace wb::transport;

// A real segment whose name the seed corpus uses, so descriptors can reach the mapping code.
constexpr char kSegment[] = "/wb-fuzz-descriptor";
constexpr int64_t kSegmentBytes = 4096;

struct Fixture {
  std::unique_ptr<Transport> shm;
  std::unique_ptr<Transport> tcp;
  ShmSegment segment;

  Fixture() {
    TransportConfig config;
    config.node_id = "fuzznode";  // the node id in the seed descriptors
    config.host_shm.threads = 1;
    config.tcp.streams = 1;
    shm = NewHostShmTransport(config);
    auto t = NewHostTcpTransport(config);
    if (t.ok()) tcp = std::move(*t);
    auto seg = ShmSegment::Create(kSegment, kSegmentBytes);
    if (!seg.ok()) seg = ShmSegment::Open(kSegment);  // left over by a killed run
    if (seg.ok()) segment = std::move(*seg);
    std::atexit([] { (void)ShmSegment::Unlink(kSegment); });
  }
};

Fixture& F() {
  static Fixture* f = new Fixture();
  return *f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Fixture& f = F();
  absl::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 5) {
    case 0:
      (void)f.shm->Connect(bytes, absl::Now());
      break;
    case 1: {
      auto h = f.shm->ImportDescriptor(bytes);
      if (h.ok()) (void)f.shm->Release(*h);
      break;
    }
    case 2:
      if (f.tcp) {
        auto h = f.tcp->ImportDescriptor(bytes);
        if (h.ok()) (void)f.tcp->Release(*h);
      }
      break;
    case 3:
      (void)DecodeMirror(bytes);
      break;
    case 4: {
      auto raw = HexDecode(bytes);
      if (raw.ok()) (void)DecodeMirror(*raw);
      break;
    }
  }
  return 0;
}
