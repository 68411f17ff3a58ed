// bench:digest_wire - what end-to-end digests cost on the host path, without a cluster: one process,
// two host_tcp transports over loopback, one op of --mib MiB (bf16) moved A -> B, rounds of three
// settings interleaved:
//   plain      the transfer only;
//   memory     the transfer, the source hashed from memory while it runs (as the sending node's
//              background hashing) and what landed hashed from memory after it (as the receiving
//              node after a bucket of one batch): digest::DigestMany over the boxes;
//   transport  the transfer with transport::UnitHashes on both sides (host_tcp hashes each chunk of
//              2^20 elements as it sends / right after it landed), digests combined from them;
//   transport_send, transport_recv: the same on one side only.
// Per setting: median wall seconds and median process CPU seconds (user + system, every thread) per
// round. Then what hashing itself costs on this CPU, measured in the same run (XXH3 as host_tcp calls
// it, one thread): `hash_hot_GBps` over a 256 KiB slice that stays in cache (host_tcp's hash slice),
// `hash_cold_GBps` over the whole source from memory; `digest_hot_cpu_s` = both sides' bytes at the
// hot rate (the floor of hashing in the transport: each slice hashed while the socket copy has it in
// cache), `digest_cold_cpu_s` the same at the cold rate, and `transport_extra_cpu_s` = transport -
// plain CPU (what hashing in host_tcp costs here). Prints one JSON object with --json.
#include <sys/resource.h>
#include <xxhash.h>
// The same XXH3 entry points as host_tcp (the widest vector unit of this CPU).
#include <xxh_x86dispatch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "daemon/digest/digest.h"
#include "transport/host_tcp/host_tcp.h"

ABSL_FLAG(int, mib, 512, "bytes moved per round, MiB");
ABSL_FLAG(int, rounds, 5, "rounds (each runs every setting once)");
ABSL_FLAG(int, streams, 4, "host_tcp streams (weightbridged's --tcp_streams default)");
ABSL_FLAG(int, hash_threads, 2, "memory: threads hashing (the node's pool; 2 cores here)");
ABSL_FLAG(bool, json, false, "print one JSON object");

namespace {

using namespace wb;
using namespace wb::transport;

double CpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// XXH3-64 throughput in GB/s, one thread: `hot` = the first 256 KiB of `p` hashed again and again
// (a new seed each time, so no pass is skipped), else all `n` bytes once from memory (best of 3).
double HashGBps(const uint8_t* p, int64_t n, bool hot) {
  const int64_t slice = int64_t{256} << 10;
  uint64_t sink = 0;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const absl::Time t0 = absl::Now();
    int64_t done = 0;
    if (hot) {
      for (uint64_t k = 0; done < n; ++k, done += slice) sink ^= XXH3_64bits_withSeed(p, static_cast<size_t>(slice), k);
    } else {
      for (int64_t off = 0; off < n; off += slice, done += slice) sink ^= XXH3_64bits_withSeed(p + off, static_cast<size_t>(std::min(slice, n - off)), 0);
    }
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    if (s > 0) best = std::max(best, done / s / 1e9);
  }
  if (sink == 1) std::fprintf(stderr, " ");  // keeps the hashes from being optimised away
  return best;
}

struct Setup {
  std::unique_ptr<Transport> a, b;
  PeerId a_to_b, b_to_a;
  RegionHandle src, dst, src_in_b, dst_in_a;
};

