#pragma once
// "host_tcp": cross-node host-memory transport over TCP (two-sided; see transport.h).
//
// Channel: per peer, TcpOptions::streams TCP connections dialled by the peer with the smaller
// instance id. Each connection opens with a hello (dialer instance id, stream index, stream count,
// the Connect's round) and then the channel authentication of transport/host_tcp/channel_auth.h, keyed by TcpOptions::auth_token
// and the per-peer secret, and bound to that hello: both sides prove they hold the token and the
// secret the acceptor made for the claimed dialer in ExportEndpoint(dialer) (HMAC-SHA256 over
// fresh nonces), and only an authenticated connection is handed to a peer. A hello claiming an
// instance the acceptor never exported an endpoint for is closed before authentication. A dialer whose proof is refused, or
// who refuses the acceptor's, fails Connect with UNAUTHENTICATED; the acceptor counts refusals per
// claimed instance and names them when its own Connect then misses the deadline. Handshakes run
// on short-lived threads, each bounded to 5 s, so a silent dialer stalls nobody. The payload is
// not encrypted or MACed afterwards (docs/security.md, "Data channel").
//
// Rounds (transport.h; docs/transport.md, "host_tcp channel setup: rounds"): the acceptor parks
// authenticated connections by (claimed instance, round), and its Connect takes only a full set
// of its own round. A Connect left waiting by an abandoned attempt therefore ends at its deadline
// and never takes the connections dialled for the next attempt. The round is part of the hello,
// which both MACs cover, so it cannot be rewritten on the way without failing the handshake.
// The empty round's hello has the format of binaries from before rounds (no round field), so a
// Connect in the empty round interoperates with such a binary both ways (the daemon negotiates
// rounds with each peer node and uses the empty round with one that has none: rolling upgrades);
// a binary from before rounds refuses a hello with a round as malformed, which this dialer
// reports at its deadline.
//
// Every frame starts with a fixed header (type, batch tag, op index, logical byte offset within
// the op, payload length), so a receiver always knows which op and offset every byte belongs to.
// Senders write payload straight from the registered memory (sendmsg with an iovec per contiguous
// piece); receivers read straight into the destination memory. Chunks of up to
// TcpOptions::chunk_bytes are pulled by the stream writers from a shared per-batch cursor, so
// faster streams carry more. Each side first sends a MANIFEST (hash of the batch as both sides
// must see it); data is only written after the manifests match. With Batch::checksum the sender
// hashes every chunk (XXH3_64, seeded by op and offset), sends the XOR of those hashes after the
// data, and the receiver verifies its own hash of what landed before ACKing; the sender completes
// only after the ACK. Any failure (mismatch, checksum, deadline, peer vanished) closes the peer's
// connections and fails its unfinished batches; reconnect to continue.
// Mirror batches must be posted by both sides in the same order.
//
// Unit hashing (Batch::unit_hashes, transport.h UnitHashes; end-to-end digests' cost): the sender
// cuts a hashed op into frames of whole units (the largest multiple of the unit <= chunk_bytes, at
// least one unit) and hashes each slice (<= 256 KiB) of the source right before handing it to the
// socket; the receiver hashes each slice of a frame of whole units right after recv wrote it into
// the destination. A frame that cuts a unit is not hashed: that op stays incomplete.
//
// Multi-NIC (TcpOptions::local_addresses): one listener per NIC, all advertised in the endpoint;
// the dialer binds data stream j to local NIC j mod L and dials remote NIC j mod R. A NIC that
// cannot be bound or reached fails Connect (no fallback) with an error naming the stream and both
// addresses, by the Connect deadline. Stream threads are pinned to TransportConfig::cpus when set.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/config.h"
#include "transport/transport.h"

