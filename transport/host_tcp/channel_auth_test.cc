// Channel authentication over socketpairs: good and bad keys, forged, truncated, oversized and
// replayed messages, silent peers.
#include "transport/host_tcp/channel_auth.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "base/wire.h"

namespace wb::transport {
namespace {

// A connected stream socketpair whose ends close with the test; reads time out after 10 s so a
// bug fails the test instead of hanging it.
struct Pair {
  int fd[2] = {-1, -1};
  Pair() {
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fd), 0);
    struct timeval tv = {10, 0};
    for (int f : fd) setsockopt(f, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~Pair() {
    for (int f : fd) {
      if (f >= 0) close(f);
    }
  }
  void Close(int i) {
    close(fd[i]);
    fd[i] = -1;
  }
};

ChannelAuthParams Params(absl::string_view key, absl::string_view self, absl::string_view peer,
                         absl::Duration timeout = absl::Seconds(5)) {
  ChannelAuthParams p;
  p.key = key;
  p.self = self;
  p.peer = peer;
  p.context = "stream 1/5";
  p.deadline = absl::Now() + timeout;
  return p;
}

struct Result {
  absl::Status dialer, acceptor;
};

Result Handshake(absl::string_view dialer_key, absl::string_view acceptor_key, absl::string_view dialer_context = "stream 1/5",
           absl::string_view expected_acceptor = "acc", absl::string_view dialer_secret = "",
           absl::string_view acceptor_secret = "") {
  Pair s;
  Result r;
  std::thread acc([&] {
    ChannelAuthParams a = Params(acceptor_key, "acc", "dia");
    a.peer_secret = acceptor_secret;
    r.acceptor = AuthenticateAcceptor(s.fd[1], a);
  });
  ChannelAuthParams d = Params(dialer_key, "dia", expected_acceptor);
  d.context = dialer_context;
  d.peer_secret = dialer_secret;
  r.dialer = AuthenticateDialer(s.fd[0], d);
  if (!r.dialer.ok()) s.Close(0);  // as host_tcp does: the acceptor then sees EOF, not a hang
  acc.join();
  return r;
}

bool SendAll(int fd, const std::string& bytes) {
  return send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

std::string Framed(const std::string& body) {
  wire::Writer w;
  w.U32(static_cast<uint32_t>(body.size()));
  w.Raw(body.data(), body.size());
  return w.out();
}

// Reads one length-prefixed message (with its prefix) the way a relay would.
std::string ReadFramed(int fd) {
  uint32_t n = 0;
  if (recv(fd, &n, 4, MSG_WAITALL) != 4 || n > kChannelAuthMaxMessage) return "";
  std::string body(n, '\0');
  if (n > 0 && recv(fd, body.data(), n, MSG_WAITALL) != static_cast<ssize_t>(n)) return "";
  return Framed(body);
}

std::string Challenge(const std::string& dialer_id) {
  wire::Writer w;
  w.U32(kChannelAuthMagic);
  w.U8(kChannelAuthVersion);
  w.Str(dialer_id);
  std::string nonce(kChannelAuthNonceBytes, 'n');
  w.Raw(nonce.data(), nonce.size());
  return Framed(w.out());
}

TEST(ChannelAuthTest, SameKeyPassesBothWays) {
  Result r = Handshake("cluster-token", "cluster-token");
  EXPECT_TRUE(r.dialer.ok()) << r.dialer;
  EXPECT_TRUE(r.acceptor.ok()) << r.acceptor;
}

TEST(ChannelAuthTest, NoKeyOnEitherSideStillRunsAndPasses) {
  Result r = Handshake("", "");
  EXPECT_TRUE(r.dialer.ok()) << r.dialer;
  EXPECT_TRUE(r.acceptor.ok()) << r.acceptor;
}

TEST(ChannelAuthTest, WrongKeyIsUnauthenticatedOnBothSides) {
  Result r = Handshake("cluster-token", "other-token");
  EXPECT_EQ(r.dialer.code(), absl::StatusCode::kUnauthenticated) << r.dialer;
  EXPECT_EQ(r.acceptor.code(), absl::StatusCode::kUnauthenticated) << r.acceptor;
}

TEST(ChannelAuthTest, KeyOnOneSideOnlyIsRefused) {
  for (auto [d, a] : {std::pair<const char*, const char*>{"cluster-token", ""}, {"", "cluster-token"}}) {
    Result r = Handshake(d, a);
    EXPECT_EQ(r.dialer.code(), absl::StatusCode::kUnauthenticated) << r.dialer;
    EXPECT_EQ(r.acceptor.code(), absl::StatusCode::kUnauthenticated) << r.acceptor;
  }
}

// The per-peer secret is part of the key: the same token with another secret (or none) fails on
// both sides, whichever side lacks it; the same token and secret pass.
TEST(ChannelAuthTest, PeerSecretIsPartOfTheProof) {
  const std::string secret(kPeerSecretBytes, 's');
  std::string other = secret;
  other[7] ^= 1;
  Result same = Handshake("cluster-token", "cluster-token", "stream 1/5", "acc", secret, secret);
  EXPECT_TRUE(same.dialer.ok()) << same.dialer;
  EXPECT_TRUE(same.acceptor.ok()) << same.acceptor;
  for (auto [d, a] : {std::pair<std::string, std::string>{other, secret}, {"", secret}, {secret, ""}}) {
    Result r = Handshake("cluster-token", "cluster-token", "stream 1/5", "acc", d, a);
    EXPECT_EQ(r.dialer.code(), absl::StatusCode::kUnauthenticated) << r.dialer;
    EXPECT_NE(r.dialer.message().find("peer secret"), std::string::npos) << r.dialer;
    EXPECT_EQ(r.acceptor.code(), absl::StatusCode::kUnauthenticated) << r.acceptor;
  }
  // Token and secret are not interchangeable: moving bytes from one to the other changes the key.
  Result moved = Handshake("cluster-tokens", "cluster-token", "stream 1/5", "acc", "", "s");
  EXPECT_EQ(moved.dialer.code(), absl::StatusCode::kUnauthenticated) << moved.dialer;
}

TEST(PeerSecretsTest, OneRandomSecretPerPeerStableAcrossExports) {
  PeerSecrets t(8);
  auto none = [] { return std::set<std::string>(); };
  auto x = t.Get("x", none);
  auto y = t.Get("y", none);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(x->size(), kPeerSecretBytes);
  EXPECT_NE(*x, *y);
  EXPECT_NE(*x, std::string(kPeerSecretBytes, '\0'));
  auto again = t.Get("x", none);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *x);
  ASSERT_NE(t.Find("x"), nullptr);
  EXPECT_EQ(*t.Find("x"), *x);
  EXPECT_EQ(t.Find("z"), nullptr);
  EXPECT_EQ(t.size(), 2u);
  EXPECT_EQ(t.evicted(), 0);
}

// Past the bound the least recently exported entry goes, unless its peer is in use; when every
// entry is in use, a new peer gets RESOURCE_EXHAUSTED and nothing is dropped.
TEST(PeerSecretsTest, PastTheBoundTheLeastRecentUnusedEntryGoes) {
  PeerSecrets t(3);
  std::set<std::string> used;
  auto in_use = [&] { return used; };
  auto a = t.Get("a", in_use);
  auto b = t.Get("b", in_use);
  auto c = t.Get("c", in_use);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_TRUE(t.Get("a", in_use).ok());  // a is now the most recent export: b is the oldest
  used = {"b"};                          // ... but in use: c goes
  ASSERT_TRUE(t.Get("d", in_use).ok());
  EXPECT_EQ(t.Find("c"), nullptr);
  ASSERT_NE(t.Find("a"), nullptr);
  ASSERT_NE(t.Find("b"), nullptr);
  EXPECT_EQ(*t.Find("a"), *a);
  EXPECT_EQ(*t.Find("b"), *b);
  EXPECT_EQ(t.evicted(), 1);
  used = {"a", "b", "d"};
  auto e = t.Get("e", in_use);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted) << e.status();
  EXPECT_NE(e.status().message().find("all 3"), std::string::npos) << e.status();
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(*t.Find("a"), *a);
  EXPECT_EQ(t.evicted(), 1);
  // An entry already held is returned whatever the bound.
  EXPECT_TRUE(t.Get("d", in_use).ok());
}

TEST(ChannelAuthTest, ContextIsBoundIntoTheProof) {
  Result r = Handshake("cluster-token", "cluster-token", "stream 2/5");
  EXPECT_EQ(r.dialer.code(), absl::StatusCode::kUnauthenticated) << r.dialer;
  EXPECT_EQ(r.acceptor.code(), absl::StatusCode::kUnauthenticated) << r.acceptor;
}

TEST(ChannelAuthTest, DialerReachingAnotherInstanceSaysSo) {
  Result r = Handshake("cluster-token", "cluster-token", "stream 1/5", "someone-else");
  EXPECT_EQ(r.dialer.code(), absl::StatusCode::kUnavailable) << r.dialer;
  EXPECT_NE(r.dialer.message().find("someone-else"), std::string::npos) << r.dialer;
  EXPECT_FALSE(r.acceptor.ok());
}

TEST(ChannelAuthTest, AcceptorRefusesADialerStatingAnotherId) {
  Pair s;
  ASSERT_TRUE(SendAll(s.fd[0], Challenge("mallory")));
  absl::Status st = AuthenticateAcceptor(s.fd[1], Params("k", "acc", "dia"));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
}

TEST(ChannelAuthTest, TruncatedMessageThenCloseIsUnauthenticated) {
  Pair s;
  const std::string full = Challenge("dia");
  ASSERT_TRUE(SendAll(s.fd[0], full.substr(0, full.size() - 5)));
  s.Close(0);
  const absl::Time start = absl::Now();
  absl::Status st = AuthenticateAcceptor(s.fd[1], Params("k", "acc", "dia"));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(ChannelAuthTest, ShortBodyIsMalformed) {
  Pair s;
  ASSERT_TRUE(SendAll(s.fd[0], Framed("WBCA")));  // complete message, too short to parse
  absl::Status st = AuthenticateAcceptor(s.fd[1], Params("k", "acc", "dia"));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
  EXPECT_NE(st.message().find("malformed"), std::string::npos) << st;
}

TEST(ChannelAuthTest, OversizeLengthIsRefusedWithoutWaiting) {
  Pair s;
  wire::Writer w;
  w.U32(0xfffffff0u);
  ASSERT_TRUE(SendAll(s.fd[0], w.out()));
  const absl::Time start = absl::Now();
  absl::Status st = AuthenticateAcceptor(s.fd[1], Params("k", "acc", "dia", absl::Seconds(30)));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
  EXPECT_NE(st.message().find("oversized"), std::string::npos) << st;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(ChannelAuthTest, SilentPeerHitsTheDeadline) {
  Pair s;
  const absl::Time start = absl::Now();
  absl::Status acc = AuthenticateAcceptor(s.fd[1], Params("k", "acc", "dia", absl::Milliseconds(300)));
  EXPECT_EQ(acc.code(), absl::StatusCode::kDeadlineExceeded) << acc;
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(3));
  // The dialer against a silent acceptor (challenge sent, nothing comes back).
  absl::Status dia = AuthenticateDialer(s.fd[0], Params("k", "dia", "acc", absl::Milliseconds(300)));
  EXPECT_EQ(dia.code(), absl::StatusCode::kDeadlineExceeded) << dia;
}

// A relay in the middle records a genuine dialer's messages; replaying them to a fresh acceptor
// fails because the acceptor's nonce is new.
TEST(ChannelAuthTest, ReplayedTranscriptIsRefused) {
  std::string m1, m3;
  {
    Pair d, a;  // dialer <-> relay, relay <-> acceptor
    absl::Status ds, as;
    std::thread dialer([&] { ds = AuthenticateDialer(d.fd[0], Params("k", "dia", "acc")); });
    std::thread acceptor([&] { as = AuthenticateAcceptor(a.fd[1], Params("k", "acc", "dia")); });
    m1 = ReadFramed(d.fd[1]);
    ASSERT_TRUE(SendAll(a.fd[0], m1));
    std::string m2 = ReadFramed(a.fd[0]);
    ASSERT_TRUE(SendAll(d.fd[1], m2));
    m3 = ReadFramed(d.fd[1]);
    ASSERT_TRUE(SendAll(a.fd[0], m3));
    char verdict = 0;
    ASSERT_EQ(recv(a.fd[0], &verdict, 1, MSG_WAITALL), 1);
    ASSERT_TRUE(SendAll(d.fd[1], std::string(1, verdict)));
    dialer.join();
    acceptor.join();
    ASSERT_TRUE(ds.ok()) << ds;
    ASSERT_TRUE(as.ok()) << as;
    ASSERT_EQ(verdict, 1);
  }
  Pair s;
  absl::Status as;
  std::thread acceptor([&] { as = AuthenticateAcceptor(s.fd[1], Params("k", "acc", "dia")); });
  ASSERT_TRUE(SendAll(s.fd[0], m1));
  ASSERT_FALSE(ReadFramed(s.fd[0]).empty());  // a fresh proof with a fresh nonce
  ASSERT_TRUE(SendAll(s.fd[0], m3));
  char verdict = 1;
  ASSERT_EQ(recv(s.fd[0], &verdict, 1, MSG_WAITALL), 1);
  acceptor.join();
  EXPECT_EQ(verdict, 0);
  EXPECT_EQ(as.code(), absl::StatusCode::kUnauthenticated) << as;
}

// Sending the acceptor its own proof back as the dialer's proof fails: the role is in the MAC.
TEST(ChannelAuthTest, ReflectedProofIsRefused) {
  Pair s;
  absl::Status as;
  std::thread acceptor([&] { as = AuthenticateAcceptor(s.fd[1], Params("k", "acc", "dia")); });
  ASSERT_TRUE(SendAll(s.fd[0], Challenge("dia")));
  std::string m2 = ReadFramed(s.fd[0]);
  ASSERT_GE(m2.size(), 4 + kChannelAuthMacBytes);
  const std::string mac_a = m2.substr(m2.size() - kChannelAuthMacBytes);
  ASSERT_TRUE(SendAll(s.fd[0], Framed(mac_a)));
  char verdict = 1;
  ASSERT_EQ(recv(s.fd[0], &verdict, 1, MSG_WAITALL), 1);
  acceptor.join();
  EXPECT_EQ(verdict, 0);
  EXPECT_EQ(as.code(), absl::StatusCode::kUnauthenticated) << as;
}

}  // namespace
}  // namespace wb::transport
