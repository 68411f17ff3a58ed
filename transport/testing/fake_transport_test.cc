// What the fake adds beyond the conformance suite: injected failures, vanishing peers seen by
// both sides, re-connecting after a cancelled batch, and its simulated link speed.
#include "transport/testing/fake_transport.h"

#include <cstring>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace wb::transport::testing {
namespace {

struct Side {
  std::unique_ptr<Transport> t;
  std::vector<uint8_t> mem;
  RegionHandle local, remote;
  PeerId peer;
};

// Both sides Connect to each other (collective), as after a broken channel.
void ConnectBoth(Side& a, Side& b) {
  const std::string ea = *a.t->ExportEndpoint(b.t->instance_id());
  const std::string eb = *b.t->ExportEndpoint(a.t->instance_id());
  absl::StatusOr<PeerId> pa;
  std::thread th([&] { pa = a.t->Connect(eb, absl::Now() + absl::Seconds(5)); });
  auto pb = b.t->Connect(ea, absl::Now() + absl::Seconds(5));
  th.join();
  ASSERT_TRUE(pa.ok()) << pa.status();
  ASSERT_TRUE(pb.ok()) << pb.status();
  a.peer = *pa;
  b.peer = *pb;
}

// Two connected fakes on `fabric`, each with `size` bytes registered and the other's imported.
void ConnectPair(FakeFabric& fabric, Side& a, Side& b, int64_t size, int64_t link = 0) {
  FakeOptions o;
  o.fabric = &fabric;
  o.link_bytes_per_second = link;
  a.t = MakeFakeTransport(o);
  b.t = MakeFakeTransport(o);
  for (Side* s : {&a, &b}) {
    s->mem.assign(size, 0);
    s->local = *s->t->RegisterMemory({MemoryKind::kHost, s->mem.data(), size, -1, "", 0, "mem"});
  }
  ConnectBoth(a, b);
  a.remote = *a.t->ImportDescriptor(*b.t->ExportDescriptor(b.local));
  b.remote = *b.t->ImportDescriptor(*a.t->ExportDescriptor(a.local));
}

// a sends `n` bytes from offset 0 to b's offset 0 (the mirror posted by b).
Batch Send(const Side& s, bool sender, int64_t n, uint64_t tag) {
  Batch batch;
  batch.tag = tag;
  batch.peer = s.peer;
  CopyOp op;
  op.shape = {n};
  op.element_size = 1;
  op.src = {sender ? s.local : s.remote, 0, {1}};
  op.dst = {sender ? s.remote : s.local, 0, {1}};
  batch.ops.push_back(op);
  return batch;
}

TEST(FakeTransport, MovesBytesBetweenMirroredBatches) {
  FakeFabric fabric;
  Side a, b;
  ConnectPair(fabric, a, b, 4096);
  std::memset(a.mem.data(), 7, 4096);
  auto ia = a.t->Post(Send(a, true, 4096, 1));
  auto ib = b.t->Post(Send(b, false, 4096, 1));
  ASSERT_TRUE(ia.ok() && ib.ok());
  EXPECT_TRUE(a.t->Wait(*ia, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(b.t->Wait(*ib, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(b.mem, a.mem);
  EXPECT_EQ(a.t->stats().bytes_copied, 4096);
}

TEST(FakeTransport, InjectedFailureFailsBothSidesAndWritesNothing) {
  FakeFabric fabric;
  Side a, b;
  ConnectPair(fabric, a, b, 1024);
  std::memset(a.mem.data(), 9, 1024);
  fabric.FailNextBatches(a.t->instance_id(), absl::UnavailableError("injected: link down"));
  auto ia = a.t->Post(Send(a, true, 1024, 2));
  auto ib = b.t->Post(Send(b, false, 1024, 2));
  absl::Status sa = a.t->Wait(*ia, absl::Now() + absl::Seconds(5));
  absl::Status sb = b.t->Wait(*ib, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(sa.code(), absl::StatusCode::kUnavailable) << sa;
  EXPECT_EQ(sb.code(), absl::StatusCode::kUnavailable) << sb;
  EXPECT_NE(sa.message().find("injected"), std::string::npos);
  EXPECT_EQ(b.mem, std::vector<uint8_t>(1024, 0));
  // The next batch works.
  ia = a.t->Post(Send(a, true, 1024, 3));
  ib = b.t->Post(Send(b, false, 1024, 3));
  EXPECT_TRUE(a.t->Wait(*ia, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(b.t->Wait(*ib, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(b.mem, a.mem);
}

TEST(FakeTransport, VanishedPeerFailsWaitersAtOnceNamingIt) {
  FakeFabric fabric;
  Side a, b;
  ConnectPair(fabric, a, b, 1024);
  auto ia = a.t->Post(Send(a, true, 1024, 4));  // b never posts its mirror
  ASSERT_TRUE(ia.ok());
  std::thread killer([&] { fabric.Vanish(b.t->instance_id()); });
  const absl::Time start = absl::Now();
  absl::Status s = a.t->Wait(*ia, start + absl::Seconds(30));
  killer.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(b.t->instance_id()), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // A vanished transport refuses new work.
  EXPECT_EQ(b.t->Post(Send(b, false, 1024, 5)).status().code(), absl::StatusCode::kUnavailable);
}

TEST(FakeTransport, DeadlineCancelsBothSidesAndReconnectRecovers) {
  FakeFabric fabric;
  Side a, b;
  ConnectPair(fabric, a, b, 8 << 20, /*link=*/int64_t{16} << 20);  // 8 MiB at 16 MiB/s: 0.5 s
  auto ia = a.t->Post(Send(a, true, 8 << 20, 6));
  auto ib = b.t->Post(Send(b, false, 8 << 20, 6));
  absl::Status sa = a.t->Wait(*ia, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(sa.code(), absl::StatusCode::kDeadlineExceeded) << sa;
  absl::Status sb = b.t->Wait(*ib, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(sb.code(), absl::StatusCode::kUnavailable) << "the peer's mirror fails like a closed connection: " << sb;
  // The channel is down until both re-connect.
  auto again = a.t->Post(Send(a, true, 16, 7));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(a.t->Wait(*again, absl::Now() + absl::Seconds(5)).code(), absl::StatusCode::kUnavailable);
  ConnectBoth(a, b);
  ia = a.t->Post(Send(a, true, 16, 8));
  ib = b.t->Post(Send(b, false, 16, 8));
  EXPECT_TRUE(a.t->Wait(*ia, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(b.t->Wait(*ib, absl::Now() + absl::Seconds(5)).ok());
}

TEST(FakeTransport, MirrorThatDisagreesIsInvalidArgumentOnBothSides) {
  FakeFabric fabric;
  Side a, b;
  ConnectPair(fabric, a, b, 1024);
  auto ia = a.t->Post(Send(a, true, 1024, 9));
  auto ib = b.t->Post(Send(b, false, 512, 9));
  EXPECT_EQ(a.t->Wait(*ia, absl::Now() + absl::Seconds(5)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.t->Wait(*ib, absl::Now() + absl::Seconds(5)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(FakeTransport, LinkSpeedIsHonoured) {
  FakeFabric fabric;
  Side a, b;
  ConnectPair(fabric, a, b, 4 << 20, /*link=*/int64_t{32} << 20);  // 4 MiB at 32 MiB/s: >= 125 ms
  const absl::Time start = absl::Now();
  auto ia = a.t->Post(Send(a, true, 4 << 20, 10));
  auto ib = b.t->Post(Send(b, false, 4 << 20, 10));
  ASSERT_TRUE(a.t->Wait(*ia, absl::Now() + absl::Seconds(5)).ok());
  ASSERT_TRUE(b.t->Wait(*ib, absl::Now() + absl::Seconds(5)).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(120));
}

TEST(FakeTransport, DestroyingATransportLeavesNothingOnTheFabric) {
  FakeFabric fabric;
  {
    Side a, b;
    ConnectPair(fabric, a, b, 64);
    EXPECT_EQ(fabric.live_transports(), 2);
  }
  EXPECT_EQ(fabric.live_transports(), 0);
}

// Connection rounds (transport.h): a Connect of round A that its caller abandoned does not pair
// with the peer's Connect of round B; it ends at its deadline, and round B connects both sides.
TEST(FakeTransportTest, AnAbandonedConnectDoesNotPairWithAnotherRound) {
  FakeFabric fabric;
  FakeOptions o;
  o.fabric = &fabric;
  std::unique_ptr<Transport> a = MakeFakeTransport(o), b = MakeFakeTransport(o);
  const std::string ea = *a->ExportEndpoint(b->instance_id());
  const std::string eb = *b->ExportEndpoint(a->instance_id());
  const absl::Time abandoned_deadline = absl::Now() + absl::Seconds(1);
  absl::StatusOr<PeerId> abandoned;
  std::thread stale([&] { abandoned = a->Connect(eb, "v35", abandoned_deadline); });
  absl::StatusOr<PeerId> pb;
  std::thread th([&] { pb = b->Connect(ea, "v36", absl::Now() + absl::Seconds(5)); });
  auto pa = a->Connect(eb, "v36", absl::Now() + absl::Seconds(5));
  th.join();
  stale.join();
  EXPECT_TRUE(pa.ok()) << pa.status();
  EXPECT_TRUE(pb.ok()) << pb.status();
  EXPECT_EQ(abandoned.status().code(), absl::StatusCode::kDeadlineExceeded) << abandoned.status();
  EXPECT_GE(absl::Now(), abandoned_deadline);
  auto too_long = a->Connect(eb, std::string(kMaxConnectRoundBytes + 1, 'r'), absl::Now() + absl::Seconds(1));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument) << too_long.status();
}

}  // namespace
}  // namespace wb::transport::testing
