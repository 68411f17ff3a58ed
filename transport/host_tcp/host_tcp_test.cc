// host_tcp unit tests that need two transports in one process (the conformance suite covers the
// rest against a peer process).
#include "transport/host_tcp/connected_pair.h"
#include "transport/host_tcp/host_tcp.h"

#include <arpa/inet.h>
#include <sched.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "transport/host_tcp/channel_auth.h"
#include "transport/common.h"
#include "transport/cpu_affinity.h"
#include "base/wire.h"

namespace wb::transport {
namespace {

using Pair = ConnectedPair;

absl::StatusOr<Pair> Connected(const TransportConfig& ca, const TransportConfig& cb) {
  return ConnectHostTcpPair(ca, cb);
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

// ---------------------------------------------------------------- data-channel authentication

TransportConfig WithToken(const std::string& token) {
  TransportConfig c;
  c.tcp.streams = 2;
  c.tcp.auth_token = token;
  return c;
}

// After the primary (address, port) every endpoint carries "WBPS" and the per-peer secret
// (docs/transport.md, "What the data-plane handshake proves").
constexpr uint32_t kSecretMagic = 0x53504257;

struct Endpoint {
  std::string inst, node, addr;
  uint32_t port = 0;
  std::string secret;  // what the exporter requires of the peer the endpoint is for
};

Endpoint ParseEndpoint(const std::string& bytes) {
  wire::Reader r(bytes);
  Endpoint e;
  r.U32();
  r.U8();
  r.Str();
  e.inst = r.Str();
  e.node = r.Str();
  e.addr = r.Str();
  e.port = r.U32();
  EXPECT_EQ(r.U32(), kSecretMagic);
  e.secret = r.Str();
  EXPECT_EQ(e.secret.size(), kPeerSecretBytes);
  EXPECT_TRUE(r.done());
  return e;
}

// An endpoint of instance `inst` at 127.0.0.1:port with `secret` (the raw peers below; a relay).
std::string EndpointBytes(const std::string& inst, const std::string& node, uint32_t port, const std::string& secret) {
  wire::Writer w = RecordWriter(RecordType::kEndpoint, "host_tcp", inst, node);
  w.Str("127.0.0.1");
  w.U32(port);
  w.U32(kSecretMagic);
  w.Str(secret);
  return std::move(w.out());
}

// The same endpoint with another port (a relay in front of the transport).
std::string EndpointWithPort(const Endpoint& e, uint32_t port) { return EndpointBytes(e.inst, e.node, port, e.secret); }

// A blocking TCP connection to 127.0.0.1:port whose reads give up after 10 s.
int RawConnect(uint32_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    ADD_FAILURE() << "connect to 127.0.0.1:" << port << ": " << std::strerror(errno);
    if (fd >= 0) close(fd);
    return -1;
  }
  struct timeval tv = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Everything the other side sends until it closes; `closed` is false when the read timed out.
std::string ReadUntilClosed(int fd, bool* closed) {
  std::string got;
  char buf[4096];
  while (true) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || (n < 0 && errno == ECONNRESET)) {
      *closed = true;
      return got;
    }
    if (n < 0) {
      *closed = false;
      return got;
    }
    got.append(buf, n);
  }
}

bool SendAll(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

struct ConnectResult {
  Transport* dialer = nullptr;  // the side with the smaller instance id dials
  Transport* acceptor = nullptr;
  absl::StatusOr<PeerId> dialed = absl::UnknownError("not run");
  absl::StatusOr<PeerId> accepted = absl::UnknownError("not run");
  absl::Duration dial_took;
};

// Connects both ways at once; `acceptor_endpoint` (default: the acceptor's own) is what the dialer dials.
ConnectResult ConnectBoth(Transport& a, Transport& b, absl::Time deadline, std::string acceptor_endpoint = "") {
  ConnectResult r;
  const bool a_dials = a.instance_id() < b.instance_id();
  r.dialer = a_dials ? &a : &b;
  r.acceptor = a_dials ? &b : &a;
  auto dialer_ep = r.dialer->ExportEndpoint(r.acceptor->instance_id());
  auto acceptor_ep = r.acceptor->ExportEndpoint(r.dialer->instance_id());
  EXPECT_TRUE(dialer_ep.ok() && acceptor_ep.ok());
  if (acceptor_endpoint.empty()) acceptor_endpoint = *acceptor_ep;
  std::thread th([&] { r.accepted = r.acceptor->Connect(*dialer_ep, deadline); });
  const absl::Time start = absl::Now();
  r.dialed = r.dialer->Connect(acceptor_endpoint, deadline);
  r.dial_took = absl::Now() - start;
  th.join();
  return r;
}

// Sends `n` patterned bytes from -> to over an established pair and checks them byte for byte.
// `took`: if set, the time from posting the two batches until both completed (buffers excluded).
void ExpectMovesBytes(Transport& from, PeerId from_peer, Transport& to, PeerId to_peer, int64_t n,
                      absl::Duration* took = nullptr) {
  std::vector<char> src(n), dst(n, 0);
  for (int64_t i = 0; i < n; ++i) src[i] = static_cast<char>((i * 131) ^ (i >> 9));
  auto sh = from.RegisterMemory({MemoryKind::kHost, src.data(), n, -1, "", 0, "src"});
  auto dh = to.RegisterMemory({MemoryKind::kHost, dst.data(), n, -1, "", 0, "dst"});
  ASSERT_TRUE(sh.ok() && dh.ok());
  auto d_in_from = Import(to, *dh, from);
  auto s_in_to = Import(from, *sh, to);
  ASSERT_TRUE(d_in_from.ok() && s_in_to.ok());
  Batch bs;
  bs.tag = 77;
  bs.peer = from_peer;
  bs.checksum = true;
  bs.ops = {Contig(*sh, 0, *d_in_from, 0, n)};
  Batch br = bs;
  br.peer = to_peer;
  br.ops = {Contig(*s_in_to, 0, *dh, 0, n)};
  const absl::Time start = absl::Now();
  auto ps = from.Post(bs);
  auto pr = to.Post(br);
  ASSERT_TRUE(ps.ok() && pr.ok()) << ps.status() << " " << pr.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  EXPECT_TRUE(from.Wait(*ps, deadline).ok());
  EXPECT_TRUE(to.Wait(*pr, deadline).ok());
  if (took != nullptr) *took = absl::Now() - start;
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0);
}

TEST(HostTcpAuthTest, SameTokenMovesBytesExactly) {
  auto a = NewHostTcpTransport(WithToken("cluster-token"));
  auto b = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(a.ok() && b.ok());
  ConnectResult r = ConnectBoth(**a, **b, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
  ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
  ExpectMovesBytes(*r.dialer, *r.dialed, *r.acceptor, *r.accepted, (int64_t{3} << 20) + 17);
  ExpectMovesBytes(*r.acceptor, *r.accepted, *r.dialer, *r.dialed, 4099);
}

// Different tokens, and a token on one side only: the dialer is refused with UNAUTHENTICATED
// right away, the acceptor's Connect misses its deadline naming the refusals, no byte moves.
TEST(HostTcpAuthTest, MismatchedTokensAreRefused) {
  const std::pair<std::string, std::string> cases[] = {{"cluster-token", "other-token"}, {"cluster-token", ""},
                                                       {"", "cluster-token"}};
  for (const auto& [ta, tb] : cases) {
    SCOPED_TRACE("tokens '" + ta + "' / '" + tb + "'");
    auto a = NewHostTcpTransport(WithToken(ta));
    auto b = NewHostTcpTransport(WithToken(tb));
    ASSERT_TRUE(a.ok() && b.ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(1);
    ConnectResult r = ConnectBoth(**a, **b, deadline);
    ASSERT_FALSE(r.dialed.ok());
    EXPECT_EQ(r.dialed.status().code(), absl::StatusCode::kUnauthenticated) << r.dialed.status();
    EXPECT_NE(r.dialed.status().message().find("refused the data-channel authentication"), std::string::npos)
        << r.dialed.status();
    EXPECT_NE(r.dialed.status().message().find(r.acceptor->instance_id()), std::string::npos) << r.dialed.status();
    EXPECT_LT(r.dial_took, absl::Milliseconds(500)) << "the dialer must not wait for the deadline";
    ASSERT_FALSE(r.accepted.ok());
    EXPECT_EQ(r.accepted.status().code(), absl::StatusCode::kDeadlineExceeded) << r.accepted.status();
    EXPECT_NE(r.accepted.status().message().find("connection(s) claiming this instance failed authentication"),
              std::string::npos)
        << r.accepted.status();
    EXPECT_EQ((*a)->stats().bytes_copied + (*b)->stats().bytes_copied, 0);
  }
}

// Forwards TCP connections to 127.0.0.1:target and records what the first client sends;
// `rewrite`, when set, may change each piece the clients send before it is forwarded (an on-path
// attacker).
class Relay {
 public:
  explicit Relay(uint32_t target, std::function<void(std::string&)> rewrite = nullptr)
      : target_(target), rewrite_(std::move(rewrite)) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    socklen_t len = sizeof(sa);
    EXPECT_EQ(bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    EXPECT_EQ(listen(listen_fd_, 16), 0);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    port_ = ntohs(sa.sin_port);
    accept_ = std::thread([this] { AcceptLoop(); });
  }
  ~Relay() {
    shutdown(listen_fd_, SHUT_RDWR);
    accept_.join();
    close(listen_fd_);
    {
      absl::MutexLock l(&mu_);
      for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : pumps_) t.join();
    for (int fd : fds_) close(fd);
  }
  uint32_t port() const { return port_; }
  std::string FirstUpstream() {
    absl::MutexLock l(&mu_);
    return first_upstream_;
  }

 private:
  void AcceptLoop() {
    for (int conn = 0;; ++conn) {
      int c = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      int s = RawConnect(target_);
      absl::MutexLock l(&mu_);
      fds_.push_back(c);
      if (s < 0) return;
      fds_.push_back(s);
      pumps_.emplace_back([this, c, s, conn] { Pump(c, s, conn == 0, true); });
      pumps_.emplace_back([this, c, s] { Pump(s, c, false, false); });
    }
  }
  void Pump(int from, int to, bool record, bool upstream) {
    char buf[1 << 16];
    while (true) {
      ssize_t n = recv(from, buf, sizeof(buf), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;  // RawConnect's timeout on an idle link
      if (n <= 0) break;
      if (record) {
        absl::MutexLock l(&mu_);
        first_upstream_.append(buf, n);
      }
      std::string piece(buf, n);
      if (upstream && rewrite_) rewrite_(piece);
      if (!SendAll(to, piece)) break;
    }
    shutdown(to, SHUT_WR);
  }

  const uint32_t target_;
  const std::function<void(std::string&)> rewrite_;
  int listen_fd_ = -1;
  uint32_t port_ = 0;
  std::thread accept_;
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_;  // written by the accept thread only, read after it is joined
  std::string first_upstream_ ABSL_GUARDED_BY(mu_);
};

// Length of the leading length-prefixed message of `bytes` (with its prefix), 0 if incomplete.
size_t FramedLength(absl::string_view bytes) {
  uint32_t n = 0;
  if (bytes.size() < 4) return 0;
  std::memcpy(&n, bytes.data(), 4);
  return bytes.size() >= 4 + static_cast<size_t>(n) ? 4 + n : 0;
}

// Garbage, a hello with a forged proof, a genuine dialer's replayed hello + challenge + proof and
// a silent connection are all refused, and the transport keeps serving good peers.
TEST(HostTcpAuthTest, ForgedAndReplayedConnectionsAreRefusedAndServiceContinues) {
  auto a = NewHostTcpTransport(WithToken("cluster-token"));
  auto b = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(a.ok() && b.ok());
  Transport* dialer = (*a)->instance_id() < (*b)->instance_id() ? a->get() : b->get();
  Transport* acceptor = dialer == a->get() ? b->get() : a->get();
  auto acc_ep = acceptor->ExportEndpoint(dialer->instance_id());
  ASSERT_TRUE(acc_ep.ok());
  const Endpoint acc = ParseEndpoint(*acc_ep);

  // A silent connection first: the good peers below must not wait behind it.
  int silent = RawConnect(acc.port);
  ASSERT_GE(silent, 0);

  // The genuine pair, through a relay that records the dialer's first connection.
  std::string recorded;
  {
    Relay relay(acc.port);
    ConnectResult r = ConnectBoth(*dialer, *acceptor, absl::Now() + absl::Seconds(20),
                                  EndpointWithPort(acc, relay.port()));
    ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
    ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
    EXPECT_LT(r.dial_took, absl::Seconds(3)) << "stalled behind the silent connection";
    ExpectMovesBytes(*r.dialer, *r.dialed, *r.acceptor, *r.accepted, 1 << 20);
    recorded = relay.FirstUpstream();
    ASSERT_TRUE(r.dialer->Disconnect(*r.dialed).ok());
    ASSERT_TRUE(r.acceptor->Disconnect(*r.accepted).ok());
  }
  // Hello, challenge, proof: three length-prefixed messages.
  size_t hello_len = FramedLength(recorded);
  ASSERT_GT(hello_len, 0u);
  size_t challenge_len = FramedLength(absl::string_view(recorded).substr(hello_len));
  ASSERT_GT(challenge_len, 0u);
  size_t proof_len = FramedLength(absl::string_view(recorded).substr(hello_len + challenge_len));
  ASSERT_EQ(proof_len, 4 + kChannelAuthMacBytes);
  const std::string hello = recorded.substr(0, hello_len);
  const std::string replay = recorded.substr(0, hello_len + challenge_len + proof_len);

  // 1. Replay: the acceptor answers with a fresh proof, then refuses (verdict 0) and closes.
  {
    int fd = RawConnect(acc.port);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, replay));
    bool closed = false;
    std::string got = ReadUntilClosed(fd, &closed);
    close(fd);
    EXPECT_TRUE(closed);
    const size_t m2 = FramedLength(got);
    ASSERT_GT(m2, 0u);
    ASSERT_EQ(got.size(), m2 + 1);
    EXPECT_EQ(got.back(), 0) << "verdict";
  }
  // 2. Garbage: closed without an answer.
  {
    int fd = RawConnect(acc.port);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, "GET / HTTP/1.0\r\n\r\n"));
    bool closed = false;
    EXPECT_EQ(ReadUntilClosed(fd, &closed), "");
    EXPECT_TRUE(closed);
    close(fd);
  }
  // 3. The genuine hello with a forged challenge + proof (no token): refused.
  {
    int fd = RawConnect(acc.port);
    ASSERT_GE(fd, 0);
    wire::Writer c;
    c.U32(kChannelAuthMagic);
    c.U8(kChannelAuthVersion);
    c.Str(dialer->instance_id());
    c.Raw(std::string(kChannelAuthNonceBytes, 'x').data(), kChannelAuthNonceBytes);
    wire::Writer msg;
    msg.U32(c.out().size());
    msg.Raw(c.out().data(), c.out().size());
    msg.U32(kChannelAuthMacBytes);
    msg.Raw(std::string(kChannelAuthMacBytes, 'm').data(), kChannelAuthMacBytes);
    ASSERT_TRUE(SendAll(fd, hello + msg.out()));
    bool closed = false;
    std::string got = ReadUntilClosed(fd, &closed);
    EXPECT_TRUE(closed);
    ASSERT_FALSE(got.empty());
    EXPECT_EQ(got.back(), 0) << "verdict";
    close(fd);
  }
  // The acceptor names the refused connections that claimed the dialer's identity.
  auto dialer_ep = dialer->ExportEndpoint(acceptor->instance_id());
  ASSERT_TRUE(dialer_ep.ok());
  auto again = acceptor->Connect(*dialer_ep, absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDeadlineExceeded) << again.status();
  EXPECT_NE(again.status().message().find("2 connection(s) claiming this instance failed authentication"),
            std::string::npos)
      << again.status();

