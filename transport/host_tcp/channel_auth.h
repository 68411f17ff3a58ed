#pragma once
// Mutual challenge-response over one connected stream socket: both ends prove that they hold the
// same shared key (the daemons' token) and the same per-peer secret (made by the acceptor for this
// one dialer, PeerSecrets below) without sending either. Used by host_tcp on every connection
// before any frame flows (docs/security.md, "Data channel"; docs/transport.md, "What the
// data-plane handshake proves").
//
// Wire (every message is a u32 little-endian length followed by that many bytes, capped):
//   1. dialer   -> acceptor  HELLO  = magic "WBCA", version, dialer instance id, nonce_d (32 random bytes)
//   2. acceptor -> dialer    PROOF  = magic, version, acceptor instance id, nonce_a (32), mac_a
//   3. dialer   -> acceptor  PROOF  = mac_d                      (only if mac_a verified)
//   4. acceptor -> dialer    one verdict byte: 1 accepted, 0 refused
// mac_X = HMAC-SHA256(len|key || len|peer_secret, label || role_X || len|dialer id ||
//                     len|acceptor id || nonce_d || nonce_a || len|context), role_X = "acceptor" or "dialer".
// The HMAC key holds both the shared token and the per-peer secret (host_tcp: a random secret the
// acceptor made for this one dialer and handed it in its endpoint, over the control plane): a
// party that lacks either cannot make or check a proof, and each part is length-prefixed so that
// no other (token, secret) pair gives the same key.
// Fresh nonces on both sides make an old transcript useless (replay); the role in the MAC means
// an acceptor's proof never passes as a dialer's (reflection); the acceptor proves first and the
// dialer verifies before proving, so neither side signs anything for an unauthenticated party
// that it could replay as its own role. Both instance ids and the caller's context (host_tcp: its
// hello, which carries the stream index) are bound in, so a proof for one connection does not
// fit another. MACs are compared with CRYPTO_memcmp (constant time).
//
// An empty key is a valid key: with no token configured anywhere the handshake still runs (and
// passes), and a side configured with a token refuses a side without one.
//
// Version 2 (this one) added the peer secret to the key; a version 1 peer is refused as malformed.
//
// What this does NOT do: encrypt or MAC the traffic after the handshake. An attacker who can
// modify packets on the path can still hijack an authenticated connection; this keeps out anyone
// who can merely reach the port.

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wb::transport {

struct ChannelAuthParams {
  absl::string_view key;      // shared secret; may be empty (see above)
  // The secret the acceptor made for this dialer (host_tcp: PeerSecrets, carried in the acceptor's
  // endpoint for that dialer). Both sides must pass the same bytes; may be empty (then only `key`
  // is proven).
  absl::string_view peer_secret;
  absl::string_view self;     // this side's instance id
  // Dialer: the instance it means to reach (from the endpoint). Acceptor: the instance the dialer
  // claimed before the handshake (host_tcp's hello); the dialer must state the same id.
  absl::string_view peer;
  absl::string_view context;  // bytes both sides already agree on, bound into the MACs; may be empty
  absl::Time deadline;        // the whole handshake; every read and write waits at most until then
};

// Both run on a connected, blocking or non-blocking, stream socket `fd` (never closed here; the
// caller closes it on error). OK means the peer proved knowledge of `key` for this transcript.
//   UNAUTHENTICATED:   proofs differ (key differs or is missing on one side), or the peer sent a
//                      malformed/truncated/oversized message or closed mid-handshake, or its
//                      stated id differs from `peer` on the acceptor side.
//   DEADLINE_EXCEEDED: the peer did not answer in time.
//   UNAVAILABLE:       (dialer) the socket failed, the acceptor closed the connection before
//                      sending its proof (busy: too many unauthenticated connections; its
//                      handshake bound passed; stopping) - nothing about the key - or the acceptor
//                      is another instance than `peer` (stale endpoint).
// Messages name the step that failed, not the key.
absl::Status AuthenticateDialer(int fd, const ChannelAuthParams& params);
absl::Status AuthenticateAcceptor(int fd, const ChannelAuthParams& params);

// Wire constants, exposed for tests that forge messages.
inline constexpr uint32_t kChannelAuthMagic = 0x41434257;  // "WBCA" little-endian
inline constexpr uint8_t kChannelAuthVersion = 2;
inline constexpr size_t kChannelAuthNonceBytes = 32;
inline constexpr size_t kChannelAuthMacBytes = 32;
inline constexpr uint32_t kChannelAuthMaxMessage = 4096;  // a longer length prefix is refused unread
inline constexpr size_t kChannelAuthMaxId = 1024;
inline constexpr size_t kPeerSecretBytes = 32;

// The per-peer secrets an acceptor hands out, one per dialer instance id (host_tcp: made in
// ExportEndpoint(peer), required by the handshake of every connection claiming that peer). A
// secret comes from RAND_bytes (as the handshake's nonces) and stays the same for the life of the
// table, so repeated exports, reused channels and reconnects keep working, unless it is evicted:
// the table holds at most `max_entries`, and a new peer past that evicts the least recently
// exported entry whose peer is not in use (host_tcp: a live channel, a parked connection or a
// waiting Connect). A peer whose entry was evicted is refused until it is exported again, which
// the daemon does before every Connect. If every entry is in use, Get fails (RESOURCE_EXHAUSTED)
// rather than break a channel. Not thread-safe: the owner guards it.
class PeerSecrets {
 public:
  explicit PeerSecrets(size_t max_entries) : max_entries_(max_entries) {}
  ~PeerSecrets();
  PeerSecrets(const PeerSecrets&) = delete;
  PeerSecrets& operator=(const PeerSecrets&) = delete;

  // The secret for `peer` (kPeerSecretBytes), made on first use. `in_use` is asked only when an
  // entry must be evicted, for the peers whose entries must stay.
  absl::StatusOr<std::string> Get(const std::string& peer, absl::FunctionRef<std::set<std::string>()> in_use);
  // The secret held for `peer`, or nullptr (never exported, or evicted). Valid until the next Get.
  const std::string* Find(const std::string& peer) const;

  size_t size() const { return entries_.size(); }
  int64_t evicted() const { return evicted_; }

 private:
  struct Entry {
    std::string secret;
    uint64_t last_export = 0;  // the tick of the last Get: the least recent goes first
  };
  const size_t max_entries_;
  uint64_t tick_ = 0;
  int64_t evicted_ = 0;
  std::map<std::string, Entry> entries_;
};

}  // namespace wb::transport
