#include "transport/host_tcp/channel_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/wire.h"

namespace wb::transport {
namespace {

// Domain separation: a MAC made with the token for anything else never verifies here.
constexpr char kLabel[] = "weightbridge/host_tcp/channel-auth/v2";
using Nonce = std::array<uint8_t, kChannelAuthNonceBytes>;
using Mac = std::array<uint8_t, kChannelAuthMacBytes>;

// Waits until `fd` is ready for `events` or the deadline passes. Readiness includes HUP/ERR: the
// following recv/send then reports what happened.
absl::Status WaitReady(int fd, short events, absl::Time deadline, absl::string_view step) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat("the peer did not complete the handshake in time (", step, ")"));
    }
    // Round up so the last wait does not spin with a 0 ms timeout.
    const int64_t ms = std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, INT_MAX);
    struct pollfd p = {fd, events, 0};
    const int r = poll(&p, 1, static_cast<int>(ms));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::UnavailableError(absl::StrCat("poll during ", step, ": ", std::strerror(errno)));
    if (r > 0) return absl::OkStatus();
  }
}

bool PeerGone(int e) { return e == ECONNRESET || e == EPIPE || e == ENOTCONN; }

absl::Status ReadExact(int fd, void* out, size_t n, absl::Time deadline, absl::string_view step) {
  char* c = static_cast<char*>(out);
  while (n > 0) {
    RETURN_IF_ERROR(WaitReady(fd, POLLIN, deadline, step));
    const ssize_t r = recv(fd, c, n, MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r == 0 || (r < 0 && PeerGone(errno))) {
      return absl::UnauthenticatedError(absl::StrCat("the peer closed the connection during ", step));
    }
    if (r < 0) return absl::UnavailableError(absl::StrCat("recv during ", step, ": ", std::strerror(errno)));
    c += r;
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::Status WriteExact(int fd, const void* in, size_t n, absl::Time deadline, absl::string_view step) {
  const char* c = static_cast<const char*>(in);
  while (n > 0) {
    RETURN_IF_ERROR(WaitReady(fd, POLLOUT, deadline, step));
    const ssize_t r = send(fd, c, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r < 0 && PeerGone(errno)) {
      return absl::UnauthenticatedError(absl::StrCat("the peer closed the connection during ", step));
    }
    if (r <= 0) return absl::UnavailableError(absl::StrCat("send during ", step, ": ", std::strerror(errno)));
    c += r;
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::Status WriteMessage(int fd, const std::string& body, absl::Time deadline, absl::string_view step) {
  std::string framed;
  const uint32_t n = static_cast<uint32_t>(body.size());
  framed.append(reinterpret_cast<const char*>(&n), 4);
  framed.append(body);
  return WriteExact(fd, framed.data(), framed.size(), deadline, step);
}

// A length prefix over the cap is refused before anything is allocated or read.
absl::StatusOr<std::string> ReadMessage(int fd, absl::Time deadline, absl::string_view step) {
  uint32_t n = 0;
  RETURN_IF_ERROR(ReadExact(fd, &n, 4, deadline, step));
  if (n > kChannelAuthMaxMessage) {
    return absl::UnauthenticatedError(
        absl::StrCat("the peer sent an oversized message (", n, " > ", kChannelAuthMaxMessage, " bytes) during ", step));
  }
  std::string body(n, '\0');
  RETURN_IF_ERROR(ReadExact(fd, body.data(), n, deadline, step));
  return body;
}

absl::StatusOr<Nonce> FreshNonce() {
  Nonce n;
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    return absl::InternalError("channel auth: RAND_bytes failed (no entropy?)");
  }
  return n;
}

// The HMAC key: token and peer secret, each length-prefixed (no other pair encodes the same).
// A key longer than SHA-256's block is hashed by HMAC first; either way a party lacking one part
// lacks the key. Wiped after use.
class MacKey {
 public:
  MacKey(absl::string_view token, absl::string_view peer_secret) {
    wire::Writer w;
    w.Str(token);
    w.Str(peer_secret);
    bytes_ = std::move(w.out());
  }
  ~MacKey() { OPENSSL_cleanse(bytes_.data(), bytes_.size()); }
  MacKey(const MacKey&) = delete;
  MacKey& operator=(const MacKey&) = delete;
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

absl::StatusOr<Mac> ComputeMac(const MacKey& key, absl::string_view role, absl::string_view dialer,
                               absl::string_view acceptor, const Nonce& nonce_d, const Nonce& nonce_a,
                               absl::string_view context) {
  wire::Writer w;
  w.Raw(kLabel, sizeof(kLabel));  // with its NUL: the label cannot run into the role
  w.Str(role);
  w.Str(dialer);
  w.Str(acceptor);
  w.Raw(nonce_d.data(), nonce_d.size());
  w.Raw(nonce_a.data(), nonce_a.size());
  w.Str(context);
  Mac mac;
  unsigned int len = 0;
  // Never empty (two length prefixes), so HMAC() always gets a non-null key pointer.
  const std::string& k = key.bytes();
  if (HMAC(EVP_sha256(), k.data(), static_cast<int>(k.size()), reinterpret_cast<const unsigned char*>(w.out().data()),
           w.out().size(), mac.data(), &len) == nullptr ||
      len != mac.size()) {
    return absl::InternalError("channel auth: HMAC-SHA256 failed");
  }
  return mac;
}

bool SameMac(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

absl::Status CheckParams(const ChannelAuthParams& p) {
  if (p.self.size() > kChannelAuthMaxId || p.peer.size() > kChannelAuthMaxId) {
    return absl::InvalidArgumentError("channel auth: instance id longer than kChannelAuthMaxId");
  }
  if (p.context.size() > kChannelAuthMaxMessage) {
    return absl::InvalidArgumentError("channel auth: context longer than kChannelAuthMaxMessage");
  }
  return absl::OkStatus();
}

// The acceptor hung up before proving anything: it never saw our proof, so this says nothing about
// the token. It closes connections it has no room for (unauthenticated connections bounded per
// source and in total; host_tcp's park of authenticated connections no Connect has claimed yet),
// ones that outlive its handshake bound, and everything when it stops.
absl::Status ClosedBeforeProof(absl::Status s) {
  if (s.code() != absl::StatusCode::kUnauthenticated) return s;
  return absl::UnavailableError(absl::StrCat(
      "the acceptor closed the connection before proving itself (", s.message(),
      "): it is busy with unauthenticated connections from this address or in total, it holds as many "
      "authenticated connections waiting for a Connect as it keeps, it holds no endpoint it exported for "
      "this instance (never exported, or dropped past its bound: export it again and use the new bytes), "
      "it timed out this handshake, or it is stopping"));
}

}  // namespace

absl::Status AuthenticateDialer(int fd, const ChannelAuthParams& p) {
  RETURN_IF_ERROR(CheckParams(p));
  ASSIGN_OR_RETURN(Nonce nonce_d, FreshNonce());
  wire::Writer hello;
  hello.U32(kChannelAuthMagic);
  hello.U8(kChannelAuthVersion);
  hello.Str(p.self);
  hello.Raw(nonce_d.data(), nonce_d.size());
  RETURN_IF_ERROR(ClosedBeforeProof(WriteMessage(fd, hello.out(), p.deadline, "sending the challenge")));

  absl::StatusOr<std::string> proof = ReadMessage(fd, p.deadline, "waiting for the acceptor's proof");
  if (!proof.ok() && absl::StrContains(proof.status().message(), "closed the connection")) {
    return ClosedBeforeProof(proof.status());
  }
  ASSIGN_OR_RETURN(std::string body, std::move(proof));
  wire::Reader r(body);
  const uint32_t magic = r.U32();
  const uint8_t version = r.U8();
  const std::string acceptor = r.Str(kChannelAuthMaxId);
  Nonce nonce_a;
  Mac mac_a;
  r.Raw(nonce_a.data(), nonce_a.size());
  r.Raw(mac_a.data(), mac_a.size());
  if (!r.done() || magic != kChannelAuthMagic || version != kChannelAuthVersion) {
    return absl::UnauthenticatedError("the acceptor's proof is malformed (not a WeightBridge channel-auth v2 peer)");
  }
  if (acceptor != p.peer) {
    return absl::UnavailableError(absl::StrCat("the port now belongs to instance ", acceptor, ", not ", p.peer,
                                               " (stale endpoint?)"));
  }
  const MacKey key(p.key, p.peer_secret);
  ASSIGN_OR_RETURN(Mac want_a, ComputeMac(key, "acceptor", p.self, acceptor, nonce_d, nonce_a, p.context));
  // Proving our side before this check would hand a MAC to whoever answered: verify first.
  if (!SameMac(want_a, mac_a)) {
    return absl::UnauthenticatedError("the acceptor's proof does not match our token and the peer secret of its endpoint");
  }

  ASSIGN_OR_RETURN(Mac mac_d, ComputeMac(key, "dialer", p.self, acceptor, nonce_d, nonce_a, p.context));
  RETURN_IF_ERROR(WriteMessage(fd, std::string(reinterpret_cast<const char*>(mac_d.data()), mac_d.size()), p.deadline,
                               "sending our proof"));
  uint8_t verdict = 0;
  RETURN_IF_ERROR(ReadExact(fd, &verdict, 1, p.deadline, "waiting for the acceptor's verdict"));
  if (verdict != 1) return absl::UnauthenticatedError("the acceptor refused our proof");
  return absl::OkStatus();
}

absl::Status AuthenticateAcceptor(int fd, const ChannelAuthParams& p) {
  RETURN_IF_ERROR(CheckParams(p));
  ASSIGN_OR_RETURN(std::string body, ReadMessage(fd, p.deadline, "waiting for the dialer's challenge"));
  wire::Reader r(body);
  const uint32_t magic = r.U32();
  const uint8_t version = r.U8();
  const std::string dialer = r.Str(kChannelAuthMaxId);
  Nonce nonce_d;
  r.Raw(nonce_d.data(), nonce_d.size());
  if (!r.done() || magic != kChannelAuthMagic || version != kChannelAuthVersion) {
    return absl::UnauthenticatedError("the dialer's challenge is malformed (not a WeightBridge channel-auth v2 peer)");
  }
  if (dialer != p.peer) {
    return absl::UnauthenticatedError(
        absl::StrCat("the dialer states instance '", dialer, "' in its challenge but claimed '", p.peer, "'"));
  }
  ASSIGN_OR_RETURN(Nonce nonce_a, FreshNonce());
  const MacKey key(p.key, p.peer_secret);
  ASSIGN_OR_RETURN(Mac mac_a, ComputeMac(key, "acceptor", dialer, p.self, nonce_d, nonce_a, p.context));
  wire::Writer proof;
  proof.U32(kChannelAuthMagic);
  proof.U8(kChannelAuthVersion);
  proof.Str(p.self);
  proof.Raw(nonce_a.data(), nonce_a.size());
  proof.Raw(mac_a.data(), mac_a.size());
  RETURN_IF_ERROR(WriteMessage(fd, proof.out(), p.deadline, "sending our proof"));

  ASSIGN_OR_RETURN(std::string theirs, ReadMessage(fd, p.deadline, "waiting for the dialer's proof"));
  ASSIGN_OR_RETURN(Mac want_d, ComputeMac(key, "dialer", dialer, p.self, nonce_d, nonce_a, p.context));
  Mac mac_d{};
  const bool well_formed = theirs.size() == mac_d.size();
  if (well_formed) std::memcpy(mac_d.data(), theirs.data(), mac_d.size());
  const bool ok = well_formed && SameMac(want_d, mac_d);
  const uint8_t verdict = ok ? 1 : 0;
  // The verdict is best effort when refusing: the dialer learns it either way (0 or EOF).
  absl::Status sent = WriteExact(fd, &verdict, 1, p.deadline, "sending the verdict");
  if (!well_formed) return absl::UnauthenticatedError("the dialer's proof is malformed");
  if (!ok) return absl::UnauthenticatedError("the dialer's proof does not match our token and the secret exported for it");
  return sent;
}

PeerSecrets::~PeerSecrets() {
  for (auto& [peer, e] : entries_) OPENSSL_cleanse(e.secret.data(), e.secret.size());
}

absl::StatusOr<std::string> PeerSecrets::Get(const std::string& peer, absl::FunctionRef<std::set<std::string>()> in_use) {
  if (auto it = entries_.find(peer); it != entries_.end()) {
    it->second.last_export = ++tick_;
    return it->second.secret;
  }
  if (entries_.size() >= max_entries_) {
    // Past the bound: the least recently exported entry nobody uses goes. Linear, but only on an
    // export past the bound (a new peer instance after max_entries_ others).
    const std::set<std::string> keep = in_use();
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (keep.count(it->first) == 0 && (victim == entries_.end() || it->second.last_export < victim->second.last_export)) {
        victim = it;
      }
    }
    if (victim == entries_.end()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no per-peer secret can be made for instance ", peer.substr(0, 64), ": all ", max_entries_,
          " held are for peers with a live channel, parked connections or a waiting Connect"));
    }
    OPENSSL_cleanse(victim->second.secret.data(), victim->second.secret.size());
    entries_.erase(victim);
    ++evicted_;
  }
  Entry e;
  e.secret.resize(kPeerSecretBytes);
  if (RAND_bytes(reinterpret_cast<unsigned char*>(e.secret.data()), static_cast<int>(e.secret.size())) != 1) {
    return absl::InternalError("channel auth: RAND_bytes failed (no entropy?)");
  }
  e.last_export = ++tick_;
  return entries_.emplace(peer, std::move(e)).first->second.secret;
}

const std::string* PeerSecrets::Find(const std::string& peer) const {
  auto it = entries_.find(peer);
  return it == entries_.end() ? nullptr : &it->second.secret;
}

}  // namespace wb::transport