  // Service continues: the same pair reconnects directly, and a third transport connects too.
  ConnectResult r = ConnectBoth(*dialer, *acceptor, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
  ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
  ExpectMovesBytes(*r.acceptor, *r.accepted, *r.dialer, *r.dialed, 1 << 20);
  auto c = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(c.ok());
  ConnectResult rc = ConnectBoth(*acceptor, **c, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(rc.dialed.ok()) << rc.dialed.status();
  ASSERT_TRUE(rc.accepted.ok()) << rc.accepted.status();
  ExpectMovesBytes(*rc.dialer, *rc.dialed, *rc.acceptor, *rc.accepted, 1 << 16);

  // The silent connection is closed by the acceptor within its 5 s handshake bound.
  bool closed = false;
  ReadUntilClosed(silent, &closed);
  EXPECT_TRUE(closed);
  close(silent);
}

// A silent connection from `source` (127.0.0.x, host order) to 127.0.0.1:port; -1 on failure.
int SilentFrom(uint32_t source, uint32_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  src.sin_addr.s_addr = htonl(source);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) != 0 ||
      connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// Issue 15.7: ~100 silent connections on a data port blocked every new data channel (the
// dialers were told "shared token differs"). Silent connections from one address must neither
// block peers connecting from another one (during the flood) nor leave channels failing after it.
TEST(HostTcpAuthTest, SilentFloodFromOneAddressBlocksNoOtherPeer) {
  // Nine transports; the one with the largest instance id accepts from all the others.
  std::vector<std::unique_ptr<Transport>> ts;
  for (int i = 0; i < 9; ++i) {
    auto t = NewHostTcpTransport(WithToken("cluster-token"));
    ASSERT_TRUE(t.ok()) << t.status();
    ts.push_back(std::move(*t));
  }
  std::sort(ts.begin(), ts.end(), [](const auto& x, const auto& y) { return x->instance_id() < y->instance_id(); });
  Transport& acceptor = *ts.back();
  auto ep = acceptor.ExportEndpoint(ts[0]->instance_id());
  ASSERT_TRUE(ep.ok());
  const Endpoint acc = ParseEndpoint(*ep);
  std::vector<int> flood;
  for (int i = 0; i < 120; ++i) {
    const int fd = SilentFrom(0x7f000002, acc.port);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    flood.push_back(fd);
  }
  for (int i = 0; i < 8; ++i) {
    SCOPED_TRACE(absl::StrCat("peer ", i, " during the flood"));
    ConnectResult r = ConnectBoth(*ts[i], acceptor, absl::Now() + absl::Seconds(20));
    ASSERT_EQ(r.dialer, ts[i].get());
    ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
    ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
    EXPECT_LT(r.dial_took, absl::Seconds(3)) << "stalled behind the flood";
    ExpectMovesBytes(*r.dialer, *r.dialed, *r.acceptor, *r.accepted, 1 << 16);
    ASSERT_TRUE(r.dialer->Disconnect(*r.dialed).ok());
    ASSERT_TRUE(r.acceptor->Disconnect(*r.accepted).ok());
  }
  for (int fd : flood) close(fd);
  for (int i = 0; i < 8; ++i) {
    SCOPED_TRACE(absl::StrCat("peer ", i, " after the flood"));
    ConnectResult r = ConnectBoth(*ts[i], acceptor, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
    ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
    ASSERT_TRUE(r.dialer->Disconnect(*r.dialed).ok());
    ASSERT_TRUE(r.acceptor->Disconnect(*r.accepted).ok());
  }
}

// A dialer whose connections the acceptor closes before proving itself (here: its own address
// holds too many unauthenticated connections) is told so, not "shared token differs".
TEST(HostTcpAuthTest, ConnectionClosedBeforeTheProofIsNotReportedAsATokenMismatch) {
  auto a = NewHostTcpTransport(WithToken("cluster-token"));
  auto b = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(a.ok() && b.ok());
  Transport* dialer = (*a)->instance_id() < (*b)->instance_id() ? a->get() : b->get();
  Transport* acceptor = dialer == a->get() ? b->get() : a->get();
  auto ep = acceptor->ExportEndpoint(dialer->instance_id());
  ASSERT_TRUE(ep.ok());
  const Endpoint acc = ParseEndpoint(*ep);
  std::vector<int> flood;
  for (int i = 0; i < 300; ++i) {
    const int fd = SilentFrom(0x7f000001, acc.port);  // the dialer's own address
    if (fd < 0) break;
    flood.push_back(fd);
  }
  ConnectResult r = ConnectBoth(*dialer, *acceptor, absl::Now() + absl::Seconds(1));
  ASSERT_FALSE(r.dialed.ok());
  EXPECT_NE(r.dialed.status().code(), absl::StatusCode::kUnauthenticated) << r.dialed.status();
  EXPECT_EQ(r.dialed.status().message().find("token"), std::string::npos) << r.dialed.status();
  EXPECT_NE(r.dialed.status().message().find("closed the connection before proving"), std::string::npos)
      << r.dialed.status();
  for (int fd : flood) close(fd);
}

// Destroying a transport while a handshake is in progress returns promptly (no thread leak, no
// wait for the 5 s handshake bound).
TEST(HostTcpAuthTest, DestructorEndsHandshakesInProgress) {
  auto a = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(a.ok());
  auto ep = (*a)->ExportEndpoint("!peer");
  ASSERT_TRUE(ep.ok());
  int fd = RawConnect(ParseEndpoint(*ep).port);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "\x10"));  // part of a hello length: the handshake thread is now waiting
  // One pause (not a poll) so the accept thread has started the handshake: without it the test
  // still passes, but checks only the listen socket's shutdown.
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time start = absl::Now();
  a->reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  bool closed = false;
  ReadUntilClosed(fd, &closed);
  EXPECT_TRUE(closed);
  close(fd);
}

// ---------------------------------------------------------------- multi-NIC striping, CPU affinity

// 127.0.0.1 and 127.0.0.2 are both on Linux loopback without configuration: two "NICs" per side.
TransportConfig TwoNics(int streams = 4) {
  TransportConfig c;
  c.tcp.streams = streams;
  c.tcp.local_addresses = {"127.0.0.1", "127.0.0.2"};
  return c;
}

// A multi-NIC endpoint: the primary (address, port), then "WBNI", the count of further NICs, and
// each further (address, port) (docs/transport.md, "host_tcp: multi-NIC and NUMA").
constexpr uint32_t kNicsMagic = 0x494e4257;

struct MultiEndpoint {
  std::string inst, node, secret;
  std::vector<std::pair<std::string, uint32_t>> nics;
};

MultiEndpoint ParseMultiEndpoint(const std::string& bytes) {
  wire::Reader r(bytes);
  MultiEndpoint e;
  r.U32();
  r.U8();
  r.Str();
  e.inst = r.Str();
  e.node = r.Str();
  std::string addr = r.Str();
  uint32_t port = r.U32();
  e.nics.emplace_back(addr, port);
  EXPECT_EQ(r.U32(), kSecretMagic);
  e.secret = r.Str();
  if (!r.done()) {
    EXPECT_EQ(r.U32(), kNicsMagic);
    const uint32_t more = r.U32();
    for (uint32_t i = 0; i < more; ++i) {
      addr = r.Str();
      port = r.U32();
      e.nics.emplace_back(addr, port);
    }
  }
  EXPECT_TRUE(r.done());
  return e;
}

std::string EncodeMultiEndpoint(const MultiEndpoint& e) {
  wire::Writer w = RecordWriter(RecordType::kEndpoint, "host_tcp", e.inst, e.node);
  w.Str(e.nics[0].first);
  w.U32(e.nics[0].second);
  w.U32(kSecretMagic);
  w.Str(e.secret);
  w.U32(kNicsMagic);
  w.U32(static_cast<uint32_t>(e.nics.size() - 1));
  for (size_t i = 1; i < e.nics.size(); ++i) {
    w.Str(e.nics[i].first);
    w.U32(e.nics[i].second);
  }
  return std::move(w.out());
}

TEST(HostTcpMultiNicTest, SingleAddressEndpointHasNoNicSection) {
  auto t = NewHostTcpTransport(TransportConfig{});
  ASSERT_TRUE(t.ok()) << t.status();
  auto ep = (*t)->ExportEndpoint("!peer");
  ASSERT_TRUE(ep.ok());
  Endpoint e = ParseEndpoint(*ep);  // header, address, port, secret: must consume it exactly
  EXPECT_EQ(e.addr, "127.0.0.1");
  EXPECT_GT(e.port, 0u);
}

TEST(HostTcpMultiNicTest, StreamsUseEveryLocalAndRemoteNic) {
  TransportConfig cb = TwoNics();
  cb.tcp.local_addresses = {"lo", "127.0.0.2"};  // an interface name resolves too ("lo" = 127.0.0.1)
  auto a = NewHostTcpTransport(TwoNics());
  auto b = NewHostTcpTransport(cb);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  for (Transport* t : {a->get(), b->get()}) {
    auto ep = t->ExportEndpoint("!peer");
    ASSERT_TRUE(ep.ok());
    MultiEndpoint m = ParseMultiEndpoint(*ep);
    ASSERT_EQ(m.nics.size(), 2u);
    EXPECT_EQ(m.nics[0].first, "127.0.0.1");
    EXPECT_EQ(m.nics[1].first, "127.0.0.2");
  }
  ConnectResult r = ConnectBoth(**a, **b, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
  ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
  ExpectMovesBytes(*r.dialer, *r.dialed, *r.acceptor, *r.accepted, int64_t{8} << 20);
  ExpectMovesBytes(*r.acceptor, *r.accepted, *r.dialer, *r.dialed, int64_t{8} << 20);

  for (auto [t, peer] : {std::pair{r.dialer, *r.dialed}, std::pair{r.acceptor, *r.accepted}}) {
    auto streams = HostTcpStreams(*t, peer);
    ASSERT_TRUE(streams.ok()) << streams.status();
    ASSERT_EQ(streams->size(), 5u);  // control + 4 data streams
    std::set<std::string> local, remote;
    for (size_t i = 1; i < streams->size(); ++i) {
      const HostTcpStreamAddresses& s = (*streams)[i];
      local.insert(s.local_address);
      remote.insert(s.peer_address);
      // Rail-aligned: data stream j = i - 1 runs NIC j mod 2 to NIC j mod 2.
      const std::string nic = (i - 1) % 2 == 0 ? "127.0.0.1" : "127.0.0.2";
      EXPECT_EQ(s.local_address, nic) << "stream " << i;
      EXPECT_EQ(s.peer_address, nic) << "stream " << i;
    }
    EXPECT_EQ(local, (std::set<std::string>{"127.0.0.1", "127.0.0.2"}));
    EXPECT_EQ(remote, (std::set<std::string>{"127.0.0.1", "127.0.0.2"}));
  }
  // The single-address default, for contrast: every stream on 127.0.0.1.
  auto c = NewHostTcpTransport(TransportConfig{});
  auto d = NewHostTcpTransport(TransportConfig{});
  ASSERT_TRUE(c.ok() && d.ok());
  ConnectResult r1 = ConnectBoth(**c, **d, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(r1.dialed.ok() && r1.accepted.ok()) << r1.dialed.status() << " " << r1.accepted.status();
  auto single = HostTcpStreams(*r1.dialer, *r1.dialed);
  ASSERT_TRUE(single.ok());
  for (const HostTcpStreamAddresses& s : *single) EXPECT_EQ(s.local_address, "127.0.0.1");
  EXPECT_EQ(HostTcpStreams(*r1.dialer, PeerId{999999}).status().code(), absl::StatusCode::kNotFound);
}

TEST(HostTcpMultiNicTest, UnbindableOrUnknownLocalNicFailsAtCreationNamingIt) {
  TransportConfig c = TwoNics();
  c.tcp.local_addresses = {"127.0.0.1", "192.0.2.1"};  // TEST-NET-1: on no interface of this machine
  auto t = NewHostTcpTransport(c);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable) << t.status();
  EXPECT_NE(t.status().message().find("data NIC 192.0.2.1 cannot be used"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("no interface of this host has that address"), std::string::npos) << t.status();

  c.tcp.local_addresses = {"127.0.0.1", "no-such-nic0"};
  t = NewHostTcpTransport(c);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound) << t.status();
  EXPECT_NE(t.status().message().find("no-such-nic0"), std::string::npos) << t.status();

  c.tcp.local_addresses = {"127.0.0.1", "127.0.0.2"};
  c.tcp.streams = 1;  // a NIC without a stream
  EXPECT_EQ(NewHostTcpTransport(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.tcp.streams = 2;
  c.tcp.advertise_address = "10.0.0.5";  // single-address option with a NIC list
  EXPECT_EQ(NewHostTcpTransport(c).status().code(), absl::StatusCode::kInvalidArgument);
}

// The dialer dials every remote NIC; one that refuses (nobody listens) or cannot be reached fails
// Connect by its deadline with an error naming the stream's addresses (no fallback).
TEST(HostTcpMultiNicTest, UnreachableRemoteNicFailsConnectNamingIt) {
  auto a = NewHostTcpTransport(TwoNics());
  auto b = NewHostTcpTransport(TwoNics());
  ASSERT_TRUE(a.ok() && b.ok());
  const bool a_dials = (*a)->instance_id() < (*b)->instance_id();
  Transport& dialer = a_dials ? **a : **b;
  Transport& acceptor = a_dials ? **b : **a;
  auto ep = acceptor.ExportEndpoint(dialer.instance_id());
  ASSERT_TRUE(ep.ok());

  // A port on 127.0.0.2 that is bound but not listening: connect is refused.
  int closed_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.2", &sa.sin_addr);
  ASSERT_EQ(bind(closed_fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(getsockname(closed_fd, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const uint32_t closed_port = ntohs(sa.sin_port);

  MultiEndpoint m = ParseMultiEndpoint(*ep);
  ASSERT_EQ(m.nics.size(), 2u);
  m.nics[1].second = closed_port;
  absl::Time start = absl::Now();
  auto refused = dialer.Connect(EncodeMultiEndpoint(m), start + absl::Seconds(10));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  const std::string where = absl::StrCat("127.0.0.2:", closed_port);
  EXPECT_NE(refused.status().message().find(where), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("stream 2 from local NIC 127.0.0.2"), std::string::npos) << refused.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  close(closed_fd);

  // A NIC address no route leads to (TEST-NET-1): refused at once by the kernel or timed out by
  // the deadline, and either way named.
  m.nics[1] = {"192.0.2.1", 9};
  start = absl::Now();
  auto unreachable = dialer.Connect(EncodeMultiEndpoint(m), start + absl::Milliseconds(1500));
  ASSERT_FALSE(unreachable.ok());
  EXPECT_NE(unreachable.status().message().find("192.0.2.1:9"), std::string::npos) << unreachable.status();
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500) + absl::Seconds(1));
}

// Capabilities::local_addresses without their ports ("127.0.0.1:41003" -> "127.0.0.1"), each port
// checked to be a real one (the listener's, for status displays).
std::vector<std::string> ListenHosts(const Transport& t) {
  std::vector<std::string> hosts;
  for (const std::string& e : t.capabilities().local_addresses) {
    const size_t colon = e.rfind(':');
    int port = 0;
    EXPECT_TRUE(colon != std::string::npos && absl::SimpleAtoi(e.substr(colon + 1), &port) && port > 0 && port < 65536) << e;
    hosts.push_back(colon == std::string::npos ? e : e.substr(0, colon));
  }
  return hosts;
}

// TransportStats::paths counts payload per (peer, local address, remote address) as it goes out and
// comes in: with two NICs per side (a: 127.0.0.1/.2, b: 127.0.0.3/.4, all on loopback) there is
// one entry per rail-aligned NIC pair, the sums match what moved exactly, and nothing else appears.
TEST(HostTcpMultiNicTest, PathStatsCountBytesPerNicPair) {
  TransportConfig ca = TwoNics();
  TransportConfig cb = TwoNics();
  cb.tcp.local_addresses = {"127.0.0.3", "127.0.0.4"};
  auto a = NewHostTcpTransport(ca);
  auto b = NewHostTcpTransport(cb);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(ListenHosts(**a), (std::vector<std::string>{"127.0.0.1", "127.0.0.2"}));
  EXPECT_EQ(ListenHosts(**b), (std::vector<std::string>{"127.0.0.3", "127.0.0.4"}));
  EXPECT_TRUE((*a)->stats().paths.empty());
  ConnectResult r = ConnectBoth(**a, **b, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
  ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
  const bool a_dials = r.dialer == a->get();
  const PeerId a_peer = a_dials ? *r.dialed : *r.accepted;
  const PeerId b_peer = a_dials ? *r.accepted : *r.dialed;
  const int64_t to_b = int64_t{32} << 20, to_a = (int64_t{32} << 20) + 5;
  ExpectMovesBytes(**a, a_peer, **b, b_peer, to_b);
  ExpectMovesBytes(**b, b_peer, **a, a_peer, to_a);

  const std::map<std::string, std::string> rail = {{"127.0.0.1", "127.0.0.3"}, {"127.0.0.2", "127.0.0.4"},
                                                   {"127.0.0.3", "127.0.0.1"}, {"127.0.0.4", "127.0.0.2"}};
  struct Side {
    Transport* t;
    Transport* peer;
    int64_t sent, received;
  };
  for (const Side& side : {Side{a->get(), b->get(), to_b, to_a}, Side{b->get(), a->get(), to_a, to_b}}) {
    SCOPED_TRACE(side.t->capabilities().local_addresses[0]);
    const std::vector<PathStats> paths = side.t->stats().paths;
    ASSERT_EQ(paths.size(), 2u);  // one per rail; the control connection carries no payload
    int64_t sent = 0, received = 0;
    std::set<std::string> locals;
    for (const PathStats& p : paths) {
      EXPECT_EQ(p.peer_instance, side.peer->instance_id());
      EXPECT_EQ(rail.at(p.local_address), p.remote_address) << "rail-aligned";
      // Chunks go to whichever stream asks first, so one batch need not use every NIC; 64 chunks
      // of 1 MiB each way (writes that block on the socket while the reader drains it) do.
      EXPECT_GT(p.bytes_sent + p.bytes_received, 0) << p.local_address;
      locals.insert(p.local_address);
      sent += p.bytes_sent;
      received += p.bytes_received;
    }
    EXPECT_EQ(locals.size(), 2u);
    EXPECT_EQ(sent, side.sent);
    EXPECT_EQ(received, side.received);
  }

  // Kept after a disconnect: the counts are cumulative.
  ASSERT_TRUE((*a)->Disconnect(a_peer).ok());
  int64_t sent = 0;
  for (const PathStats& p : (*a)->stats().paths) sent += p.bytes_sent;
  EXPECT_EQ(sent, to_b);

  // Single-address mode: one path, the kernel's choice of source (127.0.0.1 on loopback).
  auto c = NewHostTcpTransport(TransportConfig{});
  auto d = NewHostTcpTransport(TransportConfig{});
  ASSERT_TRUE(c.ok() && d.ok());
  EXPECT_EQ(ListenHosts(**c), (std::vector<std::string>{"127.0.0.1"}));
  ConnectResult r1 = ConnectBoth(**c, **d, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(r1.dialed.ok() && r1.accepted.ok()) << r1.dialed.status() << " " << r1.accepted.status();
  ExpectMovesBytes(*r1.dialer, *r1.dialed, *r1.acceptor, *r1.accepted, 1 << 20);
  const std::vector<PathStats> single = r1.dialer->stats().paths;
  ASSERT_EQ(single.size(), 1u);
  EXPECT_EQ(single[0].local_address, "127.0.0.1");
  EXPECT_EQ(single[0].remote_address, "127.0.0.1");
  EXPECT_EQ(single[0].bytes_sent, 1 << 20);
  EXPECT_EQ(single[0].bytes_received, 0);
}

// The CPUs a thread of this process may run on (sched_getaffinity by thread id).
std::vector<int> ThreadAffinity(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(tid, sizeof(set), &set), 0) << "tid " << tid;
  std::vector<int> out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

// Thread id -> name, for this process's threads whose name starts with `prefix`.
std::map<pid_t, std::string> ThreadsNamed(const std::string& prefix) {
  std::map<pid_t, std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(entry.path() / "comm");
    std::string name;
    std::getline(f, name);
    if (name.rfind(prefix, 0) == 0) out[std::stoi(entry.path().filename().string())] = name;
  }
  return out;
}

TEST(HostTcpAffinityTest, StreamThreadsArePinnedToTheConfiguredCpus) {
  auto allowed = AllowedCpus();
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  const std::vector<int> cpu0 = {allowed->front()};  // CPU 0 on an unrestricted machine
  for (bool pin : {false, true}) {
    SCOPED_TRACE(pin ? "pinned" : "floating");
    TransportConfig c = TwoNics(2);
    if (pin) c.cpus = cpu0;
    auto a = NewHostTcpTransport(c);
    auto b = NewHostTcpTransport(c);
    ASSERT_TRUE(a.ok() && b.ok());
    ConnectResult r = ConnectBoth(**a, **b, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(r.dialed.ok() && r.accepted.ok()) << r.dialed.status() << " " << r.accepted.status();
    ExpectMovesBytes(*r.dialer, *r.dialed, *r.acceptor, *r.accepted, int64_t{1} << 20);
    std::map<pid_t, std::string> threads = ThreadsNamed("wb-tcp-");
    int stream_threads = 0;
    for (const auto& [tid, name] : threads) {
      if (name != "wb-tcp-ctl" && name != "wb-tcp-data") continue;
      ++stream_threads;
      EXPECT_EQ(ThreadAffinity(tid), pin ? cpu0 : *allowed) << name << " " << tid;
    }
    EXPECT_EQ(stream_threads, 2 * 2 * 3);  // 2 transports x (reader + writer) x (control + 2 data)
  }
  TransportConfig bad;
  bad.cpus = {CPU_SETSIZE - 1};
  auto t = NewHostTcpTransport(bad);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
}

// --max_send_gbps: a capped sender needs at least bytes / cap; the other direction, uncapped, is
// not held back; the bytes arrive exact; a negative or non-finite cap is refused at creation.
TEST(HostTcpPacingTest, CappedSenderTakesAtLeastBytesOverCapAndMovesBytesExactly) {
  constexpr double kCap = 40e6;             // 40 MB/s
  constexpr int64_t kBytes = int64_t{12} << 20;  // 12.6 MB: >= 0.31 s at the cap
  TransportConfig capped;
  capped.tcp.max_send_bytes_per_s = kCap;
  auto pair = Connected(capped, TransportConfig{});
  ASSERT_TRUE(pair.ok()) << pair.status();
  absl::Duration capped_took, uncapped_took;
  ExpectMovesBytes(*pair->a, pair->a_to_b, *pair->b, pair->b_to_a, kBytes, &capped_took);
  EXPECT_GE(capped_took, absl::Seconds((kBytes - (int64_t{1} << 20)) / kCap)) << "the cap let bytes out faster than 40 MB/s";
  // The uncapped side sends the same bytes back faster than the cap would let them (loopback
  // moves hundreds of MB/s even on a loaded host or under a sanitizer; a cap wrongly applied to
  // this side too would take >= 0.29 s, as above).
  ExpectMovesBytes(*pair->b, pair->b_to_a, *pair->a, pair->a_to_b, kBytes, &uncapped_took);
  EXPECT_LT(uncapped_took, capped_took);
  for (double bad : {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    TransportConfig c;
    c.tcp.max_send_bytes_per_s = bad;
    auto t = NewHostTcpTransport(c);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("max_send_bytes_per_s"), std::string::npos) << t.status();
  }
}

// A low cap never holds a shutdown: destroying a transport whose writers sleep on their bookings
// (0.25 MB/s, 16 MiB queued: the fourth stream's chunk would start at 12.6 s) returns at once.
TEST(HostTcpPacingTest, DestroyingAPacedSenderDoesNotWaitForItsBookings) {
  TransportConfig capped;
  capped.tcp.max_send_bytes_per_s = 0.25e6;
  auto pair = Connected(capped, TransportConfig{});
  ASSERT_TRUE(pair.ok()) << pair.status();
  const int64_t n = int64_t{16} << 20;
  std::vector<char> src(n, 7), dst(n, 0);
  auto sh = pair->a->RegisterMemory({MemoryKind::kHost, src.data(), n, -1, "", 0, "src"});
  auto dh = pair->b->RegisterMemory({MemoryKind::kHost, dst.data(), n, -1, "", 0, "dst"});
  ASSERT_TRUE(sh.ok() && dh.ok());
  auto d_in_a = Import(*pair->b, *dh, *pair->a);
  auto s_in_b = Import(*pair->a, *sh, *pair->b);
  ASSERT_TRUE(d_in_a.ok() && s_in_b.ok());
  Batch bs;
  bs.tag = 91;
  bs.peer = pair->a_to_b;
  bs.ops = {Contig(*sh, 0, *d_in_a, 0, n)};
  Batch br = bs;
  br.peer = pair->b_to_a;
  br.ops = {Contig(*s_in_b, 0, *dh, 0, n)};
  auto ps = pair->a->Post(bs);
  auto pr = pair->b->Post(br);
  ASSERT_TRUE(ps.ok() && pr.ok()) << ps.status() << " " << pr.status();
  // The first chunk goes at once; the receiver's batch cannot finish before the sender is gone.
  EXPECT_FALSE(pair->b->Wait(*pr, absl::Now() + absl::Milliseconds(300)).ok());
  const absl::Time start = absl::Now();
  pair->a.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "the destructor waited for paced writers' bookings";
  EXPECT_FALSE(pair->b->Wait(*pr, absl::Now() + absl::Seconds(20)).ok());
}


// ---------------------------------------------------------------- what an authenticated peer can hold

// The wire's frame header (host_tcp.cc FrameHeader), for a raw peer that speaks the protocol.
struct RawFrame {
  uint32_t magic = 0x46425757;  // "WWBF"
  uint8_t type = 0;             // 1 MANIFEST, 2 DATA, 3 CHECKSUM, 4 ACK
  uint8_t pad[3] = {};
  uint64_t tag = 0;
  uint32_t op = 0;
  uint32_t pad2 = 0;
  int64_t offset = 0;
  int64_t len = 0;
};
static_assert(sizeof(RawFrame) == 40);

std::string FrameBytes(uint8_t type, uint64_t tag, uint32_t op, int64_t offset, int64_t len) {
  RawFrame f;
  f.type = type;
  f.tag = tag;
  f.op = op;
  f.offset = offset;
  f.len = len;
  return std::string(reinterpret_cast<const char*>(&f), sizeof(f));
}

// A connection to 127.0.0.1:port that says hello {inst, idx, total, round} and passes the channel
// authentication with `token` and `secret` as `inst` would: what a holder of the token and of the
// endpoint exported for `inst` can do. Returns the fd, or the dialer-side handshake's status.
// `old_hello`: the hello of the empty round, which is that of a binary from before connection
// rounds ("WWBF", no round); unset: that one exactly when `round` is empty, as host_tcp dials.
absl::StatusOr<int> RawDial(uint32_t port, const std::string& acceptor_inst, const std::string& token,
                            const std::string& secret, const std::string& inst, uint32_t idx, uint32_t total,
                            const std::string& round = "", std::optional<bool> old_hello_or = std::nullopt) {
  const int fd = RawConnect(port);
  if (fd < 0) return absl::UnavailableError("connect failed");
  const bool old_hello = old_hello_or.value_or(round.empty());
  wire::Writer hello;
  hello.U32(old_hello ? 0x46425757 : 0x52425757);  // "WWBF" before rounds, "WWBR" since
  hello.Str(inst);
  hello.U32(idx);
  hello.U32(total);
  if (!old_hello) hello.Str(round);
  wire::Writer framed;
  framed.U32(static_cast<uint32_t>(hello.out().size()));
  framed.Raw(hello.out().data(), hello.out().size());
  if (!SendAll(fd, framed.out())) {
    close(fd);
    return absl::UnavailableError("hello not sent");
  }
  ChannelAuthParams auth;
  auth.key = token;
  auth.peer_secret = secret;
  auth.self = inst;
  auth.peer = acceptor_inst;
  auth.context = hello.out();
  auth.deadline = absl::Now() + absl::Seconds(10);
  if (absl::Status s = AuthenticateDialer(fd, auth); !s.ok()) {
    close(fd);
    return s;
  }
  return fd;
}

// Polls `probe` until it holds or `within` passes; the last value is what the caller asserts on.
template <typename F>
bool Eventually(F probe, absl::Duration within = absl::Seconds(20)) {
  const absl::Time deadline = absl::Now() + within;
  while (!probe()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));  // a probe interval, not a wait for an event
  }
  return true;
}

HostTcpCounters CountersOf(const Transport& t) {
  absl::StatusOr<HostTcpCounters> c = HostTcpCountersOf(t);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : HostTcpCounters{};
}

// A raw, authenticated peer `inst` connected to `acceptor` (control + one data connection), and
// the acceptor's id for it. `inst` must sort before the acceptor's instance id (the smaller dials).
struct RawPeer {
  std::string inst;
  int control = -1, data = -1;
  PeerId id;
  ~RawPeer() {
    if (control >= 0) close(control);
    if (data >= 0) close(data);
  }
};

void ConnectRawPeer(Transport& acceptor, const std::string& token, RawPeer& peer) {
  auto ep = acceptor.ExportEndpoint(peer.inst);
  ASSERT_TRUE(ep.ok());
  const Endpoint acc = ParseEndpoint(*ep);
  ASSERT_LT(peer.inst, acc.inst);
  // Port 1: never dialled, the acceptor waits for the raw peer's connections.
  const std::string raw_ep = EndpointBytes(peer.inst, "raw-node", 1, std::string(kPeerSecretBytes, '\0'));
  absl::StatusOr<PeerId> accepted = absl::UnknownError("not run");
  std::thread th([&] { accepted = acceptor.Connect(raw_ep, absl::Now() + absl::Seconds(20)); });
  absl::StatusOr<int> c = RawDial(acc.port, acc.inst, token, acc.secret, peer.inst, 0, 2);
  absl::StatusOr<int> d = c.ok() ? RawDial(acc.port, acc.inst, token, acc.secret, peer.inst, 1, 2) : c;
  th.join();
  ASSERT_TRUE(c.ok()) << c.status();
  peer.control = *c;
  ASSERT_TRUE(d.ok()) << d.status();
  peer.data = *d;
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  peer.id = *accepted;
}

// Review M2a: MANIFEST / CHECKSUM / ACK frames for tags this side has not posted were held
// without bound. A peer streaming them fills up to max_early_control_frames, then the channel is
// closed (RESOURCE_EXHAUSTED naming the peer) and what it held is dropped; at the default too.
TEST(HostTcpLimitsTest, EarlyControlFramesForUnpostedBatchesAreBounded) {
  for (const int64_t limit : {int64_t{64}, HostTcpLimits{}.max_early_control_frames}) {
    SCOPED_TRACE(absl::StrCat("limit ", limit));
    HostTcpLimits limits;
    limits.max_early_control_frames = limit;
    auto t = NewHostTcpTransport(WithToken("cluster-token"), limits);
    ASSERT_TRUE(t.ok()) << t.status();
    Transport& acceptor = **t;
    RawPeer peer;
    peer.inst = "!flooder";
    ConnectRawPeer(acceptor, "cluster-token", peer);
    if (HasFatalFailure()) return;
    // Exactly `limit` frames of made-up tags, all three kinds: held.
    std::string frames;
    for (int64_t i = 0; i < limit; ++i) {
      const uint8_t type = i % 3 == 0 ? 1 : i % 3 == 1 ? 3 : 4;
      frames += FrameBytes(type, 1000000 + static_cast<uint64_t>(i), 0, static_cast<int64_t>(i), 0);
    }
    ASSERT_TRUE(SendAll(peer.control, frames));
    EXPECT_TRUE(Eventually([&] { return CountersOf(acceptor).early_control_frames == limit; }))
        << CountersOf(acceptor).early_control_frames;
    EXPECT_EQ(CountersOf(acceptor).early_overflows, 0);
    // One more: the channel is closed, nothing is held any more.
    ASSERT_TRUE(SendAll(peer.control, FrameBytes(1, 99, 0, 0, 0)));
    EXPECT_TRUE(Eventually([&] { return CountersOf(acceptor).early_overflows == 1; }));
    EXPECT_EQ(CountersOf(acceptor).early_control_frames, 0);
    bool closed = false;
    ReadUntilClosed(peer.control, &closed);
    EXPECT_TRUE(closed) << "the control connection stays open";
    Batch b;
    b.tag = 5;
    b.peer = peer.id;
    auto posted = acceptor.Post(b);
    ASSERT_FALSE(posted.ok());
    EXPECT_EQ(posted.status().code(), absl::StatusCode::kUnavailable) << posted.status();
    EXPECT_NE(posted.status().message().find(absl::StrCat("host_tcp peer !flooder sent more than ", limit,
                                                          " control frames for batches this side has not posted")),
              std::string::npos)
        << posted.status();
  }
}

// A receive-only batch of `n` bytes from the raw peer into a zeroed local buffer.
struct RawReceive {
  std::vector<char> dst;
  BatchId id;
};

void PostReceive(Transport& t, const RawPeer& peer, uint64_t tag, int64_t n, RawReceive& r, uint64_t group = 0) {
  r.dst.assign(n, 0);
  auto dh = t.RegisterMemory({MemoryKind::kHost, r.dst.data(), n, -1, "", 0, "dst"});
  ASSERT_TRUE(dh.ok()) << dh.status();
  auto sh = t.ImportDescriptor(EncodePlainDescriptor("host_tcp", {peer.inst, "raw-node", 7, n, "raw src"}));
  ASSERT_TRUE(sh.ok()) << sh.status();
  Batch b;
  b.tag = tag;
  b.group = group;
  b.peer = peer.id;
  b.ops = {Contig(*sh, 0, *dh, 0, n)};
  auto id = t.Post(b);
  ASSERT_TRUE(id.ok()) << id.status();
  r.id = *id;
  // The mirror: the peer echoes this side's manifest (the hash of the batch as both sides see it)
  // and ACKs (it receives nothing in this batch).
  // (ACKs of earlier batches may come first: skipped with their payload; so is the channel's first
  // frame, FEATURES, type 5.)
  RawFrame m;
  do {
    ASSERT_EQ(recv(peer.control, &m, sizeof(m), MSG_WAITALL), static_cast<ssize_t>(sizeof(m)));
    if (m.type == 4 && m.len > 0) {
      std::string payload(m.len, '\0');
      ASSERT_EQ(recv(peer.control, payload.data(), m.len, MSG_WAITALL), m.len);
    }
  } while (m.type == 4 || m.type == 5);
  ASSERT_EQ(m.type, 1);
  ASSERT_EQ(m.tag, tag);
  ASSERT_TRUE(SendAll(peer.control, FrameBytes(1, tag, 0, m.offset, 0) + FrameBytes(4, tag, 0, 0, 0)));
}

// The frame types in `bytes` (a control connection's: ACKs carry their payload).
std::vector<int> FrameTypes(const std::string& bytes) {
  std::vector<int> types;
  for (size_t at = 0; at + sizeof(RawFrame) <= bytes.size();) {
    RawFrame f;
    std::memcpy(&f, bytes.data() + at, sizeof(f));
    types.push_back(f.type);
    at += sizeof(f) + (f.type == 4 && f.len > 0 ? static_cast<size_t>(f.len) : 0);
  }
  return types;
}

// A peer built before CancelBatches (this raw peer: it never sends FEATURES) is never sent CANCEL
// or CANCEL_END, frames it does not know (it would close a data connection on one): cancelling a
// batch with it ends the batch CANCELLED at once and closes the channel, as before the cancel.
TEST(HostTcpCancelTest, APeerFromBeforeCancelsIsSentNoCancelFrameAndTheChannelCloses) {
  auto t = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(t.ok()) << t.status();
  Transport& acceptor = **t;
  EXPECT_TRUE(acceptor.capabilities().cancel_batches);
  RawPeer peer;
  peer.inst = "!old-build";
  ConnectRawPeer(acceptor, "cluster-token", peer);
  if (HasFatalFailure()) return;
  RawReceive r;
  PostReceive(acceptor, peer, 42, 1 << 16, r, /*group=*/3);  // its MANIFEST echoed, no data sent
  if (HasFatalFailure()) return;
  const absl::Time start = absl::Now();
  ASSERT_TRUE(acceptor.CancelBatches(3, "aborted").ok());
  absl::Status s = acceptor.Wait(r.id, start + absl::Seconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Bounded reads: a channel left open fails the test at 10 s instead of hanging it.
  const struct timeval limit = {10, 0};
  setsockopt(peer.control, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  setsockopt(peer.data, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  bool closed = false;
  const std::vector<int> control = FrameTypes(ReadUntilClosed(peer.control, &closed));
  EXPECT_TRUE(closed) << "the channel stays open";
  EXPECT_EQ(std::count(control.begin(), control.end(), 6), 0) << "CANCEL sent to a peer that did not say it takes it";
  const std::string data = ReadUntilClosed(peer.data, &closed);
  EXPECT_TRUE(closed);
  EXPECT_TRUE(data.empty()) << "a CANCEL_END (or anything) on a data connection of a receive-only batch";
  Batch b;
  b.tag = 43;
  b.peer = peer.id;
  EXPECT_EQ(acceptor.Post(b).status().code(), absl::StatusCode::kUnavailable) << "the channel was closed";
}

// Review L1: a DATA frame's bounds were checked as offset + len > op bytes in int64, which
// overflows for an offset near INT64_MAX (undefined behaviour; in practice the check passed and
// the frame counted as received). Now refused naming the bytes.
TEST(HostTcpLimitsTest, DataFrameAtAnOffsetNearInt64MaxIsRefused) {
  auto t = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(t.ok()) << t.status();
  RawPeer peer;
  peer.inst = "!raw";
  ConnectRawPeer(**t, "cluster-token", peer);
  if (HasFatalFailure()) return;
  RawReceive r;
  PostReceive(**t, peer, 5, 8192, r);
  if (HasFatalFailure()) return;
  const int64_t offset = std::numeric_limits<int64_t>::max() - 16;
  ASSERT_TRUE(SendAll(peer.data, FrameBytes(2, 5, 0, offset, 4096) + std::string(4096, 'x')));
  absl::Status s = (*t)->Wait(r.id, absl::Now() + absl::Seconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find(absl::StrCat("host_tcp peer !raw sent a bad frame (batch 5: bytes at offset ", offset,
                                          " length 4096 are outside op 0's 8192 bytes)")),
            std::string::npos)
      << s;
  EXPECT_EQ(std::count(r.dst.begin(), r.dst.end(), 0), 8192) << "bytes were written";
}

// Review L1: a batch completed once its received byte count reached the expected count, so a
// duplicate frame could complete it with a hole. Frames in any order still complete it; a frame
// overlapping bytes already received is refused.
TEST(HostTcpLimitsTest, DuplicateFrameCannotCompleteABatchWithAHole) {
  auto t = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(t.ok()) << t.status();
  RawPeer peer;
  peer.inst = "!raw";
  ConnectRawPeer(**t, "cluster-token", peer);
  if (HasFatalFailure()) return;
  // Out of order, every way a range can join the ones before it: alone, alone, between two
  // (merges both), before the first (extends it downwards).
  {
    RawReceive r;
    PostReceive(**t, peer, 5, 8192, r);
    if (HasFatalFailure()) return;
    std::string wire;
    for (const int64_t off : {2048, 6144, 4096, 0}) {
      wire += FrameBytes(2, 5, 0, off, 2048) + std::string(2048, static_cast<char>('a' + off / 2048));
    }
    ASSERT_TRUE(SendAll(peer.data, wire));
    absl::Status s = (*t)->Wait(r.id, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < 8192; ++i) ASSERT_EQ(r.dst[i], static_cast<char>('a' + i / 2048)) << "byte " << i;
  }
  // The first half twice: 8192 bytes arrive, the second half never did.
  RawReceive r;
  PostReceive(**t, peer, 6, 8192, r);
  if (HasFatalFailure()) return;
  const std::string half = FrameBytes(2, 6, 0, 0, 4096) + std::string(4096, 'd');
  ASSERT_TRUE(SendAll(peer.data, half + half));
  absl::Status s = (*t)->Wait(r.id, absl::Now() + absl::Seconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("host_tcp peer !raw sent a bad frame (batch 6: op 0 bytes [0, 4096) overlap bytes of it "
                             "already received (a duplicate frame))"),
            std::string::npos)
      << s;
}

// Two transports with `limits`, ordered: [0] dials [1].
std::vector<std::unique_ptr<Transport>> OrderedPair(const HostTcpLimits& limits) {
  std::vector<std::unique_ptr<Transport>> ts;
  for (int i = 0; i < 2; ++i) {
    auto t = NewHostTcpTransport(WithToken("cluster-token"), limits);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return {};
    ts.push_back(std::move(*t));
  }
  if (ts[1]->instance_id() < ts[0]->instance_id()) std::swap(ts[0], ts[1]);
  return ts;
}

// Review M2b: authenticated connections were parked until a Connect took them, without bound,
// whatever instance, stream index and count their hellos claimed. Hellos out of range are
// refused before authentication; past max_parked_connections a hello is closed before the
// handshake (the dialer hears "closed before proving"); a Connect waiting for its peer still gets
// that peer's connections, and bytes move.
TEST(HostTcpLimitsTest, ParkedConnectionsAreBoundedAndAConnectStillWorks) {
  HostTcpLimits limits;
  limits.max_parked_connections = 8;
  limits.parked_timeout = absl::Hours(1);
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(limits);
  ASSERT_EQ(ts.size(), 2u);
  Transport& acceptor = *ts[1];
  auto ep = acceptor.ExportEndpoint(ts[0]->instance_id());
  ASSERT_TRUE(ep.ok());
  const Endpoint acc = ParseEndpoint(*ep);
  // Junk that the acceptor exported endpoints for (else its hellos are refused before anything
  // is parked): a peer that holds its endpoint but never connects, or a token holder that read it.
  auto secret_for = [&](const std::string& inst) {
    auto e = acceptor.ExportEndpoint(inst);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? ParseEndpoint(*e).secret : std::string();
  };

  // Out of range: 65 data streams + control, an index past the count, an instance that does not
  // sort before the acceptor's (it could never be claimed: the smaller instance dials).
  const struct {
    std::string inst;
    uint32_t idx, total;
  } bad[] = {{"!junk", 0, 66}, {"!junk", 2, 2}, {acc.inst + "z", 0, 2}};
  for (const auto& h : bad) {
    SCOPED_TRACE(absl::StrCat(h.inst, " ", h.idx, "/", h.total));
    absl::StatusOr<int> fd = RawDial(acc.port, acc.inst, "cluster-token", secret_for("!junk"), h.inst, h.idx, h.total);
    ASSERT_FALSE(fd.ok());
    EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnavailable) << fd.status();
    EXPECT_NE(fd.status().message().find("closed the connection before proving"), std::string::npos) << fd.status();
  }
  EXPECT_EQ(CountersOf(acceptor).hellos_refused, 3);
  // The largest valid count is taken.
  absl::StatusOr<int> widest =
      RawDial(acc.port, acc.inst, "cluster-token", secret_for("!junk-wide"), "!junk-wide", 64, 65);
  ASSERT_TRUE(widest.ok()) << widest.status();

  std::vector<int> junk = {*widest};
  for (int i = 1; i < limits.max_parked_connections; ++i) {
    const std::string inst = absl::StrCat("!junk", i);
    absl::StatusOr<int> fd = RawDial(acc.port, acc.inst, "cluster-token", secret_for(inst), inst, 0, 2);
    ASSERT_TRUE(fd.ok()) << i << ": " << fd.status();
    junk.push_back(*fd);
  }
  EXPECT_TRUE(Eventually([&] { return CountersOf(acceptor).parked_connections == limits.max_parked_connections; }))
      << CountersOf(acceptor).parked_connections;
  for (int i = 0; i < 3; ++i) {
    const std::string inst = absl::StrCat("!more", i);
    absl::StatusOr<int> fd = RawDial(acc.port, acc.inst, "cluster-token", secret_for(inst), inst, 0, 2);
    ASSERT_FALSE(fd.ok()) << "connection " << i << " past the bound was parked";
    EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnavailable) << fd.status();
    EXPECT_NE(fd.status().message().find("closed the connection before proving"), std::string::npos) << fd.status();
  }
  EXPECT_EQ(CountersOf(acceptor).parked_refused, 3);
  EXPECT_EQ(CountersOf(acceptor).parked_connections, limits.max_parked_connections);

  // The genuine peer, both Connects at once: the acceptor's waiting Connect takes its connections.
  ConnectResult r = ConnectBoth(*ts[0], acceptor, absl::Now() + absl::Seconds(20));
  ASSERT_EQ(r.dialer, ts[0].get());
  ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
  ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
  ExpectMovesBytes(*r.dialer, *r.dialed, *r.acceptor, *r.accepted, 1 << 20);
  EXPECT_EQ(CountersOf(acceptor).parked_connections, limits.max_parked_connections) << "only the junk is parked";
  for (int fd : junk) close(fd);
}

// Review M2b: parked connections no Connect claims are closed after parked_timeout, which frees
// the park for a dialer that comes before its acceptor's Connect (it redials until then).
TEST(HostTcpLimitsTest, UnclaimedParkedConnectionsExpire) {
  HostTcpLimits limits;
  limits.max_parked_connections = 3;  // what the dialer needs (control + 2 data): all the junk must go
  limits.parked_timeout = absl::Milliseconds(500);
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(limits);
  ASSERT_EQ(ts.size(), 2u);
  Transport& dialer = *ts[0];
  Transport& acceptor = *ts[1];
  auto ep = acceptor.ExportEndpoint(dialer.instance_id());
  ASSERT_TRUE(ep.ok());
  const Endpoint acc = ParseEndpoint(*ep);
  std::vector<int> junk;
  for (int i = 0; i < limits.max_parked_connections; ++i) {
    const std::string inst = absl::StrCat("!junk", i);
    auto junk_ep = acceptor.ExportEndpoint(inst);
    ASSERT_TRUE(junk_ep.ok());
    absl::StatusOr<int> fd = RawDial(acc.port, acc.inst, "cluster-token", ParseEndpoint(*junk_ep).secret, inst, 0, 2);
    ASSERT_TRUE(fd.ok()) << i << ": " << fd.status();
    junk.push_back(*fd);
  }
  // The dialer alone (no Connect waits for it yet): refused while the park is full, it redials
  // until the junk expired and its own connections are parked.
  auto dialed = dialer.Connect(*ep, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  EXPECT_EQ(CountersOf(acceptor).parked_expired, limits.max_parked_connections);
  EXPECT_TRUE(Eventually([&] { return CountersOf(acceptor).parked_connections == 3; }))
      << CountersOf(acceptor).parked_connections << " parked; the dialer's control + 2 data connections expected";
  for (int fd : junk) {
    bool closed = false;
    ReadUntilClosed(fd, &closed);
    EXPECT_TRUE(closed) << "an expired connection stays open";
    close(fd);
  }
  auto dialer_ep = dialer.ExportEndpoint(acceptor.instance_id());
  ASSERT_TRUE(dialer_ep.ok());
  auto accepted = acceptor.Connect(*dialer_ep, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(CountersOf(acceptor).parked_connections, 0);
  ExpectMovesBytes(dialer, *dialed, acceptor, *accepted, 1 << 20);
}

// Chaos run (tests/soak:chaos_delta_test, rollout nodes relaying to each other, a node killed):
// one version ended on the acceptor before its Connect while the dialer's Connect went through
// (its connections parked), then the dialer's version failed and it disconnected them. The next
// version's Connect on the acceptor took those closed, parked connections at once and the dialer's
// fresh ones were parked in their place, one round late: every later version between the two
// nodes failed ("host_tcp peer X is disconnected: ... vanished (control connection closed)")
// until one of them restarted. A Connect drops parked connections their dialer closed and waits
// for live ones.
TEST(HostTcpLimitsTest, AConnectTakesNoParkedConnectionTheDialerClosed) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(HostTcpLimits{});
  ASSERT_EQ(ts.size(), 2u);
  Transport& dialer = *ts[0];
  Transport& acceptor = *ts[1];
  auto ep = acceptor.ExportEndpoint(dialer.instance_id());
  auto dialer_ep = dialer.ExportEndpoint(acceptor.instance_id());
  ASSERT_TRUE(ep.ok() && dialer_ep.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  // Round 1: only the dialer connects (the acceptor's version ended first); then it drops them.
  auto first = dialer.Connect(*ep, deadline);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(Eventually([&] { return CountersOf(acceptor).parked_connections == 3; }));
  ASSERT_TRUE(dialer.Disconnect(*first).ok());
  // Round 2: the acceptor's Connect comes first and deals with the parked connections (takes or
  // drops them) before the dialer dials again.
  absl::StatusOr<PeerId> accepted = absl::UnknownError("not run");
  std::thread th([&] { accepted = acceptor.Connect(*dialer_ep, deadline); });
  ASSERT_TRUE(Eventually([&] { return CountersOf(acceptor).parked_connections == 0; }));
  auto second = dialer.Connect(*ep, deadline);
  th.join();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ExpectMovesBytes(dialer, *second, acceptor, *accepted, 1 << 20);
  ExpectMovesBytes(acceptor, *accepted, dialer, *second, 1 << 20);
  EXPECT_EQ(CountersOf(acceptor).parked_connections, 0);
}

// ---------------------------------------------------------------- per-peer secrets

// Three transports with `limits`, ordered by instance id: [0] and [1] dial [2].
std::vector<std::unique_ptr<Transport>> OrderedThree(const HostTcpLimits& limits = {}) {
  std::vector<std::unique_ptr<Transport>> ts;
  for (int i = 0; i < 3; ++i) {
    auto t = NewHostTcpTransport(WithToken("cluster-token"), limits);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return {};
    ts.push_back(std::move(*t));
  }
  std::sort(ts.begin(), ts.end(), [](const auto& x, const auto& y) { return x->instance_id() < y->instance_id(); });
  return ts;
}

// The gap this closes (docs/transport.md, "What the data-plane handshake proves"): a token holder
// that knows X's instance id dialled first as X and had its sockets become the acceptor's channel
// to X. Without the secret the acceptor made for X it is refused, whatever it guesses (none, zeros,
// the secret of its own endpoint), nothing of it is parked, and X's own channel comes up.
TEST(HostTcpPeerSecretTest, ATokenHolderWithoutTheSecretForXCannotClaimX) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedThree();
  ASSERT_EQ(ts.size(), 3u);
  Transport& x = *ts[0];
  Transport& mallory = *ts[1];  // holds the token, and an endpoint the acceptor made for itself
  Transport& acceptor = *ts[2];
  auto for_x = acceptor.ExportEndpoint(x.instance_id());
  auto for_mallory = acceptor.ExportEndpoint(mallory.instance_id());
  ASSERT_TRUE(for_x.ok() && for_mallory.ok());
  const Endpoint acc = ParseEndpoint(*for_mallory);
  for (const std::string& guess : {std::string(), std::string(kPeerSecretBytes, '\0'), acc.secret}) {
    for (uint32_t idx = 0; idx < 3; ++idx) {  // control + 2 data streams: a whole channel
      absl::StatusOr<int> fd = RawDial(acc.port, acc.inst, "cluster-token", guess, x.instance_id(), idx, 3);
      ASSERT_FALSE(fd.ok()) << "a token holder without X's secret was let in as X (guess of " << guess.size()
                            << " bytes, stream " << idx << ")";
      EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnauthenticated) << fd.status();
      EXPECT_NE(fd.status().message().find("peer secret"), std::string::npos) << fd.status();
    }
  }
  EXPECT_EQ(CountersOf(acceptor).parked_connections, 0);
  // X's own channel, with the endpoint made for it.
  ConnectResult r = ConnectBoth(x, acceptor, absl::Now() + absl::Seconds(20));
  ASSERT_EQ(r.dialer, &x);
  ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
  ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
  ExpectMovesBytes(x, *r.dialed, acceptor, *r.accepted, 1 << 20);
  ExpectMovesBytes(acceptor, *r.accepted, x, *r.dialed, 1 << 16);
}

// A hello claiming an instance the acceptor never exported an endpoint for is closed before the
// handshake and counted (hellos_unknown_instance), not parked and not counted against the
// instance; an acceptor Connect for such a peer fails at once naming the missing export. Once
// exported for, the same instance with that endpoint's secret gets in.
TEST(HostTcpPeerSecretTest, AHelloForAnInstanceNeverExportedForIsRefusedAndCounted) {
  auto t = NewHostTcpTransport(WithToken("cluster-token"));
  ASSERT_TRUE(t.ok()) << t.status();
  Transport& acceptor = **t;
  auto for_other = acceptor.ExportEndpoint("!other");
  ASSERT_TRUE(for_other.ok());
  const Endpoint acc = ParseEndpoint(*for_other);
  for (const std::string& guess : {std::string(), acc.secret}) {
    absl::StatusOr<int> fd = RawDial(acc.port, acc.inst, "cluster-token", guess, "!stranger", 0, 2);
    ASSERT_FALSE(fd.ok()) << "a hello for an instance never exported for was authenticated";
    EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnavailable) << fd.status();
    EXPECT_NE(fd.status().message().find("closed the connection before proving"), std::string::npos) << fd.status();
  }
  HostTcpCounters c = CountersOf(acceptor);
  EXPECT_EQ(c.hellos_unknown_instance, 2);
  EXPECT_EQ(c.hellos_refused, 0);
  EXPECT_EQ(c.parked_connections, 0);
  EXPECT_EQ(c.peer_secrets, 1);
  // The same counts reach the daemon's metrics through TransportStats::guards.
  std::map<std::string, std::pair<int64_t, bool>> guards;
  for (const GuardCount& g : acceptor.stats().guards) guards[g.name] = {g.value, g.cumulative};
  EXPECT_EQ(guards["hellos_unknown_instance"], std::make_pair(int64_t{2}, true));
  EXPECT_EQ(guards["hellos_refused"], std::make_pair(int64_t{0}, true));
  EXPECT_EQ(guards["peer_secrets"], std::make_pair(int64_t{1}, false));
  EXPECT_EQ(guards["parked_connections"], std::make_pair(int64_t{0}, false));

  const absl::Time start = absl::Now();
  auto waiting = acceptor.Connect(EndpointBytes("!stranger", "raw-node", 1, std::string(kPeerSecretBytes, '\0')),
                                  absl::Now() + absl::Seconds(20));
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kFailedPrecondition) << waiting.status();
  EXPECT_NE(waiting.status().message().find("ExportEndpoint(!stranger)"), std::string::npos) << waiting.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "waited for a peer that can never prove itself";

  auto for_stranger = acceptor.ExportEndpoint("!stranger");
  ASSERT_TRUE(for_stranger.ok());
  absl::StatusOr<int> fd =
      RawDial(acc.port, acc.inst, "cluster-token", ParseEndpoint(*for_stranger).secret, "!stranger", 0, 2);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_TRUE(Eventually([&] { return CountersOf(acceptor).parked_connections == 1; }));
  EXPECT_EQ(CountersOf(acceptor).hellos_unknown_instance, 2);
  close(*fd);
}

// The secret is per peer: the acceptor makes one for each peer, the same one on every export for
// that peer, and Y's secret proves Y, never X. Z, holding the endpoint made for Y (the token and
// Y's secret), cannot claim X; X then connects.
TEST(HostTcpPeerSecretTest, TheSecretIsPerPeer) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedThree();
  ASSERT_EQ(ts.size(), 3u);
  Transport& x = *ts[0];
  Transport& acceptor = *ts[2];
  auto for_x = acceptor.ExportEndpoint(x.instance_id());
  auto for_y = acceptor.ExportEndpoint("!y");
  auto for_x_again = acceptor.ExportEndpoint(x.instance_id());
  ASSERT_TRUE(for_x.ok() && for_y.ok() && for_x_again.ok());
  const Endpoint ex = ParseEndpoint(*for_x), ey = ParseEndpoint(*for_y);
  EXPECT_NE(ex.secret, ey.secret);
  EXPECT_EQ(*for_x_again, *for_x) << "a repeated export for the same peer must give the same bytes";
  // An endpoint for a peer the exporter dials itself carries no secret that matters (zeros).
  auto x_for_acceptor = x.ExportEndpoint(acceptor.instance_id());
  ASSERT_TRUE(x_for_acceptor.ok());
  EXPECT_EQ(ParseEndpoint(*x_for_acceptor).secret, std::string(kPeerSecretBytes, '\0'));

  absl::StatusOr<int> as_x = RawDial(ey.port, ey.inst, "cluster-token", ey.secret, x.instance_id(), 0, 3);
  ASSERT_FALSE(as_x.ok()) << "Y's secret was taken as proof of X";
  EXPECT_EQ(as_x.status().code(), absl::StatusCode::kUnauthenticated) << as_x.status();
  absl::StatusOr<int> as_y = RawDial(ey.port, ey.inst, "cluster-token", ey.secret, "!y", 0, 2);
  ASSERT_TRUE(as_y.ok()) << as_y.status();
  close(*as_y);

  ConnectResult r = ConnectBoth(x, acceptor, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
  ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
  ExpectMovesBytes(x, *r.dialed, acceptor, *r.accepted, 1 << 16);
}

// Reconnects keep working with the endpoint bytes handed out first (the secret stays for the
// life of the transport): the daemon's channel cache drops and redials channels, and a peer may
// dial again with the endpoint it already holds.
TEST(HostTcpPeerSecretTest, ReconnectsWithTheFirstEndpointKeepWorking) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedThree();
  ASSERT_EQ(ts.size(), 3u);
  Transport& dialer = *ts[0];
  Transport& acceptor = *ts[2];
  auto acceptor_ep = acceptor.ExportEndpoint(dialer.instance_id());
  auto dialer_ep = dialer.ExportEndpoint(acceptor.instance_id());
  ASSERT_TRUE(acceptor_ep.ok() && dialer_ep.ok());
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    if (round == 2) {
      ASSERT_TRUE(acceptor.ExportEndpoint(dialer.instance_id()).ok());  // a re-export changes nothing
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    absl::StatusOr<PeerId> accepted = absl::UnknownError("not run");
    std::thread th([&] { accepted = acceptor.Connect(*dialer_ep, deadline); });
    absl::StatusOr<PeerId> dialed = dialer.Connect(*acceptor_ep, deadline);
    th.join();
    ASSERT_TRUE(dialed.ok()) << dialed.status();
    ASSERT_TRUE(accepted.ok()) << accepted.status();
    ExpectMovesBytes(dialer, *dialed, acceptor, *accepted, 1 << 16);
    ASSERT_TRUE(dialer.Disconnect(*dialed).ok());
    ASSERT_TRUE(acceptor.Disconnect(*accepted).ok());
  }
  EXPECT_EQ(CountersOf(acceptor).peer_secrets, 1);
}

// max_peer_secrets: past it the least recently exported secret of a peer without a channel goes
// (counted); a peer with a live channel keeps its secret however old, and its channel keeps
// moving bytes; a dropped peer is refused until exported again, and its acceptor Connect says so;
// when every held secret is in use, ExportEndpoint fails instead of dropping one.
TEST(HostTcpPeerSecretTest, PastTheBoundOnlyUnusedSecretsAreDropped) {
  HostTcpLimits limits;
  limits.max_peer_secrets = 2;
  std::vector<std::unique_ptr<Transport>> ts = OrderedThree(limits);
  ASSERT_EQ(ts.size(), 3u);
  Transport& x = *ts[0];
  Transport& acceptor = *ts[2];
  ConnectResult r = ConnectBoth(x, acceptor, absl::Now() + absl::Seconds(20));  // exports for X first
  ASSERT_TRUE(r.dialed.ok()) << r.dialed.status();
  ASSERT_TRUE(r.accepted.ok()) << r.accepted.status();
  auto for_x = acceptor.ExportEndpoint(x.instance_id());
  ASSERT_TRUE(for_x.ok());
  auto for_y = acceptor.ExportEndpoint("!y");
  ASSERT_TRUE(for_y.ok());
  const Endpoint ey = ParseEndpoint(*for_y);
  // Make X's the least recent export: Y again. X is still kept (live channel); Y goes.
  ASSERT_TRUE(acceptor.ExportEndpoint("!y").ok());
  auto for_z = acceptor.ExportEndpoint("!z");
  ASSERT_TRUE(for_z.ok()) << for_z.status();
  HostTcpCounters c = CountersOf(acceptor);
  EXPECT_EQ(c.peer_secrets, 2);
  EXPECT_EQ(c.peer_secrets_evicted, 1);
  auto x_again = acceptor.ExportEndpoint(x.instance_id());
  ASSERT_TRUE(x_again.ok());
  EXPECT_EQ(*x_again, *for_x) << "X's secret was dropped while X had a live channel";
  ExpectMovesBytes(x, *r.dialed, acceptor, *r.accepted, 1 << 16);

  absl::StatusOr<int> y = RawDial(ey.port, ey.inst, "cluster-token", ey.secret, "!y", 0, 2);
  ASSERT_FALSE(y.ok()) << "a dropped secret still let its peer in";
  EXPECT_NE(y.status().message().find("closed the connection before proving"), std::string::npos) << y.status();
  auto waiting = acceptor.Connect(EndpointBytes("!y", "raw-node", 1, std::string(kPeerSecretBytes, '\0')),
                                  absl::Now() + absl::Seconds(20));
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kFailedPrecondition) << waiting.status();
  EXPECT_NE(waiting.status().message().find("max_peer_secrets = 2"), std::string::npos) << waiting.status();

  // Z gets a channel too (raw, control + data): now both held secrets are in use.
  RawPeer z;
  z.inst = "!z";
  ConnectRawPeer(acceptor, "cluster-token", z);
  auto refused = acceptor.ExportEndpoint("!w");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(CountersOf(acceptor).peer_secrets_evicted, 1);
  ExpectMovesBytes(acceptor, *r.accepted, x, *r.dialed, 1 << 16);
}

// Endpoints without a well-formed secret are refused by Connect with INVALID_ARGUMENT naming what
// is wrong; an export without a peer is refused too (the bytes are for one peer).
TEST(HostTcpPeerSecretTest, MalformedSecretsAreInvalidArgumentNamingIt) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedThree();
  ASSERT_EQ(ts.size(), 3u);
  Transport& dialer = *ts[0];
  Transport& acceptor = *ts[2];
  auto ep = acceptor.ExportEndpoint(dialer.instance_id());
  ASSERT_TRUE(ep.ok());
  const Endpoint acc = ParseEndpoint(*ep);
  wire::Writer old_format = RecordWriter(RecordType::kEndpoint, "host_tcp", acc.inst, acc.node);
  old_format.Str(acc.addr);
  old_format.U32(acc.port);
  wire::Writer old_multi = old_format;
  old_multi.U32(kNicsMagic);
  old_multi.U32(0);
  wire::Writer cut = old_format;
  cut.U32(kSecretMagic);
  cut.U32(kPeerSecretBytes);
  cut.Raw(acc.secret.data(), 5);
  const struct {
    std::string bytes, says;
  } cases[] = {
      {old_format.out(), "carries no per-peer secret"},
      {old_multi.out(), "carries no per-peer secret"},
      {EndpointBytes(acc.inst, acc.node, acc.port, acc.secret.substr(0, 5)), "per-peer secret of 5 bytes, not 32"},
      {EndpointBytes(acc.inst, acc.node, acc.port, ""), "per-peer secret of 0 bytes, not 32"},
      {cut.out(), "truncated per-peer secret"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.says);
    auto got = dialer.Connect(c.bytes, absl::Now() + absl::Seconds(2));
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find(c.says), std::string::npos) << got.status();
    EXPECT_NE(got.status().message().find(acc.inst), std::string::npos) << got.status();
  }
  auto none = acceptor.ExportEndpoint("");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument) << none.status();
  EXPECT_EQ(CountersOf(acceptor).hellos_unknown_instance + CountersOf(acceptor).hellos_refused, 0) << "nothing dialled";
}

