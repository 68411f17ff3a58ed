#pragma once
// Mutual challenge-response over one connected stream socket: both ends prove that they hold the
// same shared key (the daemons' token) without sending it. Used by host_tcp on every connection
// before any frame flows (docs/security.md, "Data channel").
//
// Wire (every message is a u32 little-endian length followed by that many bytes, capped):
//   1. dialer   -> acceptor  HELLO  = magic "WBCA", version, dialer instance id, nonce_d (32 random bytes)
//   2. acceptor -> dialer    PROOF  = magic, version, acceptor instance id, nonce_a (32), mac_a
//   3. dialer   -> acceptor  PROOF  = mac_d                      (only if mac_a verified)
//   4. acceptor -> dialer    one verdict byte: 1 accepted, 0 refused
// mac_X = HMAC-SHA256(key, label || role_X || len|dialer id || len|acceptor id || nonce_d ||
//                     nonce_a || len|context), role_X = "acceptor" or "dialer".
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
// What this does NOT do: encrypt or MAC the traffic after the handshake. An attacker who can
// modify packets on the path can still hijack an authenticated connection; this keeps out anyone
// who can merely reach the port.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace wb::transport {

struct ChannelAuthParams {
  absl::string_view key;      // shared secret; may be empty (see above)
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
inline constexpr uint8_t kChannelAuthVersion = 1;
inline constexpr size_t kChannelAuthNonceBytes = 32;
inline constexpr size_t kChannelAuthMacBytes = 32;
inline constexpr uint32_t kChannelAuthMaxMessage = 4096;  // a longer length prefix is refused unread
inline constexpr size_t kChannelAuthMaxId = 1024;

}  // namespace wb::transport
