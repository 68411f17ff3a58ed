// TEST ONLY: the remote endpoint of the transport conformance suite. A separate process with its
// own Transport and its own buffer, driven over stdin/stdout (protocol in peer_process.h), so tests
// cross real process boundaries and can kill -9 it mid-transfer.
//
// Usage: transport_peer --kind=host_tcp --memory=host|cuda --size=N --seed=S [--node_id=X]
//                       [--device=D] [--corrupt]

#include <unistd.h>
#include <xxhash.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "transport/factory.h"
#include "transport/peer_process.h"
#include "transport/test_buffer.h"

namespace wb::transport {
namespace {

std::string Err(const absl::Status& s) {
  std::string msg(s.message());
  for (char& c : msg) {
    if (c == '\n') c = ' ';
  }
  return absl::StrCat("ERR ", static_cast<int>(s.code()), " ", msg);
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) continue;
    size_t eq = a.find('=');
    flags[a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2)] =
        eq == std::string::npos ? "1" : a.substr(eq + 1);
  }
  TransportConfig config;
  config.node_id = flags["node_id"];
  config.test_corrupt_checksummed_payload = flags.count("corrupt") > 0;
  if (flags.count("device")) (void)absl::SimpleAtoi(flags["device"], &config.nccl.device);
  int64_t size = 0;
  uint64_t seed = 0;
  int device = config.nccl.device;
  (void)absl::SimpleAtoi(flags["size"], &size);
  (void)absl::SimpleAtoi(flags["seed"], &seed);
  // The buffer is declared before the transport so that it outlives it: a batch posted but never
  // waited for (RegionInUseCannotBeReleased) may still run on the transport's worker until the
  // transport is destroyed (found by the emulated NCCL: a receive into freed device memory).
  auto buffer = MakeTestBuffer(flags["memory"] == "cuda" ? MemoryKind::kCuda : MemoryKind::kHost, size, device,
                               absl::StrCat("peer buffer (pid ", getpid(), ")"));
  auto transport = CreateTransport(flags["kind"], config);
  if (!transport.ok()) {
    std::cout << Err(transport.status()) << std::endl;
    return 2;
  }
  if (!buffer.ok() || !(*buffer)->Fill(seed).ok()) {
    std::cout << Err(buffer.ok() ? absl::InternalError("fill failed") : buffer.status()) << std::endl;
    return 2;
  }
  Transport& t = **transport;
  auto region = t.RegisterMemory((*buffer)->spec());
  if (!region.ok()) {
    std::cout << Err(region.status()) << std::endl;
    return 2;
  }
  RegionHandle test_region;  // the test's buffer, once imported
  PeerId peer = kNoPeer;

  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> w = absl::StrSplit(line, ' ');
    const std::string& cmd = w[0];
    std::string reply;
    if (cmd == "ID") {
      reply = "OK " + t.instance_id();
    } else if (cmd == "ENDPOINT" && w.size() == 2) {
      auto e = t.ExportEndpoint(w[1]);
      reply = e.ok() ? "OK " + HexEncode(*e) : Err(e.status());
    } else if (cmd == "CONNECT" && w.size() == 2) {
      auto bytes = HexDecode(w[1]);
      auto p = bytes.ok() ? t.Connect(*bytes, absl::Now() + absl::Seconds(30)) : bytes.status();
      if (p.ok()) peer = *p;
      reply = p.ok() ? absl::StrCat("OK ", p->id) : Err(p.status());
    } else if (cmd == "DESC") {
      auto d = t.ExportDescriptor(*region);
      reply = d.ok() ? "OK " + HexEncode(*d) : Err(d.status());
    } else if (cmd == "IMPORT" && w.size() == 2) {
      auto bytes = HexDecode(w[1]);
      auto h = bytes.ok() ? t.ImportDescriptor(*bytes) : bytes.status();
      if (h.ok()) test_region = *h;
      reply = h.ok() ? absl::StrCat("OK ", h->id) : Err(h.status());
    } else if (cmd == "POST" && w.size() == 2) {
      auto bytes = HexDecode(w[1]);
      auto m = bytes.ok() ? DecodeMirror(*bytes) : absl::StatusOr<MirrorBatch>(bytes.status());
      if (!m.ok()) {
        reply = Err(m.status());
      } else {
        Batch b;
        b.tag = m->tag;
        b.checksum = m->checksum;
        b.peer = peer;
        for (auto& o : m->ops) {
          CopyOp op = o.op;
          op.src.region = o.src_is_peer ? *region : test_region;
          op.dst.region = o.src_is_peer ? test_region : *region;
          b.ops.push_back(std::move(op));
        }
        auto id = t.Post(b);
        reply = id.ok() ? absl::StrCat("OK ", id->id) : Err(id.status());
      }
    } else if (cmd == "WAIT" && w.size() == 3) {
      uint64_t id = 0;
      int64_t ms = 0;
      (void)absl::SimpleAtoi(w[1], &id);
      (void)absl::SimpleAtoi(w[2], &ms);
      absl::Status s = t.Wait(BatchId{id}, absl::Now() + absl::Milliseconds(ms));
      reply = s.ok() ? "OK" : Err(s);
    } else if (cmd == "READ" && w.size() == 3) {
      int64_t off = 0, len = 0;
      (void)absl::SimpleAtoi(w[1], &off);
      (void)absl::SimpleAtoi(w[2], &len);
      std::string out(len > 0 ? len : 0, '\0');
      absl::Status s = (*buffer)->Read(off, out.data(), len);
      reply = s.ok() ? "OK " + HexEncode(out) : Err(s);
    } else if (cmd == "HASH" && w.size() == 3) {
      int64_t off = 0, len = 0;
      (void)absl::SimpleAtoi(w[1], &off);
      (void)absl::SimpleAtoi(w[2], &len);
      std::string out(len > 0 ? len : 0, '\0');
      absl::Status s = (*buffer)->Read(off, out.data(), len);
      reply = s.ok() ? absl::StrCat("OK ", XXH3_64bits(out.data(), out.size())) : Err(s);
    } else if (cmd == "FILL" && w.size() == 2) {
      (void)absl::SimpleAtoi(w[1], &seed);
      absl::Status s = (*buffer)->Fill(seed);
      reply = s.ok() ? "OK" : Err(s);
    } else if (cmd == "NAME") {  // shm name of the buffer (host), so a test that kills us can unlink it
      reply = "OK " + (*buffer)->spec().shared_name;
    } else if (cmd == "QUIT") {
      break;
    } else {
      reply = Err(absl::InvalidArgumentError("unknown command " + cmd));
    }
    std::cout << reply << std::endl;
  }
  return 0;
}

}  // namespace
}  // namespace wb::transport

int main(int argc, char** argv) { return wb::transport::Main(argc, argv); }