// ---------------------------------------------------------------- connection rounds

// docs/status.md next step 23 (chaos runs: "v35 aborted on n2 at 10.527, n2 'data channel connected
// version=35 peer=n3' at 10.720, n3 'connected version=36 peer=n2' at 10.724, v36 timed out"): a
// version aborted while its acceptor-side Connect waited; that Connect went on waiting and took the
// connections the dialer made for the next version, whose own Connect then waited out its deadline.
// With rounds the abandoned Connect ends at its own deadline and the next round connects at once.
TEST(HostTcpRoundTest, AnAbandonedAcceptorConnectDoesNotTakeTheNextRoundsConnections) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(HostTcpLimits{});
  ASSERT_EQ(ts.size(), 2u);
  Transport& dialer = *ts[0];
  Transport& acceptor = *ts[1];
  auto ep = acceptor.ExportEndpoint(dialer.instance_id());
  auto dialer_ep = dialer.ExportEndpoint(acceptor.instance_id());
  ASSERT_TRUE(ep.ok() && dialer_ep.ok());
  // Round A: only the acceptor calls Connect (the dialer's side of the version ended first).
  const absl::Time abandoned_deadline = absl::Now() + absl::Seconds(5);
  absl::StatusOr<PeerId> abandoned = absl::UnknownError("not run");
  std::atomic<bool> abandoned_returned{false};
  std::thread a([&] {
    abandoned = acceptor.Connect(*dialer_ep, "m v35", abandoned_deadline);
    abandoned_returned = true;
  });
  struct JoinOnExit {
    std::thread& t;
    ~JoinOnExit() {
      if (t.joinable()) t.join();  // a failed ASSERT below still waits for round A's Connect
    }
  } join_a{a};
  ASSERT_TRUE(HostTcpTestWaitForAcceptors(acceptor, dialer.instance_id(), 1, absl::Now() + absl::Seconds(10)));
  // Round B while round A's Connect still waits, in the order of the chaos run: the dialer's
  // connections arrive before the acceptor's Connect of round B is called. They must stay parked
  // for round B (before rounds, round A's Connect took them as soon as the set was complete).
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto dialed = dialer.Connect(*ep, "m v36", deadline);
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  ASSERT_TRUE(HostTcpTestWaitForParked(acceptor, dialer.instance_id(), "m v36", 3, deadline))
      << "round B's connections were not parked for round B (round A's Connect: "
      << (abandoned_returned ? abandoned.status().ToString() : "still waiting") << ")";
  auto accepted = acceptor.Connect(*dialer_ep, "m v36", deadline);
  const bool b_before_a = !abandoned_returned;
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  ASSERT_TRUE(accepted.ok()) << accepted.status() << " (round A's Connect: "
                             << (abandoned_returned ? abandoned.status().ToString() : "still waiting") << ")";
  EXPECT_TRUE(b_before_a) << "round B connected only after round A's Connect ended";
  ExpectMovesBytes(dialer, *dialed, acceptor, *accepted, 1 << 20);
  ExpectMovesBytes(acceptor, *accepted, dialer, *dialed, 1 << 20);
  a.join();
  EXPECT_EQ(abandoned.status().code(), absl::StatusCode::kDeadlineExceeded) << abandoned.status();
  EXPECT_GE(absl::Now(), abandoned_deadline);
  EXPECT_NE(abandoned.status().message().find("round 'm v35'"), std::string::npos) << abandoned.status();
  EXPECT_EQ(CountersOf(acceptor).parked_connections, 0);
}