int Run() {
  const int64_t bytes = int64_t{absl::GetFlag(FLAGS_mib)} << 20;
  TransportConfig c;
  c.tcp.streams = absl::GetFlag(FLAGS_streams);
  c.tcp.chunk_bytes = digest::ChunkBytes(2);  // frames of whole units also when only the receiver hashes
  Setup s;
  auto a = NewHostTcpTransport(c);
  auto b = NewHostTcpTransport(c);
  if (!a.ok() || !b.ok()) {
    std::fprintf(stderr, "digest_wire: transports: %s %s\n", a.status().ToString().c_str(), b.status().ToString().c_str());
    return 1;
  }
  s.a = std::move(*a);
  s.b = std::move(*b);
  auto ea = s.a->ExportEndpoint(s.b->instance_id());
  auto eb = s.b->ExportEndpoint(s.a->instance_id());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<PeerId> from_b = absl::UnknownError("not run");
  std::thread th([&] { from_b = s.b->Connect(*ea, deadline); });
  absl::StatusOr<PeerId> from_a = s.a->Connect(*eb, deadline);
  th.join();
  if (!from_a.ok() || !from_b.ok()) {
    std::fprintf(stderr, "digest_wire: connect failed\n");
    return 1;
  }
  s.a_to_b = *from_a;
  s.b_to_a = *from_b;
  std::vector<uint8_t> src(static_cast<size_t>(bytes)), dst(static_cast<size_t>(bytes), 0);
  for (size_t i = 0; i < src.size(); i += 8) src[i] = static_cast<uint8_t>(i * 2654435761u >> 24);
  s.src = *s.a->RegisterMemory({MemoryKind::kHost, src.data(), bytes, -1, "", 0, "src"});
  s.dst = *s.b->RegisterMemory({MemoryKind::kHost, dst.data(), bytes, -1, "", 0, "dst"});
  s.src_in_b = *s.b->ImportDescriptor(*s.a->ExportDescriptor(s.src));
  s.dst_in_a = *s.a->ImportDescriptor(*s.b->ExportDescriptor(s.dst));
  const digest::StridedBox src_box{src.data(), {bytes / 2}, {1}, 2}, dst_box{dst.data(), {bytes / 2}, {1}, 2};
  const digest::Digest want = *digest::BoxDigest(src_box);

  const std::vector<std::string> names = {"plain", "memory", "transport", "transport_send", "transport_recv"};
  std::map<std::string, std::vector<double>> wall, cpu;
  uint64_t tag = 1;
  for (int r = 0; r < absl::GetFlag(FLAGS_rounds); ++r) {
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string& name = names[r % 2 ? names.size() - 1 - i : i];
      Batch ba, bb;
      ba.tag = bb.tag = tag++;
      ba.peer = s.a_to_b;
      bb.peer = s.b_to_a;
      CopyOp op;
      op.shape = {bytes / 2};
      op.element_size = 2;
      op.src = {s.src, 0, {1}};
      op.dst = {s.dst_in_a, 0, {1}};
      ba.ops = {op};
      op.src.region = s.src_in_b;
      op.dst.region = s.dst;
      bb.ops = {op};
      if (name.rfind("transport", 0) == 0) {
        for (Batch* x : {&ba, &bb}) {
          if ((name == "transport_send" && x == &bb) || (name == "transport_recv" && x == &ba)) continue;
          x->unit_hashes = std::make_shared<UnitHashes>();
          x->unit_hashes->unit_bytes = {digest::ChunkBytes(2)};
        }
      }
      std::memset(dst.data(), 0, dst.size());
      const double c0 = CpuSeconds();
      const absl::Time t0 = absl::Now();
      std::thread source_hash;
      digest::Digest source = 0, landed = 0;
      if (name == "memory") source_hash = std::thread([&] { source = (*digest::DigestMany({src_box}, absl::GetFlag(FLAGS_hash_threads)))[0]; });
      auto ia = s.a->Post(ba);
      auto ib = s.b->Post(bb);
      absl::Status sa = ia.ok() ? s.a->Wait(*ia, absl::Now() + absl::Seconds(120)) : ia.status();
      absl::Status sb = ib.ok() ? s.b->Wait(*ib, absl::Now() + absl::Seconds(120)) : ib.status();
      if (!sa.ok() || !sb.ok()) {
        std::fprintf(stderr, "digest_wire: %s: %s %s\n", name.c_str(), sa.ToString().c_str(), sb.ToString().c_str());
        return 1;
      }
      if (name == "memory") {
        landed = (*digest::DigestMany({dst_box}, absl::GetFlag(FLAGS_hash_threads)))[0];
        source_hash.join();
      } else if (name != "plain") {
        for (const Batch* x : {&ba, &bb}) {
          if (x->unit_hashes == nullptr) continue;
          if (!x->unit_hashes->complete[0]) {
            std::fprintf(stderr, "digest_wire: transport hashes incomplete\n");
            return 1;
          }
          (x == &ba ? source : landed) = *digest::DigestFromChunks(bytes, 2, x->unit_hashes->hashes[0]);
        }
        if (ba.unit_hashes == nullptr) source = want;  // one side only: the other is not measured
        if (bb.unit_hashes == nullptr) landed = want;
      }
      const double w = absl::ToDoubleSeconds(absl::Now() - t0), u = CpuSeconds() - c0;
      if (name != "plain" && (source != want || landed != want)) {
        std::fprintf(stderr, "digest_wire: %s: digests differ from the source's\n", name.c_str());
        return 1;
      }
      wall[name].push_back(w);
      cpu[name].push_back(u);
      std::fprintf(stderr, "digest_wire: round %d %-9s wall %.3f s cpu %.3f s\n", r + 1, name.c_str(), w, u);
    }
  }
  const double hot = HashGBps(src.data(), bytes, true), cold = HashGBps(src.data(), bytes, false);
  const double hot_cpu = hot > 0 ? 2.0 * bytes / 1e9 / hot : 0, cold_cpu = cold > 0 ? 2.0 * bytes / 1e9 / cold : 0;
  const double extra = Median(cpu["transport"]) - Median(cpu["plain"]);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("{\"bytes\":%lld", static_cast<long long>(bytes));
    for (const std::string& n : names) std::printf(",\"%s_s\":%.4f,\"%s_cpu_s\":%.4f", n.c_str(), Median(wall[n]), n.c_str(), Median(cpu[n]));
    std::printf(",\"hash_hot_GBps\":%.2f,\"hash_cold_GBps\":%.2f,\"digest_hot_cpu_s\":%.4f,\"digest_cold_cpu_s\":%.4f,\"transport_extra_cpu_s\":%.4f}\n",
                hot, cold, hot_cpu, cold_cpu, extra);
  } else {
    std::printf("%-10s %10s %10s  (%lld MiB, medians of %d rounds)\n", "setting", "wall_s", "cpu_s", static_cast<long long>(bytes >> 20),
                absl::GetFlag(FLAGS_rounds));
    for (const std::string& n : names) std::printf("%-10s %10.3f %10.3f\n", n.c_str(), Median(wall[n]), Median(cpu[n]));
    std::printf("XXH3 one thread: %.1f GB/s in cache (256 KiB slice), %.1f GB/s from memory\n", hot, cold);
    std::printf("hashing both sides' %lld MiB: %.3f s CPU in cache, %.3f s from memory; host_tcp's hashing cost here: %.3f s CPU "
                "(transport - plain)\n",
                static_cast<long long>(bytes >> 20), hot_cpu, cold_cpu, extra);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return Run();
}