namespace wb::transport {

absl::StatusOr<std::unique_ptr<Transport>> NewHostTcpTransport(const TransportConfig& config);

// Bounds on what an authenticated peer can make a transport hold (docs/transport.md, "host_tcp:
// what an authenticated peer can hold"). The defaults are what NewHostTcpTransport(config) uses;
// tests pass smaller ones.
struct HostTcpLimits {
  // Authenticated connections parked until a Connect claims them (acceptor side), over all claimed
  // instances. A hello past this bound is closed before authentication (the dialer sees "closed
  // before proving" and redials until its deadline), unless a Connect is waiting for the instance
  // it claims in that round (then it is always taken). Per claimed instance and round at most 65
  // (stream count <= 64 + 1).
  int max_parked_connections = 1024;
  // Rounds of one claimed instance parked with no Connect waiting for them. Parking a further round
  // closes that instance's round whose last connection arrived first (parked_superseded): a dialer
  // that opened a newer round gave up the older one, and its stale sets should not hold the park
  // for parked_timeout. Rounds a Connect waits for are not counted.
  int max_parked_rounds_per_instance = 16;
  // An (instance, round) whose parked connections no Connect took within this time (since its last
  // one arrived) has them closed; checked whenever a hello arrives or a connection is parked.
  absl::Duration parked_timeout = absl::Seconds(60);
  // Control frames (MANIFEST / CHECKSUM / ACK) one peer channel may hold for batches this side has
  // not posted yet; one more closes the channel (RESOURCE_EXHAUSTED naming the peer). A batch the
  // peer posted first leaves at most three such frames, so the default holds 21,845 batches ahead.
  int64_t max_early_control_frames = int64_t{1} << 16;
  // Per-peer secrets kept (one per peer instance that dials this one, made in ExportEndpoint; see
  // PeerSecrets in channel_auth.h). A new peer past this bound drops the least recently exported
  // secret whose peer has no channel, parked connection or waiting Connect (that peer must be
  // exported for again before it can connect; the daemon exports before every Connect); if every
  // one is in use, ExportEndpoint fails with RESOURCE_EXHAUSTED. ~100 bytes each.
  int64_t max_peer_secrets = 16384;
};

absl::StatusOr<std::unique_ptr<Transport>> NewHostTcpTransport(const TransportConfig& config,
                                                               const HostTcpLimits& limits);

// What the bounds above have done so far (diagnostics and tests).
struct HostTcpCounters {
  int64_t parked_connections = 0;    // now: authenticated connections waiting for a Connect
  int64_t parked_refused = 0;        // hellos closed before authentication: max_parked_connections
  int64_t parked_expired = 0;        // parked connections closed: no Connect within parked_timeout
  int64_t parked_hung_up = 0;        // parked connections a Connect found closed by their dialer (dropped)
  int64_t parked_superseded = 0;     // parked connections closed past max_parked_rounds_per_instance
  int64_t parked_cancelled = 0;      // connections closed because CancelRound cancelled their round
                                     // (parked ones, and hellos of it arriving later)
  int64_t hellos_refused = 0;        // malformed hellos, stream index / count out of range, a round
                                     // over 256 bytes, or a claimed instance that cannot dial this
                                     // one (not smaller)
  int64_t hellos_without_round = 0;  // well-formed hellos of the empty round (the format of binaries
                                     // before connection rounds: rolling upgrades)
  int64_t hellos_unknown_instance = 0;  // hellos closed before authentication: this transport holds
                                        // no secret for the claimed instance (never exported for)
  int64_t peer_secrets = 0;          // now: per-peer secrets held (max_peer_secrets)
  int64_t peer_secrets_evicted = 0;  // secrets dropped past max_peer_secrets
  int64_t early_control_frames = 0;  // now, over all peers: frames held for batches not posted here
  int64_t early_overflows = 0;       // channels closed for passing max_early_control_frames
};

// INVALID_ARGUMENT if `transport` is not host_tcp.
absl::StatusOr<HostTcpCounters> HostTcpCountersOf(const Transport& transport);

// Where one connection of a peer runs (getsockname / getpeername of its socket).
struct HostTcpStreamAddresses {
  std::string local_address;
  int local_port = 0;
  std::string peer_address;
  int peer_port = 0;
};

// Diagnostics (and the multi-NIC tests): the addresses of every connection to `peer`, [0] the
// control connection, then the data streams. INVALID_ARGUMENT if `transport` is not host_tcp,
// NOT_FOUND for an unknown peer.
absl::StatusOr<std::vector<HostTcpStreamAddresses>> HostTcpStreams(const Transport& transport, PeerId peer);

// TEST ONLY: waits until at least `n` acceptor-side Connects of `transport` wait for connections
// from `peer_instance` (any round); false when the deadline passes first or `transport` is not
// host_tcp.
bool HostTcpTestWaitForAcceptors(Transport& transport, absl::string_view peer_instance, int n, absl::Time deadline);

// TEST ONLY: waits until at least `n` authenticated connections from `peer_instance` are parked
// for `round` (no Connect took them yet); false when the deadline passes first or `transport` is
// not host_tcp.
bool HostTcpTestWaitForParked(Transport& transport, absl::string_view peer_instance, absl::string_view round, int n,
                              absl::Time deadline);

// TEST ONLY: the next DATA frame `transport` receives lands with one bit of its first byte flipped,
// before any hash of it is taken (a corruption on the wire that TCP's own checksum missed).
// INVALID_ARGUMENT if `transport` is not host_tcp.
absl::Status HostTcpTestFlipNextReceived(Transport& transport);

}  // namespace wb::transport