// The other order: the dialer's Connect of round A went through (its connections parked, and
// kept open: to the dialer that channel is up) while the acceptor's attempt ended before its
// Connect. The acceptor's Connect of round B takes round B's connections, not A's (before rounds
// it took A's and the dialer's B connections were parked, a round late); A's stay parked and a
// Connect of a third round names them when it misses its deadline.
TEST(HostTcpRoundTest, AConnectDoesNotTakeASetParkedForAnotherRound) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(HostTcpLimits{});
  ASSERT_EQ(ts.size(), 2u);
  Transport& dialer = *ts[0];
  Transport& acceptor = *ts[1];
  auto ep = acceptor.ExportEndpoint(dialer.instance_id());
  auto dialer_ep = dialer.ExportEndpoint(acceptor.instance_id());
  ASSERT_TRUE(ep.ok() && dialer_ep.ok());
  auto stale = dialer.Connect(*ep, "m v35", absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(stale.ok()) << stale.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<PeerId> accepted = absl::UnknownError("not run");
  std::thread b([&] { accepted = acceptor.Connect(*dialer_ep, "m v36", deadline); });
  auto dialed = dialer.Connect(*ep, "m v36", deadline);
  b.join();
  ASSERT_TRUE(dialed.ok()) << dialed.status();
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  ExpectMovesBytes(dialer, *dialed, acceptor, *accepted, 1 << 20);
  ExpectMovesBytes(acceptor, *accepted, dialer, *dialed, 1 << 20);
  EXPECT_EQ(CountersOf(acceptor).parked_connections, 3) << "round A's control + 2 data connections";
  auto third = acceptor.Connect(*dialer_ep, "m v37", absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kDeadlineExceeded) << third.status();
  EXPECT_NE(third.status().message().find("parked for other rounds, never this one's ('m v35': 3)"), std::string::npos)
      << third.status();
  // The empty round (the two-argument Connect) is a round of its own.
  auto empty = acceptor.Connect(*dialer_ep, absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kDeadlineExceeded) << empty.status();
  auto too_long = dialer.Connect(*ep, std::string(kMaxConnectRoundBytes + 1, 'r'), absl::Now() + absl::Seconds(2));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument) << too_long.status();
}

