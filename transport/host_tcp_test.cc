// host_tcp unit tests that need two transports in one process (the conformance suite covers the
// rest against a peer process).
#include "transport/host_tcp.h"

#include <sys/mman.h>

#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace wb::transport {
namespace {

struct Pair {
  std::unique_ptr<Transport> a, b;
  PeerId a_to_b, b_to_a;
};

absl::StatusOr<Pair> Connected(const TransportConfig& ca, const TransportConfig& cb) {
  Pair p;
  auto a = NewHostTcpTransport(ca);
  if (!a.ok()) return a.status();
  auto b = NewHostTcpTransport(cb);
  if (!b.ok()) return b.status();
  p.a = std::move(*a);
  p.b = std::move(*b);
  auto ea = p.a->ExportEndpoint(p.b->instance_id());
  auto eb = p.b->ExportEndpoint(p.a->instance_id());
  if (!ea.ok()) return ea.status();
  if (!eb.ok()) return eb.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<PeerId> from_b = absl::UnknownError("not run");
  std::thread th([&] { from_b = p.b->Connect(*ea, deadline); });
  absl::StatusOr<PeerId> from_a = p.a->Connect(*eb, deadline);
  th.join();
  if (!from_a.ok()) return from_a.status();
  if (!from_b.ok()) return from_b.status();
  p.a_to_b = *from_a;
  p.b_to_a = *from_b;
  return p;
}

absl::StatusOr<RegionHandle> Import(Transport& exporter, RegionHandle h, Transport& importer) {
  auto d = exporter.ExportDescriptor(h);
  if (!d.ok()) return d.status();
  return importer.ImportDescriptor(*d);
}

CopyOp Contig(RegionHandle src, int64_t src_off, RegionHandle dst, int64_t dst_off, int64_t n) {
  CopyOp op;
  op.shape = {n};
  op.element_size = 1;
  op.src = {src, src_off, {1}};
  op.dst = {dst, dst_off, {1}};
  return op;
}

// transport.h: "After Wait returns, the transport holds no reference to the batch's memory."
// A mixed batch whose receive fails its checksum must not leave its own send chunks queued: here
// they sit behind a stalled batch, Wait returns, the source is unmapped, and the stall is then
// released. Touching the unmapped source afterwards would crash this test.
TEST(HostTcpTest, FailedBatchSendsNothingAfterWait) {
  TransportConfig ca;
  ca.tcp.streams = 1;  // one data stream: Y's chunks queue behind X's
  ca.tcp.chunk_bytes = 64 << 10;
  TransportConfig cb = ca;
  cb.test_corrupt_checksummed_payload = true;  // what B sends with checksums arrives corrupted
  auto pair = Connected(ca, cb);
  ASSERT_TRUE(pair.ok()) << pair.status();
  Transport& a = *pair->a;
  Transport& b = *pair->b;

  // Larger than loopback socket buffers: A's writer blocks inside X until B posts X's mirror.
  constexpr int64_t kBig = int64_t{48} << 20;
  constexpr int64_t kSmall = 4096;
  constexpr int64_t kMapped = int64_t{1} << 20;
  std::vector<char> a_big(kBig, 'x'), a_recv(kSmall, 0), b_buf(kBig + kMapped + kSmall, 0);
  void* mapped = mmap(nullptr, kMapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  std::memset(mapped, 'm', kMapped);

  auto a_big_h = a.RegisterMemory({MemoryKind::kHost, a_big.data(), kBig, -1, "", 0, "a big"});
  auto a_recv_h = a.RegisterMemory({MemoryKind::kHost, a_recv.data(), kSmall, -1, "", 0, "a recv"});
  auto a_map_h = a.RegisterMemory({MemoryKind::kHost, mapped, kMapped, -1, "", 0, "a mapped"});
  auto b_h = b.RegisterMemory({MemoryKind::kHost, b_buf.data(), static_cast<int64_t>(b_buf.size()), -1, "", 0, "b"});
  ASSERT_TRUE(a_big_h.ok() && a_recv_h.ok() && a_map_h.ok() && b_h.ok());
  auto b_in_a = Import(b, *b_h, a);
  auto a_big_in_b = Import(a, *a_big_h, b);
  auto a_recv_in_b = Import(a, *a_recv_h, b);
  auto a_map_in_b = Import(a, *a_map_h, b);
  ASSERT_TRUE(b_in_a.ok() && a_big_in_b.ok() && a_recv_in_b.ok() && a_map_in_b.ok());

  // X (tag 1): A -> B, 48 MiB; B posts its mirror only at the end.
  Batch x;
  x.tag = 1;
  x.peer = pair->a_to_b;
  x.ops = {Contig(*a_big_h, 0, *b_in_a, 0, kBig)};
  auto ax = a.Post(x);
  ASSERT_TRUE(ax.ok()) << ax.status();

  // Y (tag 2), checksummed, both directions: B -> A (arrives corrupted), A -> B from `mapped`.
  Batch ya;
  ya.tag = 2;
  ya.peer = pair->a_to_b;
  ya.checksum = true;
  ya.ops = {Contig(*b_in_a, kBig + kMapped, *a_recv_h, 0, kSmall), Contig(*a_map_h, 0, *b_in_a, kBig, kMapped)};
  Batch yb = ya;
  yb.peer = pair->b_to_a;
  yb.ops = {Contig(*b_h, kBig + kMapped, *a_recv_in_b, 0, kSmall), Contig(*a_map_in_b, 0, *b_h, kBig, kMapped)};
  auto ay = a.Post(ya);
  ASSERT_TRUE(ay.ok()) << ay.status();
  auto by = b.Post(yb);
  ASSERT_TRUE(by.ok()) << by.status();

  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::Status sy = a.Wait(*ay, deadline);
  EXPECT_EQ(sy.code(), absl::StatusCode::kDataLoss) << sy;
  // From here on A must not read `mapped`: release it and unmap it.
  ASSERT_TRUE(a.Release(*a_map_h).ok());
  ASSERT_EQ(munmap(mapped, kMapped), 0);

  absl::Status sby = b.Wait(*by, deadline);
  EXPECT_EQ(sby.code(), absl::StatusCode::kDataLoss) << sby;
  // Unstall X. The channel may have been closed after Y failed (transport.h allows it); either
  // way X must finish (or fail) without anyone touching Y's unmapped source.
  Batch xb = x;
  xb.peer = pair->b_to_a;
  xb.ops = {Contig(*a_big_in_b, 0, *b_h, 0, kBig)};
  auto bx = b.Post(xb);
  if (bx.ok()) (void)b.Wait(*bx, deadline);
  absl::Status sx = a.Wait(*ax, deadline);
  EXPECT_LT(absl::Now(), deadline) << sx;
  pair->a.reset();
  pair->b.reset();
}

}  // namespace
}  // namespace wb::transport