// The round is part of the hello, which both MACs cover: an on-path rewrite of it (here a relay
// turning round A into round B) fails the handshake on both sides, so nobody can relabel a
// connection into another round; nothing is parked, and the acceptor's round B gets nothing.
TEST(HostTcpRoundTest, ARoundRewrittenOnThePathFailsTheHandshake) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(HostTcpLimits{});
  ASSERT_EQ(ts.size(), 2u);
  Transport& dialer = *ts[0];
  Transport& acceptor = *ts[1];
  auto ep = acceptor.ExportEndpoint(dialer.instance_id());
  auto dialer_ep = dialer.ExportEndpoint(acceptor.instance_id());
  ASSERT_TRUE(ep.ok() && dialer_ep.ok());
  const Endpoint acc = ParseEndpoint(*ep);
  std::atomic<int> rewritten{0};
  Relay relay(acc.port, [&](std::string& piece) {
    for (size_t at = piece.find("round-A"); at != std::string::npos; at = piece.find("round-A", at)) {
      piece[at + 6] = 'B';
      ++rewritten;
    }
  });
  absl::StatusOr<PeerId> accepted = absl::UnknownError("not run");
  std::thread b([&] { accepted = acceptor.Connect(*dialer_ep, "round-B", absl::Now() + absl::Seconds(2)); });
  auto dialed = dialer.Connect(EndpointWithPort(acc, relay.port()), "round-A", absl::Now() + absl::Seconds(10));
  b.join();
  EXPECT_GE(rewritten.load(), 1) << "the relay saw no round to rewrite";
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kUnauthenticated) << dialed.status();
  EXPECT_EQ(accepted.status().code(), absl::StatusCode::kDeadlineExceeded) << accepted.status();
  EXPECT_NE(accepted.status().message().find("failed authentication"), std::string::npos) << accepted.status();
  EXPECT_EQ(CountersOf(acceptor).parked_connections, 0);
}

// A listening socket on 127.0.0.1 at a port the kernel picks (*port): a stand-in for an acceptor
// built before connection rounds. -1 when it cannot be made.
int ListenLoopback(uint16_t* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  socklen_t len = sizeof(sa);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(fd, 16) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  *port = ntohs(sa.sin_port);
  return fd;
}

// The empty round's hello is the one binaries before connection rounds send ({"WWBF", id, index,
// count}): such a hello is authenticated and parked in the empty round (a node the daemon does not
// negotiate rounds with: rolling upgrades). A Connect of another round never takes that set; a
// Connect of the empty round does.
TEST(HostTcpRoundTest, AHelloWithoutARoundIsTheEmptyRound) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(HostTcpLimits{});
  ASSERT_EQ(ts.size(), 2u);
  Transport& dialer = *ts[0];
  Transport& acceptor = *ts[1];
  auto ep = acceptor.ExportEndpoint(dialer.instance_id());
  auto dialer_ep = dialer.ExportEndpoint(acceptor.instance_id());
  ASSERT_TRUE(ep.ok() && dialer_ep.ok());
  const Endpoint acc = ParseEndpoint(*ep);
  std::vector<int> fds;
  for (uint32_t idx = 0; idx < 3; ++idx) {
    absl::StatusOr<int> old = RawDial(acc.port, acc.inst, "cluster-token", acc.secret, dialer.instance_id(), idx, 3, "",
                                      /*old_hello=*/true);
    ASSERT_TRUE(old.ok()) << old.status();
    fds.push_back(*old);
  }
  EXPECT_EQ(CountersOf(acceptor).hellos_without_round, 3);
  EXPECT_EQ(CountersOf(acceptor).hellos_refused, 0);
  ASSERT_TRUE(HostTcpTestWaitForParked(acceptor, dialer.instance_id(), "", 3, absl::Now() + absl::Seconds(10)));
  auto other = acceptor.Connect(*dialer_ep, "m v1", absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kDeadlineExceeded) << other.status();
  EXPECT_NE(other.status().message().find("parked for other rounds"), std::string::npos) << other.status();
  auto empty = acceptor.Connect(*dialer_ep, "", absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(CountersOf(acceptor).parked_connections, 0);
  // A hello of the new format must carry a round: the empty one has one encoding only.
  absl::StatusOr<int> empty_new =
      RawDial(acc.port, acc.inst, "cluster-token", acc.secret, dialer.instance_id(), 0, 3, "", /*old_hello=*/false);
  EXPECT_FALSE(empty_new.ok());
  EXPECT_EQ(CountersOf(acceptor).hellos_refused, 1);
  for (int fd : fds) close(fd);
}

// ... and a Connect of the empty round dials with that hello, so that a binary from before rounds
// (which parses a hello exactly) takes it.
TEST(HostTcpRoundTest, AnEmptyRoundDialsWithTheHelloOfBinariesBeforeRounds) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(HostTcpLimits{});
  ASSERT_EQ(ts.size(), 2u);
  Transport& dialer = *ts[0];
  uint16_t listen_port = 0;
  const int listen_fd = ListenLoopback(&listen_port);
  ASSERT_GE(listen_fd, 0);
  std::string first_hello;
  std::thread old([&] {
    const int c = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) return;
    uint32_t n = 0;
    if (recv(c, &n, 4, MSG_WAITALL) == 4 && n < 4096) {
      first_hello.assign(n, '\0');
      if (recv(c, first_hello.data(), n, MSG_WAITALL) != static_cast<ssize_t>(n)) first_hello.clear();
    }
    close(c);
  });
  const std::string old_ep =
      EndpointBytes(std::string(1, '\x7f') + "old-acceptor", "old-node", listen_port, std::string(kPeerSecretBytes, 's'));
  auto dialed = dialer.Connect(old_ep, "", absl::Now() + absl::Milliseconds(500));
  EXPECT_FALSE(dialed.ok());
  old.join();
  close(listen_fd);
  wire::Reader r(first_hello);
  const uint32_t magic = r.U32();
  const std::string inst = r.Str();
  const uint32_t idx = r.U32(), total = r.U32();
  EXPECT_TRUE(r.ok() && r.done()) << "the empty round's hello carries more than the hello before rounds";
  EXPECT_EQ(magic, 0x46425757u) << "not the hello before rounds (\"WWBF\")";
  EXPECT_EQ(inst, dialer.instance_id());
  EXPECT_EQ(idx, 0u);
  EXPECT_GE(total, 2u);
}

// Mixed builds, old acceptor: a binary from before rounds parses a hello exactly ("WWBF" and four
// fields), so it refuses this one's hello and closes the connection before proving itself. The
// dialer redials until its deadline and then says that the acceptor may be such a binary.
TEST(HostTcpRoundTest, ADialerWhoseHellosAreClosedUnreadNamesOldBinaries) {
  std::vector<std::unique_ptr<Transport>> ts = OrderedPair(HostTcpLimits{});
  ASSERT_EQ(ts.size(), 2u);
  Transport& dialer = *ts[0];
  uint16_t listen_port = 0;
  const int listen_fd = ListenLoopback(&listen_port);
  ASSERT_GE(listen_fd, 0);
  // The old acceptor: reads the length-prefixed hello, finds it malformed, closes.
  std::thread old([&] {
    while (true) {
      const int c = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      uint32_t n = 0;
      if (recv(c, &n, 4, MSG_WAITALL) == 4 && n < 4096) {
        std::string hello(n, '\0');
        recv(c, hello.data(), n, MSG_WAITALL);
        uint32_t magic = 0;
        std::memcpy(&magic, hello.data(), 4);
        EXPECT_NE(magic, 0x46425757u) << "a hello an old acceptor would parse as its own";
      }
      close(c);
    }
  });
  const std::string old_ep =
      EndpointBytes(std::string(1, '\x7f') + "old-acceptor", "old-node", listen_port, std::string(kPeerSecretBytes, 's'));
  auto dialed = dialer.Connect(old_ep, "m v1", absl::Now() + absl::Seconds(1));
  shutdown(listen_fd, SHUT_RDWR);
  old.join();
  close(listen_fd);
  EXPECT_EQ(dialed.status().code(), absl::StatusCode::kUnavailable) << dialed.status();
  EXPECT_NE(dialed.status().message().find("from before connection rounds"), std::string::npos) << dialed.status();
}

}  // namespace
}  // namespace wb::transport
