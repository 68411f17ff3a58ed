#include "transport/host_tcp/host_tcp.h"

#include <cmath>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <xxhash.h>
#if defined(__x86_64__)
// XXH3 with the widest vector unit of this CPU (AVX2 / AVX-512 instead of the library's SSE2
// default): same hashes, about twice as fast (~8 vs ~4 GB/s per core on cold data). The macros of
// this header route XXH3_64bits* to libxxhash's *_dispatch entry points.
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <iterator>
#include <list>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "transport/host_tcp/channel_auth.h"
#include "transport/common.h"
#include "transport/cpu_affinity.h"
#include "transport/host_tcp/nic_list.h"
#include "transport/host_tcp/parking.h"
#include "transport/host_tcp/send_pacer.h"
#include "transport/registry.h"
#include "transport/strided.h"
#include "base/wire.h"

namespace wb::transport {
namespace {

constexpr char kKind[] = "host_tcp";
constexpr uint32_t kFrameMagic = 0x46425757;  // "WWBF"
// A connection's hello: {kHelloMagic, dialer instance id, stream index, stream count, round} for a
// non-empty round; {kFrameMagic, id, index, count} - the hello of binaries before connection
// rounds - for the empty round (docs/transport.md, "host_tcp channel setup: rounds"). So a Connect
// in the empty round talks to such a binary both ways (the daemon uses the empty round with a peer
// node that did not say it has rounds: a rolling upgrade), and a binary before rounds, which parses
// a hello exactly, refuses a hello with a round before authentication rather than connecting
// across rounds.
constexpr uint32_t kHelloMagic = 0x52425757;  // "WWBR"
// Rounds past this many bytes in a Connect are INVALID_ARGUMENT; in a hello, refused.
constexpr size_t kMaxRoundBytes = kMaxConnectRoundBytes;
constexpr int kMaxIov = 64;                    // more pieces than this per chunk: pack via scratch
// An accepted connection must introduce itself and pass the channel authentication within this
// time, or it is closed; each runs on its own short-lived thread, at most this many at once.
constexpr absl::Duration kAcceptHandshakeTimeout = absl::Seconds(5);
constexpr size_t kMaxConcurrentHandshakes = 256;
// Unauthenticated connections one source address may have in handshake at once: more are closed
// (the dialer retries). A peer dials streams + 1 at once; nodes sharing an address (tests on
// loopback) add up. Over the total, the oldest handshake of the address holding the most is
// closed instead when that address holds more than the newcomer's, so silent connections from a
// few addresses cannot lock out a peer dialing from another one.
constexpr int kMaxHandshakesPerSource = 32;
// A dialer whose connection the acceptor closed before proving itself (busy, see above) retries
// with this backoff until its Connect deadline.
constexpr absl::Duration kRedialFirst = absl::Milliseconds(20), kRedialMax = absl::Milliseconds(500);
// Distinct claimed instance ids whose failed handshakes are counted (input from unauthenticated
// dialers: bounded).
constexpr size_t kMaxAuthFailureIds = 1024;
constexpr char kAuthRefused[] =
    "shared token differs or is missing on one side, or the dialer's per-peer secret is not the one the acceptor "
    "exported for it";
// Multi-NIC endpoints append this marker, the count of further NICs and their (address, port)
// after the single-address fields and the secret (kSecretMagic below).
constexpr uint32_t kNicsMagic = 0x494e4257;  // "WBNI"
constexpr uint32_t kMaxNics = 64;
// Every endpoint carries, right after the primary (address, port), this marker and the per-peer
// secret (length-prefixed, kPeerSecretBytes) that the exporter requires of the peer the endpoint
// is for when that peer dials it (docs/transport.md, "What the data-plane handshake proves").
// An endpoint for a peer that the exporter dials itself (a larger instance id) carries zeros: that
// peer never dials it, so no secret is made or kept for it.
constexpr uint32_t kSecretMagic = 0x53504257;  // "WBPS"
// tcp.streams' range: a hello's stream count (data streams + the control connection) is in
// [2, kMaxStreams + 1] and its index below the count; any other hello is closed unauthenticated.
constexpr int kMaxStreams = 64;

// kFeatures, kCancel (control connection) and kCancelEnd (data connections) came with
// CancelBatches (docs/transport.md, "host_tcp: cancelling a group of batches"). A binary from before
// them ignores a control frame of a type it does not know (so every channel opens with kFeatures)
// but closes a data connection on one: kCancel and kCancelEnd go only to a peer whose kFeatures
// said it takes them.
enum FrameType : uint8_t {
  kManifest = 1,
  kData = 2,
  kChecksum = 3,
  kAck = 4,
  kFeatures = 5,   // op: the sender's feature bits (kFeature*); first frame of every channel
  kCancel = 6,     // the sender cancelled batch `tag` (its mirror ends CANCELLED here)
  kCancelEnd = 7,  // on each data connection: no frame of batch `tag` follows on it from the sender
};
constexpr uint32_t kFeatureCancel = 1;  // takes kCancel / kCancelEnd
// A discarded DATA frame of a cancelled batch is read into scratch in pieces of at most this size.
constexpr int64_t kDiscardPiece = int64_t{1} << 20;

// Every frame starts with this header; DATA/ACK carry `len` payload bytes after it.
struct FrameHeader {
  uint32_t magic;
  uint8_t type;
  uint8_t pad[3];
  uint64_t tag;
  uint32_t op;      // DATA: op index; ACK: absl status code
  uint32_t pad2;
  int64_t offset;   // DATA: logical byte offset in the op; MANIFEST/CHECKSUM: the hash
  int64_t len;      // DATA/ACK: payload bytes
};
static_assert(sizeof(FrameHeader) == 40);

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// AuthenticateDialer's "the acceptor closed the connection before proving itself" (busy acceptor):
// worth a fresh connection, unlike a refused proof.
bool IsClosedBeforeProof(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable && absl::StrContains(s.message(), "closed the connection before proving");
}

bool WriteAll(int fd, struct iovec* iov, int iovcnt) {
  while (iovcnt > 0) {
    struct msghdr msg = {};
    msg.msg_iov = iov;
    msg.msg_iovlen = iovcnt;
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    while (iovcnt > 0 && static_cast<size_t>(n) >= iov->iov_len) {
      n -= iov->iov_len;
      ++iov;
      --iovcnt;
    }
    if (iovcnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= n;
    }
  }
  return true;
}

// Reads exactly n bytes by `deadline` (poll before every recv): a dialer that trickles bytes
// cannot hold an accept-side handshake past its deadline.
bool ReadAllBy(int fd, void* p, size_t n, absl::Time deadline) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    struct pollfd pfd = {fd, POLLIN, 0};
    const int r = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    const ssize_t got = recv(fd, c, n, MSG_DONTWAIT);
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (got <= 0) return false;
    c += got;
    n -= got;
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = recv(fd, c, n, MSG_WAITALL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= r;
  }
  return true;
}

struct Region : RegionRecord {};

// Unit hashing (transport::UnitHashes): bytes are hashed in slices of at most this size right
// before they are sent / right after they landed, so the hash and the socket copy share the cache.
constexpr int64_t kHashSlice = int64_t{256} << 10;

struct XxhStateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using XxhState = std::unique_ptr<XXH3_state_t, XxhStateDeleter>;

// Hashes the units of one op's logical stream of `total` bytes as slices of it pass, in logical
// order; a slice never crosses a unit border (ForEachSlice cuts there).
class UnitHasher {
 public:
  UnitHasher(XXH3_state_t* st, int64_t unit, int64_t total, uint64_t* out) : st_(st), unit_(unit), total_(total), out_(out) {}
  void Update(int64_t logical, const char* p, int64_t n) {
    if (logical % unit_ == 0) XXH3_64bits_reset_withSeed(st_, static_cast<uint64_t>(logical / unit_));
    XXH3_64bits_update(st_, p, static_cast<size_t>(n));
    const int64_t e = logical + n;
    if (e % unit_ == 0 || e == total_) out_[(e - 1) / unit_] = XXH3_64bits_digest(st_);
  }

 private:
  XXH3_state_t* st_;
  const int64_t unit_, total_;
  uint64_t* out_;
};

// side.ForEachPiece(begin, end, f), the pieces cut at unit borders and into kHashSlice slices.
template <typename F>
void ForEachSlice(const StridedLayout& side, int64_t begin, int64_t end, int64_t unit, F&& f) {
  side.ForEachPiece(begin, end, [&](int64_t off, int64_t logical, int64_t len) {
    while (len > 0) {
      const int64_t n = std::min({len, kHashSlice, unit - logical % unit});
      f(off, logical, n);
      off += n;
      logical += n;
      len -= n;
    }
  });
}

// Units of `unit` bytes in logical range [begin, end) of an op of `total` bytes when the range
// holds whole units only (begin on a border, end on one or at the op's end), else 0.
int64_t WholeUnits(int64_t unit, int64_t begin, int64_t end, int64_t total) {
  if (unit <= 0 || begin % unit != 0 || (end % unit != 0 && end != total)) return 0;
  return (end - begin + unit - 1) / unit;
}

struct Chunk {
  int op;
  int64_t offset;
  int64_t len;
};

struct PeerConn;

struct TcpBatch {
  uint64_t id = 0;
  uint64_t tag = 0;
  uint64_t group = 0;  // Batch::group (CancelBatches)
  std::shared_ptr<PeerConn> peer;
  bool checksum = false;
  bool corrupt_once = false;
  std::vector<OpLayout> layouts;
  std::vector<char*> local_base;  // base of this side's region per op
  std::vector<bool> is_send;
  std::vector<uint64_t> regions;
  uint64_t manifest = 0;
  // Unit hashing (Batch::unit_hashes; null: none): per op the unit size (0: not hashed) and the
  // units hashed so far (under mu_); the hashes themselves go straight into unit_hashes->hashes.
  std::shared_ptr<UnitHashes> unit_hashes;
  std::vector<int64_t> unit;
  std::vector<int64_t> units_done;
  // sending
  std::vector<Chunk> chunks;
  size_t next_chunk = 0;
  size_t chunks_written = 0;
  uint64_t send_hash = 0;
  // receiving
  int64_t recv_expected = 0;
  int64_t recv_got = 0;
  // Per op, the byte ranges [begin, end) of its logical stream already received (or being
  // received), adjacent ranges merged: a frame overlapping one is refused, so recv_got reaching
  // recv_expected means every byte arrived exactly once (no duplicate frame can fill a hole).
  std::vector<std::map<int64_t, int64_t>> recv_ranges;
  uint64_t recv_hash = 0;
  bool peer_checksum_known = false;
  uint64_t peer_checksum = 0;
  bool manifest_matched = false;
  bool recv_done = false;
  bool ack_received = false;
  int active = 0;  // threads touching this batch's memory right now
  absl::Status status;
  int64_t bytes = 0;

  bool Succeeded() const {
    return status.ok() && manifest_matched && recv_done && ack_received && chunks_written == chunks.size();
  }
  bool Finished() const { return (Succeeded() || !status.ok()) && active == 0; }
};

struct ControlFrame {
  FrameHeader h;
  std::string payload;
};

struct PeerConn {
  uint64_t id = 0;
  std::string instance;
  std::vector<int> fds;  // [0] control, [1..] data
  std::vector<size_t> path;  // per fd: its entry in stats_.paths (fixed once the peer is created)
  bool broken = false;
  absl::Status broken_status;
  std::deque<ControlFrame> control;
  std::deque<std::shared_ptr<TcpBatch>> send_queue;
  std::map<uint64_t, std::shared_ptr<TcpBatch>> batches;  // by tag, unfinished
  std::map<uint64_t, uint64_t> early_manifest;
  std::map<uint64_t, uint64_t> early_checksum;
  std::map<uint64_t, absl::Status> early_ack;
  std::vector<std::thread> threads;
  // CancelBatches: the peer's kFeatures said it takes kCancel / kCancelEnd (a build from before
  // them sends none: cancelling a batch of it closes the channel instead).
  bool peer_can_cancel = false;
  // Any control frame came from the peer (its kFeatures, if it has them, is the first). Until then
  // whether it can take a cancel is unknown: CancelBatches holds the batches' cancels here and
  // decides at that first frame (a peer sends it at once when it connects).
  bool features_known = false;
  std::vector<std::pair<uint64_t, absl::Status>> pending_cancels;
  // Batches being cancelled, by tag, from the first of: our CancelBatches, the peer's kCancel, a
  // peer's kCancelEnd. Each side sends one kCancel and one kCancelEnd per data connection per
  // cancel (when its entry is made); the entry goes once the peer's kCancel and its kCancelEnd on
  // every data connection arrived, so no frame of the batch can follow on any connection. Meanwhile
  // DATA frames of it are read and dropped, its control frames ignored.
  struct Cancelling {
    bool peer_cancel_seen = false;
    std::vector<bool> peer_ended;  // per fd index (data connections 1..)
    int ended = 0;
  };
  std::map<uint64_t, Cancelling> cancelling;
  // Per fd index: tags whose kCancelEnd this data connection's writer still has to send (after the
  // chunk it is writing: so after every frame of the batch it sent).
  std::vector<std::deque<uint64_t>> end_markers;
  // Tags the peer cancelled before this side posted them: such a Post fails CANCELLED (once).
  std::unique_ptr<CancelledRounds> peer_cancelled = std::make_unique<CancelledRounds>();

  // Control frames held for batches this side has not posted, and cancels in progress (bounded:
  // HostTcpLimits::max_early_control_frames).
  int64_t early_frames() const {
    return static_cast<int64_t>(early_manifest.size() + early_checksum.size() + early_ack.size() + cancelling.size());
  }
};

// Claims [begin, end) in `ranges` (begin -> end, disjoint, adjacent ones merged). False, leaving
// `ranges` as it was, when it overlaps a range already there.
bool ClaimRange(std::map<int64_t, int64_t>& ranges, int64_t begin, int64_t end) {
  auto next = ranges.upper_bound(begin);  // first range starting after begin
  if (next != ranges.end() && next->first < end) return false;
  if (next != ranges.begin()) {
    auto prev = std::prev(next);
    if (prev->second > begin) return false;
    if (prev->second == begin) {  // extend the range before
      prev->second = end;
      if (next != ranges.end() && next->first == end) {
        prev->second = next->second;
        ranges.erase(next);
      }
      return true;
    }
  }
  if (next != ranges.end() && next->first == end) {  // extend the range after, downwards
    const int64_t e = next->second;
    ranges.erase(next);
    ranges.emplace(begin, e);
    return true;
  }
  ranges.emplace(begin, end);
  return true;
}

// One data-plane address of a node: where it listens (and what peers dial).
struct Nic {
  std::string addr;
  uint32_t port = 0;
};

struct Listener {
  int fd = -1;
  Nic nic;
  std::thread thread;  // its AcceptLoop
};

struct ParsedEndpoint {
  std::string instance;
  std::vector<Nic> nics;  // [0] = the primary address (the only one in single-address mode)
  std::string secret;     // what the exporter requires of us when we dial it
};

absl::StatusOr<ParsedEndpoint> ParseEndpoint(absl::string_view endpoint) {
  constexpr char kNotOne[] = "host_tcp Connect: bytes are not a host_tcp endpoint";
  wire::Reader r(endpoint);
  uint32_t magic = r.U32();
  uint8_t type = r.U8();
  std::string kind = r.Str();
  ParsedEndpoint e;
  e.instance = r.Str();
  std::string node = r.Str();
  Nic first;
  first.addr = r.Str();
  first.port = r.U32();
  e.nics.push_back(std::move(first));
  if (!r.ok() || magic != kWireMagic || type != static_cast<uint8_t>(RecordType::kEndpoint) || kind != kKind) {
    return absl::InvalidArgumentError(kNotOne);
  }
  // An endpoint without the secret (from a binary before per-peer secrets, or cut short) names
  // what is missing: a dial without it could only be refused.
  const std::string whose = absl::StrCat("host_tcp Connect: the endpoint of instance ", e.instance.substr(0, 64));
  const uint32_t secret_magic = r.done() ? 0 : r.U32();
  if (!r.ok() || (secret_magic != kSecretMagic && (r.done() || secret_magic == kNicsMagic))) {
    return absl::InvalidArgumentError(absl::StrCat(
        whose, " carries no per-peer secret (exported by a WeightBridge binary before per-peer secrets? every node "
               "must run one that has them)"));
  }
  if (secret_magic != kSecretMagic) return absl::InvalidArgumentError(kNotOne);
  e.secret = r.Str(1024);
  if (!r.ok()) return absl::InvalidArgumentError(absl::StrCat(whose, " has a truncated per-peer secret"));
  if (e.secret.size() != kPeerSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat(whose, " has a per-peer secret of ", e.secret.size(), " bytes, not ",
                                                   kPeerSecretBytes));
  }
  if (r.ok() && !r.done()) {
    const uint32_t nics_magic = r.U32();
    const uint32_t more = r.U32();
    if (nics_magic != kNicsMagic || more >= kMaxNics) return absl::InvalidArgumentError(kNotOne);
    for (uint32_t i = 0; i < more && r.ok(); ++i) {
      Nic n;
      n.addr = r.Str();
      n.port = r.U32();
      e.nics.push_back(std::move(n));
    }
  }
  if (!r.done()) return absl::InvalidArgumentError(kNotOne);
  return e;
}

// The two ends of a connected IPv4 socket.
absl::StatusOr<HostTcpStreamAddresses> SocketAddresses(int fd) {
  HostTcpStreamAddresses a;
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  char buf[INET_ADDRSTRLEN] = {};
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return absl::InternalError(Errno("getsockname"));
  a.local_address = inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof(buf));
  a.local_port = ntohs(sa.sin_port);
  len = sizeof(sa);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return absl::InternalError(Errno("getpeername"));
  a.peer_address = inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof(buf));
  a.peer_port = ntohs(sa.sin_port);
  return a;
}

uint64_t ChunkSeed(int op, int64_t offset) { return (static_cast<uint64_t>(op) << 40) ^ static_cast<uint64_t>(offset); }

class HostTcpTransport : public Transport {
 public:
  // `listeners`: one per data NIC (one in single-address mode), already listening.
  // `multi_nic`: TcpOptions::local_addresses was set (dialing sockets bind to a local NIC).
  HostTcpTransport(const TransportConfig& config, const HostTcpLimits& limits, std::vector<Listener> listeners,
                   bool multi_nic)
      : options_(config.tcp),
        limits_(limits),
        node_id_(config.node_id.empty() ? DefaultNodeId() : config.node_id),
        instance_id_(RandomInstanceId()),
        corrupt_(config.test_corrupt_checksummed_payload),
        cpus_(config.cpus),
        multi_nic_(multi_nic),
        listeners_(std::move(listeners)),
        parking_(ParkingTable::Limits{limits.max_parked_connections, limits.max_parked_rounds_per_instance,
                                      limits.parked_timeout}),
        peer_secrets_(static_cast<size_t>(limits.max_peer_secrets)) {
    if (options_.max_send_bytes_per_s > 0) pacer_ = std::make_unique<SendPacer>(options_.max_send_bytes_per_s, Clock::Real());
    for (Listener& l : listeners_) {
      const int fd = l.fd;
      l.thread = std::thread([this, fd] { AcceptLoop(fd); });
      pthread_setname_np(l.thread.native_handle(), "wb-tcp-accept");
    }
  }

  ~HostTcpTransport() override {
    std::vector<std::shared_ptr<PeerConn>> peers;
    {
      absl::MutexLock l(&mu_);
      stopping_ = true;
      for (auto& [id, p] : peers_) {
        BreakLocked(p.get(), absl::CancelledError("transport destroyed"));
        peers.push_back(p);
      }
      parking_.CloseAll();
      accept_cv_.SignalAll();  // an acceptor-side Connect still waiting returns CANCELLED
      // Unblocks handshakes in progress now; none starts after stopping_ (AcceptLoop checks).
      for (Handshake& h : handshakes_) {
        if (h.fd >= 0) shutdown(h.fd, SHUT_RDWR);
      }
    }
    for (Listener& l : listeners_) shutdown(l.fd, SHUT_RDWR);
    for (Listener& l : listeners_) {
      l.thread.join();
      close(l.fd);
    }
    std::vector<std::thread> handshakes;
    {
      absl::MutexLock l(&mu_);
      for (Handshake& h : handshakes_) handshakes.push_back(std::move(h.thread));
    }
    for (auto& t : handshakes) t.join();  // each exits promptly: its socket is shut down
    for (auto& p : peers) {
      for (auto& t : p->threads) t.join();
      for (int fd : p->fds) close(fd);
      DropPeerQueues(p.get());
    }
  }

  Capabilities capabilities() const override {
    Capabilities c;
    c.kind = kKind;
    c.memory_kinds = {MemoryKind::kHost};
    c.same_node = true;  // works on loopback too, but host_shm is preferred there
    c.cross_node = true;
    c.two_sided = true;
    c.checksums = true;
    c.native_strides = true;
    c.cancel_batches = true;
    for (const Listener& l : listeners_) c.local_addresses.push_back(absl::StrCat(l.nic.addr, ":", l.nic.port));
    return c;
  }

  std::string instance_id() const override { return instance_id_; }

  // The bytes are for `peer` only (transport.h): when `peer` dials this transport (its instance id
  // is the smaller), they carry the secret made for it, which its connections must prove.
  absl::StatusOr<std::string> ExportEndpoint(absl::string_view peer_instance) override {
    if (peer_instance.empty()) {
      return absl::InvalidArgumentError(
          "host_tcp ExportEndpoint: no peer instance id (an endpoint is for one peer: it carries that peer's secret)");
    }
    const std::string peer(peer_instance);
    std::string secret(kPeerSecretBytes, '\0');  // we dial `peer`: it never proves a secret to us
    if (peer < instance_id_) {
      absl::MutexLock l(&mu_);
      absl::StatusOr<std::string> s = peer_secrets_.Get(peer, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return InUseLocked(); });
      if (!s.ok()) return absl::Status(s.status().code(), absl::StrCat("host_tcp ExportEndpoint: ", s.status().message()));
      secret = std::move(*s);
    }
    wire::Writer w = RecordWriter(RecordType::kEndpoint, kKind, instance_id_, node_id_);
    const Nic& first = listeners_[0].nic;
    w.Str(!multi_nic_ && !options_.advertise_address.empty() ? options_.advertise_address : first.addr);
    w.U32(first.port);
    w.U32(kSecretMagic);
    w.Str(secret);
    if (listeners_.size() > 1) {
      w.U32(kNicsMagic);
      w.U32(static_cast<uint32_t>(listeners_.size() - 1));
      for (size_t i = 1; i < listeners_.size(); ++i) {
        w.Str(listeners_[i].nic.addr);
        w.U32(listeners_[i].nic.port);
      }
    }
    return std::move(w.out());
  }

  // The (local, remote) socket addresses of every connection to `id`, [0] = control.
  absl::StatusOr<std::vector<HostTcpStreamAddresses>> StreamAddresses(PeerId id) const {
    absl::MutexLock l(&mu_);
    auto it = peers_.find(id.id);
    if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("host_tcp: unknown peer ", id.id));
    std::vector<HostTcpStreamAddresses> out;
    for (int fd : it->second->fds) {
      ASSIGN_OR_RETURN(HostTcpStreamAddresses a, SocketAddresses(fd));
      out.push_back(std::move(a));
    }
    return out;
  }

  using Transport::Connect;
  // `round_view`: the connections of this Connect are dialled (dialer) / taken (acceptor) for this
  // round only (transport.h; docs/transport.md, "host_tcp channel setup: rounds").
  absl::StatusOr<PeerId> Connect(absl::string_view endpoint, absl::string_view round_view, absl::Time deadline) override {
    if (round_view.size() > kMaxRoundBytes) {
      return absl::InvalidArgumentError(absl::StrCat("host_tcp Connect: a connection round of ", round_view.size(),
                                                     " bytes (at most ", kMaxRoundBytes, ")"));
    }
    const std::string round(round_view);
    ASSIGN_OR_RETURN(ParsedEndpoint ep, ParseEndpoint(endpoint));
    const std::string& inst = ep.instance;
    const std::string addr = ep.nics[0].addr;
    const uint32_t port = ep.nics[0].port;
    if (inst == instance_id_) return absl::InvalidArgumentError("host_tcp Connect: cannot connect to itself");
    const int total = std::max(1, options_.streams) + 1;
    {
      absl::MutexLock l(&mu_);
      if (cancelled_.Has(round)) return CancelledRounds::Error(kKind, inst, round);
    }
    std::vector<int> fds;
    if (instance_id_ < inst) {
      for (int i = 0; i < total; ++i) {
        // Control (i = 0): NIC 0 to NIC 0; data stream j = i - 1: local NIC j mod L to remote j mod R.
        const size_t j = i == 0 ? 0 : static_cast<size_t>(i - 1);
        const Nic& remote = ep.nics[j % ep.nics.size()];
        const std::string* local = multi_nic_ ? &listeners_[j % listeners_.size()].nic.addr : nullptr;
        const std::string route = local != nullptr
                                      ? absl::StrCat(" from local NIC ", *local, " to ", remote.addr, ":", remote.port)
                                      : absl::StrCat(" to ", remote.addr, ":", remote.port);
        auto fd = Dial(inst, ep.secret, local, remote, deadline, i, total, round);
        for (absl::Duration backoff = kRedialFirst; !fd.ok() && IsClosedBeforeProof(fd.status()) &&
                                                    absl::Now() + backoff < deadline;
             backoff = std::min(2 * backoff, kRedialMax)) {
          // The acceptor was busy: a short pause (ended early by CancelRound), then a fresh connection.
          if (PauseUnlessCancelled(round, absl::Now() + backoff)) break;
          auto again = Dial(inst, ep.secret, local, remote, deadline, i, total, round);
          if (again.ok() || IsClosedBeforeProof(again.status())) fd = std::move(again);
          else break;
        }
        if (!fd.ok() || RoundCancelled(round)) {
          for (int f : fds) close(f);
          // A dial that CancelRound shut down (or one that was cancelled between dials) ends CANCELLED.
          if (RoundCancelled(round)) {
            if (fd.ok()) close(*fd);
            return CancelledRounds::Error(kKind, inst, round);
          }
          if (fd.status().code() == absl::StatusCode::kUnauthenticated) {
            return absl::UnauthenticatedError(absl::StrCat("host_tcp peer ", inst, " at ", remote.addr, ":", remote.port,
                                                           " refused the data-channel authentication: ", kAuthRefused,
                                                           " (stream ", i, ": ", fd.status().message(), ")"));
          }
          // An acceptor that closes every hello unread until the deadline is busy, or runs a binary
          // from before connection rounds (it refuses this hello as malformed).
          const std::string old = IsClosedBeforeProof(fd.status()) && !round.empty()
                                      ? " (until the deadline: the acceptor is overloaded, or it runs a WeightBridge binary "
                                        "from before connection rounds, which closes a hello that carries a round unread; "
                                        "every node must run one that has them)"
                                      : "";
          return absl::Status(fd.status().code(), absl::StrCat("host_tcp connect to peer ", inst, ": stream ", i,
                                                               route, ": ", fd.status().message(), old));
        }
        fds.push_back(*fd);
      }
    } else {
      absl::MutexLock l(&mu_);
      // Only a peer this transport exported an endpoint for can prove itself (its secret): fail
      // now rather than at the deadline.
      if (peer_secrets_.Find(inst) == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            "host_tcp Connect: peer ", inst, " can never connect: this transport holds no endpoint exported for it (call "
            "ExportEndpoint(", inst, ") and hand that peer those bytes first; or it was dropped past max_peer_secrets = ",
            limits_.max_peer_secrets, ", ", peer_secrets_.evicted(), " dropped so far: export it again)"));
      }
      // While this Connect waits, connections claiming (`inst`, `round`) are taken even when the
      // park is full, and never expire; its secret is kept (InUseLocked). Connections of other
      // rounds stay parked for their own Connects.
      const ParkingTable::Key key(inst, round);
      parking_.Await(key);
      accept_cv_.SignalAll();  // HostTcpTestWaitForAcceptors
      struct Unawait {
        ParkingTable& parking;
        const ParkingTable::Key& key;
        ~Unawait() { parking.Unawait(key); }
      } unawait{parking_, key};
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || cancelled_.Has(round) || parking_.Ready(key);
      };
      while (!ready()) {
        if (accept_cv_.WaitWithDeadline(&mu_, deadline) && !ready()) {
          return absl::DeadlineExceededError(absl::StrCat("host_tcp: peer ", inst, " at ", addr, ":", port,
                                                          " did not connect before the deadline (round '",
                                                          round.substr(0, 64), "')", WhyNotConnectedLocked(inst, round)));
        }
      }
      if (stopping_) return absl::CancelledError("transport destroyed");
      if (cancelled_.Has(round)) return CancelledRounds::Error(kKind, inst, round);
      fds = parking_.Take(key);
      auth_failures_.erase(inst);
    }
    auto peer = std::make_shared<PeerConn>();
    peer->instance = inst;
    peer->fds = fds;
    // Each data stream's bytes are counted on its path (TransportStats::paths): the addresses
    // the kernel reports for the socket, i.e. the NICs it really runs over.
    std::vector<HostTcpStreamAddresses> ends(fds.size());
    for (size_t i = 1; i < fds.size(); ++i) {
      absl::StatusOr<HostTcpStreamAddresses> a = SocketAddresses(fds[i]);
      if (a.ok()) ends[i] = std::move(*a);  // else "" (a socket reset already); its stream fails soon
    }
    absl::Status pinned;
    {
      absl::MutexLock l(&mu_);
      peer->path.assign(fds.size(), 0);
      for (size_t i = 1; i < fds.size(); ++i) peer->path[i] = PathIndexLocked(inst, ends[i].local_address, ends[i].peer_address);
      peer->end_markers.resize(fds.size());
      // First on the control connection, before any MANIFEST: what this side takes (a binary from
      // before kFeatures ignores it).
      ControlFrame features{};
      features.h = Header(kFeatures, 0, kFeatureCancel, 0, 0);
      peer->control.push_back(std::move(features));
      peer->id = next_id_++;
      peers_[peer->id] = peer;
      for (size_t i = 0; i < fds.size(); ++i) {
        peer->threads.emplace_back([this, peer, i] { i == 0 ? ControlReader(peer) : DataReader(peer, i); });
        peer->threads.emplace_back([this, peer, i] { i == 0 ? ControlWriter(peer) : DataWriter(peer, i); });
      }
      // Named for `top -H` / the affinity test; pinned to TransportConfig::cpus (the threads wait
      // for mu_, held here, before they touch any data).
      for (size_t t = 0; t < peer->threads.size(); ++t) {
        pthread_setname_np(peer->threads[t].native_handle(), t < 2 ? "wb-tcp-ctl" : "wb-tcp-data");
        if (pinned.ok()) pinned = PinThread(peer->threads[t], cpus_);
      }
      if (!pinned.ok()) {
        peers_.erase(peer->id);
        BreakLocked(peer.get(), absl::CancelledError("stream threads could not be pinned"));
      }
    }
    if (!pinned.ok()) {
      // Validated at creation; only a cpuset shrunk since then gets here.
      for (auto& t : peer->threads) t.join();
      for (int fd : peer->fds) close(fd);
      DropPeerQueues(peer.get());
      return absl::Status(pinned.code(), absl::StrCat("host_tcp peer ", inst, ": cpus ", FormatCpuList(cpus_), ": ",
                                                      pinned.message()));
    }
    return PeerId{peer->id};
  }

  // Wakes this round's acceptor-side Connects (they check cancelled_ under mu_), shuts down the
  // sockets its dialer-side Connects are dialling (their blocking connect / handshake returns at
  // once) and closes what is parked for it; later hellos of it are refused before the handshake.
  absl::Status CancelRound(absl::string_view round_view) override {
    RETURN_IF_ERROR(CancelledRounds::Check(kKind, round_view));
    const std::string round(round_view);
    absl::MutexLock l(&mu_);
    cancelled_.Add(round);
    parking_.CloseRound(round);
    for (auto [it, end] = dialing_.equal_range(round); it != end; ++it) shutdown(it->second, SHUT_RDWR);
    accept_cv_.SignalAll();
    return absl::OkStatus();
  }

  absl::Status Disconnect(PeerId id) override {
    std::shared_ptr<PeerConn> p;
    {
      absl::MutexLock l(&mu_);
      auto it = peers_.find(id.id);
      if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("host_tcp: unknown peer ", id.id));
      p = it->second;
      peers_.erase(it);
      BreakLocked(p.get(), absl::CancelledError("peer disconnected"));
    }
    for (auto& t : p->threads) t.join();
    for (int fd : p->fds) close(fd);
    DropPeerQueues(p.get());
    return absl::OkStatus();
  }

  absl::StatusOr<RegionHandle> RegisterMemory(const MemorySpec& spec) override {
    if (spec.kind != MemoryKind::kHost) {
      return absl::InvalidArgumentError(absl::StrCat("host_tcp cannot reach ", MemoryKindName(spec.kind),
                                                     " memory (region '", spec.label, "')"));
    }
    if (spec.size_bytes < 0 || (spec.base == nullptr && spec.size_bytes > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("host_tcp: bad region '", spec.label, "'"));
    }
    Region r;
    r.local = true;
    r.base = static_cast<char*>(spec.base);
    r.size = spec.size_bytes;
    r.label = spec.label;
    r.owner_instance = instance_id_;
    absl::MutexLock l(&mu_);
    uint64_t id = next_id_++;
    r.owner_region_id = id;
    regions_.Add(id, std::move(r));
    return RegionHandle{id};
  }

  absl::StatusOr<std::string> ExportDescriptor(RegionHandle h) override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(const Region* r, regions_.Find(h));
    if (!r->local) return absl::FailedPreconditionError("host_tcp: cannot re-export an imported region");
    return EncodePlainDescriptor(kKind, {instance_id_, node_id_, h.id, r->size, r->label});
  }

  absl::StatusOr<RegionHandle> ImportDescriptor(absl::string_view bytes) override {
    ASSIGN_OR_RETURN(PlainDescriptor d, DecodePlainDescriptor(kKind, bytes));
    Region r;
    r.local = false;
    r.size = d.size;
    r.label = std::move(d.label);
    r.owner_instance = std::move(d.instance);
    r.owner_region_id = d.region_id;
    absl::MutexLock l(&mu_);
    uint64_t id = next_id_++;
    regions_.Add(id, std::move(r));
    return RegionHandle{id};
  }

  absl::StatusOr<RegionInfo> Describe(RegionHandle h) const override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(const Region* r, regions_.Find(h));
    RegionInfo info = BasicRegionInfo(*r);
    for (auto& [pid, p] : peers_) {
      if (!info.local && p->instance == r->owner_instance) info.peer = PeerId{pid};
    }
    return info;
  }

  absl::Status Release(RegionHandle h) override {
    absl::MutexLock l(&mu_);
    return regions_.Release(h);
  }

  absl::StatusOr<BatchId> Post(const Batch& batch) override {
    auto b = std::make_shared<TcpBatch>();
    b->tag = batch.tag;
    b->group = batch.group;
    b->checksum = batch.checksum;
    b->corrupt_once = batch.checksum && corrupt_;
    absl::MutexLock l(&mu_);
    if (batch.group != 0 && cancelled_groups_.Has(absl::StrCat(batch.group))) {
      return absl::CancelledError(absl::StrCat("host_tcp batch ", batch.tag, ": its group ", batch.group,
                                               " was cancelled (CancelBatches)"));
    }
    auto pit = peers_.find(batch.peer.id);
    if (pit == peers_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("host_tcp batch ", batch.tag, ": unknown peer ", batch.peer.id,
                                                     " (two-sided transport: Batch::peer is required)"));
    }
    std::shared_ptr<PeerConn> peer = pit->second;
    if (peer->broken) {
      return absl::UnavailableError(absl::StrCat("host_tcp peer ", peer->instance,
                                                 " is disconnected: ", peer->broken_status.message()));
    }
    if (peer->batches.count(batch.tag)) {
      return absl::InvalidArgumentError(absl::StrCat("host_tcp: batch tag ", batch.tag, " already in flight"));
    }
    const std::string tag_key = absl::StrCat(batch.tag);
    if (peer->cancelling.count(batch.tag) > 0 || peer->peer_cancelled->Has(tag_key)) {
      peer->peer_cancelled->Remove(tag_key);  // once: the mirror of that one batch
      return absl::CancelledError(absl::StrCat("host_tcp batch ", batch.tag, ": peer ", peer->instance,
                                               " cancelled its mirror (CancelBatches there)"));
    }
    // Which instance sends is part of the manifest so that both sides hash the same bytes.
    wire::Writer m;
    m.U64(batch.tag);
    m.U8(batch.checksum);
    const std::string prefix = absl::StrCat("host_tcp batch ", batch.tag);
    for (size_t i = 0; i < batch.ops.size(); ++i) {
      const CopyOp& op = batch.ops[i];
      auto src = regions_.FindForOp(op.src.region, prefix, i, "source");
      if (!src.ok()) return src.status();
      auto dst = regions_.FindForOp(op.dst.region, prefix, i, "destination");
      if (!dst.ok()) return dst.status();
      auto is_send = TwoSidedOpIsSend(**src, **dst, prefix, i, peer->instance);
      if (!is_send.ok()) return is_send.status();
      auto layout = ValidateOp(op, static_cast<int>(i), (*src)->size, (*dst)->size, (*src)->label, (*dst)->label);
      if (!layout.ok()) return layout.status();
      const bool send = *is_send;
      b->is_send.push_back(send);
      b->local_base.push_back(send ? (*src)->base : (*dst)->base);
      b->layouts.push_back(std::move(*layout));
      b->regions.push_back(op.src.region.id);
      b->regions.push_back(op.dst.region.id);
      m.Str(send ? instance_id_ : peer->instance);
      m.U64((*src)->owner_region_id);
      m.U64((*dst)->owner_region_id);
      m.I64(op.src.offset_bytes);
      m.I64(op.dst.offset_bytes);
      m.U32(op.element_size);
      for (auto d : op.shape) m.I64(d);
      for (auto s : op.src.strides) m.I64(s);
      for (auto s : op.dst.strides) m.I64(s);
    }
    b->manifest = XXH3_64bits(m.out().data(), m.out().size());
    const int64_t chunk = std::max<int64_t>(options_.chunk_bytes, 4096);
    if (batch.unit_hashes != nullptr) {
      b->unit_hashes = batch.unit_hashes;
      UnitHashes& uh = *b->unit_hashes;
      uh.hashes.assign(b->layouts.size(), {});
      uh.complete.assign(b->layouts.size(), 0);
      b->unit.assign(b->layouts.size(), 0);
      b->units_done.assign(b->layouts.size(), 0);
      for (size_t i = 0; i < b->layouts.size() && i < uh.unit_bytes.size(); ++i) {
        const int64_t u = uh.unit_bytes[i], n = b->layouts[i].src.total_bytes();
        if (u <= 0) continue;
        b->unit[i] = u;
        uh.hashes[i].assign(static_cast<size_t>((n + u - 1) / u), 0);
        uh.complete[i] = n == 0 ? 1 : 0;
      }
    }
    b->recv_ranges.resize(b->layouts.size());
    for (size_t i = 0; i < b->layouts.size(); ++i) {
      const int64_t n = b->layouts[i].src.total_bytes();
      b->bytes += n;
      if (!b->is_send[i]) {
        b->recv_expected += n;
        continue;
      }
      // A hashed op's frames hold whole units, so the receiver can hash each frame on its own.
      const int64_t u = b->unit.empty() ? 0 : b->unit[i];
      const int64_t step = u <= 0 ? chunk : std::max<int64_t>(1, chunk / u) * u;
      for (int64_t off = 0; off < n; off += step) b->chunks.push_back({static_cast<int>(i), off, std::min(step, n - off)});
    }
    regions_.Pin(b->regions);
    b->id = next_id_++;
    b->peer = peer;
    stats_.batches_posted++;
    batches_.Add(b);
    peer->batches[b->tag] = b;
    ControlFrame f{};
    f.h = Header(kManifest, b->tag, 0, static_cast<int64_t>(b->manifest), 0);
    peer->control.push_back(std::move(f));
    if (auto e = peer->early_manifest.find(b->tag); e != peer->early_manifest.end()) {
      OnManifestLocked(peer.get(), b.get(), e->second);
      peer->early_manifest.erase(e);
    }
    if (auto e = peer->early_checksum.find(b->tag); e != peer->early_checksum.end()) {
      b->peer_checksum_known = true;
      b->peer_checksum = e->second;
      peer->early_checksum.erase(e);
    }
    if (auto e = peer->early_ack.find(b->tag); e != peer->early_ack.end()) {
      OnAckLocked(b.get(), e->second);
      peer->early_ack.erase(e);
    }
    if (!b->chunks.empty() && b->status.ok()) peer->send_queue.push_back(b);
    MaybeFinishRecvLocked(peer.get(), b.get());
    cv_.SignalAll();  // writers wait for the manifest and the chunks
    return BatchId{b->id};
  }

  absl::StatusOr<BatchState> Poll(BatchId id) override {
    absl::MutexLock l(&mu_);
    return batches_.Poll(id, [](const TcpBatch* b) { return b->Finished(); });
  }

  absl::Status Wait(BatchId id, absl::Time deadline) override {
    absl::MutexLock l(&mu_);
    ASSIGN_OR_RETURN(std::shared_ptr<TcpBatch> b, batches_.Find(id));
    while (!b->Finished()) {
      if (cv_.WaitWithDeadline(&mu_, deadline) && !b->Finished()) {
        const absl::Status why = absl::DeadlineExceededError(absl::StrCat(
            "host_tcp batch ", b->tag, " with peer ", b->peer->instance, " missed its deadline (", b->recv_got, "/",
            b->recv_expected, " bytes received, ", b->chunks_written, "/", b->chunks.size(), " chunks sent)"));
        FailLocked(b.get(), why);
        // Closing the sockets unblocks the threads inside send/recv for this batch: bounded.
        BreakLocked(b->peer.get(), absl::UnavailableError(absl::StrCat("channel closed after batch ", b->tag,
                                                                       " missed its deadline")));
        while (b->active > 0) cv_.Wait(&mu_);
      }
    }
    regions_.Unpin(b->regions);
    if (auto pit = b->peer->batches.find(b->tag); pit != b->peer->batches.end() && pit->second == b) {
      b->peer->batches.erase(pit);
    }
    batches_.Retire(id.id);
    if (!b->status.ok()) stats_.batches_failed++;
    return b->status;
  }

  // Every unfinished batch of `group` ends CANCELLED; the peer is told (kCancel) and both sides
  // drop what of it is still on the wire, so the channel and its other batches go on. A peer from
  // before kCancel: its channel is closed instead (the old way a batch could end early).
  absl::Status CancelBatches(uint64_t group, absl::string_view why) override {
    if (group == 0) return absl::InvalidArgumentError("host_tcp CancelBatches: group 0 names no group (batches without one)");
    absl::MutexLock l(&mu_);
    cancelled_groups_.Add(absl::StrCat(group));
    for (auto& [id, p] : peers_) {
      if (p->broken) continue;  // its batches failed already
      std::vector<std::shared_ptr<TcpBatch>> mine;
      for (auto& [tag, b] : p->batches) {
        if (b->group == group && b->status.ok() && !b->Succeeded()) mine.push_back(b);
      }
      for (const std::shared_ptr<TcpBatch>& b : mine) {
        const absl::Status st = absl::CancelledError(
            absl::StrCat("host_tcp batch ", b->tag, " with peer ", p->instance, " cancelled: ", why));
        if (!p->features_known) {
          p->pending_cancels.push_back({b->tag, st});
        } else {
          CancelOrBreakLocked(p.get(), b->tag, st);
        }
      }
    }
    cv_.SignalAll();
    return absl::OkStatus();
  }

  TransportStats stats() const override {
    // The bounds' counts (Counters() takes mu_ itself), as TransportStats::guards for the daemon's
    // wb_transport_guard_* metrics.
    const HostTcpCounters c = Counters();
    absl::MutexLock l(&mu_);
    TransportStats s = stats_;
    s.guards = {{"hellos_refused", c.hellos_refused, true},
                {"hellos_unknown_instance", c.hellos_unknown_instance, true},
                {"hellos_without_round", c.hellos_without_round, true},
                {"parked_refused", c.parked_refused, true},
                {"parked_expired", c.parked_expired, true},
                {"parked_superseded", c.parked_superseded, true},
                {"parked_cancelled", c.parked_cancelled, true},
                {"early_overflows", c.early_overflows, true},
                {"peer_secrets_evicted", c.peer_secrets_evicted, true},
                {"parked_connections", c.parked_connections, false},
                {"early_control_frames", c.early_control_frames, false},
                {"peer_secrets", c.peer_secrets, false}};
    return s;
  }

  // TEST ONLY (HostTcpTestWaitForAcceptors).
  bool WaitForAcceptors(const std::string& inst, int n, absl::Time deadline) {
    absl::MutexLock l(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return parking_.AwaitedFor(inst) >= n; };
    while (!enough()) {
      if (accept_cv_.WaitWithDeadline(&mu_, deadline)) return enough();
    }
    return true;
  }

  // TEST ONLY (HostTcpTestWaitForParked).
  bool WaitForParked(const ParkingTable::Key& key, int n, absl::Time deadline) {
    absl::MutexLock l(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return parking_.ParkedFor(key) >= n; };
    while (!enough()) {
      if (accept_cv_.WaitWithDeadline(&mu_, deadline)) return enough();
    }
    return true;
  }

  // TEST ONLY (HostTcpTestFlipNextReceived).
  void TestFlipNextReceived() { test_flip_next_received_ = true; }

  HostTcpCounters Counters() const {
    absl::MutexLock l(&mu_);
    HostTcpCounters c;
    const ParkingTable::Counters& p = parking_.counters();
    c.parked_connections = p.parked;
    c.parked_refused = p.refused;
    c.parked_expired = p.expired;
    c.parked_hung_up = p.hung_up;
    c.parked_superseded = p.superseded;
    c.parked_cancelled = p.cancelled;
    c.hellos_refused = hellos_refused_;
    c.hellos_without_round = hellos_without_round_;
    c.hellos_unknown_instance = hellos_unknown_instance_;
    c.peer_secrets = static_cast<int64_t>(peer_secrets_.size());
    c.peer_secrets_evicted = peer_secrets_.evicted();
    for (const auto& [id, p] : peers_) c.early_control_frames += p->early_frames();
    c.early_overflows = early_overflows_;
    return c;
  }

 private:
  bool RoundCancelled(const std::string& round) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    return cancelled_.Has(round);
  }

  // A dialer's pause between redials: true (at once) when `round` is or gets cancelled before `until`.
  bool PauseUnlessCancelled(const std::string& round, absl::Time until) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    while (!cancelled_.Has(round) && !stopping_) {
      if (accept_cv_.WaitWithDeadline(&mu_, until)) break;
    }
    return cancelled_.Has(round);
  }

  // A socket a dialer-side Connect of `round` is dialling, known to CancelRound (which shuts it down)
  // from socket() until it is handed out or closed; Release() hands it out.
  class DialingFd {
   public:
    DialingFd(HostTcpTransport* t, std::string round, int fd) : t_(t), round_(std::move(round)), fd_(fd) {}
    ~DialingFd() {
      if (fd_ >= 0) close(Release());
    }
    DialingFd(const DialingFd&) = delete;
    DialingFd& operator=(const DialingFd&) = delete;
    // False (the round is cancelled): not tracked.
    bool Track() {
      absl::MutexLock l(&t_->mu_);
      if (t_->cancelled_.Has(round_)) return false;
      t_->dialing_.emplace(round_, fd_);
      tracked_ = true;
      return true;
    }
    // Untracked under mu_ before the caller may close it, so CancelRound never shuts down a reused fd number.
    int Release() {
      if (tracked_) {
        absl::MutexLock l(&t_->mu_);
        for (auto [it, end] = t_->dialing_.equal_range(round_); it != end; ++it) {
          if (it->second == fd_) {
            t_->dialing_.erase(it);
            break;
          }
        }
        tracked_ = false;
      }
      const int fd = fd_;
      fd_ = -1;
      return fd;
    }
    int fd() const { return fd_; }

   private:
    HostTcpTransport* t_;
    std::string round_;
    int fd_;
    bool tracked_ = false;
  };

  // Peer instances whose secrets must stay (PeerSecrets' eviction): a channel (even a broken one
  // not yet disconnected), parked connections, or a Connect waiting for them.
  std::set<std::string> InUseLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::set<std::string> keep;
    for (const auto& [id, p] : peers_) keep.insert(p->instance);
    parking_.InstancesInUse(keep);
    return keep;
  }

  // What an acceptor-side Connect for (inst, round) that missed its deadline says about why.
  std::string WhyNotConnectedLocked(const std::string& inst, const std::string& round) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::string why;
    size_t more = 0;
    const std::vector<std::pair<std::string, int>> others = parking_.OtherRounds(inst, round, 4, &more);
    if (!others.empty()) {
      absl::StrAppend(&why, "; connections from this instance are parked for other rounds, never this one's (");
      for (size_t i = 0; i < others.size(); ++i) {
        absl::StrAppend(&why, i > 0 ? ", " : "", "'", others[i].first.substr(0, 64), "': ", others[i].second);
      }
      absl::StrAppend(&why, more > 0 ? absl::StrCat(" and ", more, " more round(s)") : "",
                      "): both sides must pass the same round");
    }
    if (auto it = auth_failures_.find(inst); it != auth_failures_.end()) {
      absl::StrAppend(&why, "; ", it->second, " connection(s) claiming this instance failed authentication (",
                      kAuthRefused, ")");
    }
    if (busy_refusals_ > 0) {
      absl::StrAppend(&why, "; ", busy_refusals_, " unauthenticated connection(s) were closed unread since this ",
                      "transport started (more than ", kMaxHandshakesPerSource, " in handshake from one address or ",
                      kMaxConcurrentHandshakes, " in all; last from ", last_busy_source_, ")");
    }
    if (const int64_t refused = parking_.counters().refused; refused > 0) {
      absl::StrAppend(&why, "; ", refused, " connection(s) were closed before authentication since this ",
                      "transport started because ", limits_.max_parked_connections,
                      " authenticated connections were already parked unclaimed (last claiming ",
                      parking_.last_refused_instance(), ")");
    }
    return why;
  }

  // The entry of stats_.paths for (peer instance, local address, remote address), added if new.
  size_t PathIndexLocked(const std::string& inst, const std::string& local, const std::string& remote)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (size_t i = 0; i < stats_.paths.size(); ++i) {
      const PathStats& p = stats_.paths[i];
      if (p.peer_instance == inst && p.local_address == local && p.remote_address == remote) return i;
    }
    PathStats p;
    p.peer_instance = inst;
    p.local_address = local;
    p.remote_address = remote;
    stats_.paths.push_back(std::move(p));
    return stats_.paths.size() - 1;
  }

  // A TcpBatch holds its PeerConn and the PeerConn's queues hold TcpBatches: a batch that failed
  // with chunks still queued (peer broken), or one never retired, forms a shared_ptr cycle. Once
  // the peer's threads are joined nothing reads these queues again, so empty them to break it.
  void DropPeerQueues(PeerConn* p) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    p->send_queue.clear();
    p->batches.clear();
    p->control.clear();
  }

  static FrameHeader Header(uint8_t type, uint64_t tag, uint32_t op, int64_t offset, int64_t len) {
    FrameHeader h{};
    h.magic = kFrameMagic;
    h.type = type;
    h.tag = tag;
    h.op = op;
    h.offset = offset;
    h.len = len;
    return h;
  }

  // One connection to the acceptor `inst`: TCP connect, hello (who we are, which stream), then the
  // channel authentication (bound to the hello). The fd is handed out only after both succeed.
  // `local`: the NIC address the socket binds to before connecting (multi-NIC), or nullptr (the
  // kernel picks the source address).
  // `secret`: the one in the acceptor's endpoint, made by it for us.
  // `round`: sent in the hello, so bound into both MACs with it (an on-path rewrite of the round
  // fails the handshake on both sides).
  absl::StatusOr<int> Dial(const std::string& inst, const std::string& secret, const std::string* local,
                           const Nic& remote, absl::Time deadline, int idx, int total, const std::string& round) {
    const std::string& addr = remote.addr;
    const int raw = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (raw < 0) return absl::InternalError(Errno("socket"));
    DialingFd dialing(this, round, raw);  // closes it on every error return below
    const int fd = dialing.fd();
    // CancelRound shuts this socket down from here on, so a blocking connect or handshake ends.
    if (!dialing.Track()) return CancelledRounds::Error(kKind, inst, round);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(remote.port);
    if (inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) {
      return absl::InvalidArgumentError(absl::StrCat("bad IPv4 address '", addr, "'"));
    }
    if (local != nullptr) {
      // Binding the source address makes the bytes leave through that NIC wherever routing is by
      // source (NICs on their own subnets, or source-based policy routing): see docs/transport.md.
      sockaddr_in la{};
      la.sin_family = AF_INET;
      la.sin_port = 0;
      if (inet_pton(AF_INET, local->c_str(), &la.sin_addr) != 1 ||
          bind(fd, reinterpret_cast<sockaddr*>(&la), sizeof(la)) != 0) {
        return absl::UnavailableError(Errno(absl::StrCat("bind to local NIC ", *local).c_str()));
      }
    }
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 && errno != EINPROGRESS) {
      return absl::UnavailableError(Errno("connect"));
    }
    struct pollfd pfd = {fd, POLLOUT, 0};
    int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (poll(&pfd, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30))) != 1) {
      return absl::DeadlineExceededError("connect did not complete before the Connect deadline (address unreachable?)");
    }
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return absl::UnavailableError(absl::StrCat("connect: ", std::strerror(err)));
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    wire::Writer w;
    w.U32(round.empty() ? kFrameMagic : kHelloMagic);
    w.Str(instance_id_);
    w.U32(idx);
    w.U32(total);
    if (!round.empty()) w.Str(round);
    uint32_t n = w.out().size();
    struct iovec iov[2] = {{&n, 4}, {w.out().data(), n}};
    if (!WriteAll(fd, iov, 2)) return absl::UnavailableError(Errno("hello"));
    ChannelAuthParams auth;
    auth.key = options_.auth_token;
    auth.peer_secret = secret;
    auth.self = instance_id_;
    auth.peer = inst;
    auth.context = w.out();
    auth.deadline = deadline;
    RETURN_IF_ERROR(AuthenticateDialer(fd, auth));
    return dialing.Release();
  }

  // Accepts connections and hands each to its own handshake thread, so a slow or silent dialer
  // delays nobody else; finished handshake threads are joined here as new connections arrive.
  void AcceptLoop(int listen_fd) {
    while (true) {
      sockaddr_in from{};
      socklen_t from_len = sizeof(from);
      int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
          // Out of fds/memory: keep the loop alive (the pending connection stays queued; a
          // handshake finishing frees one), but do not spin.
          absl::SleepFor(absl::Milliseconds(50));
          continue;
        }
        return;  // listen socket shut down
      }
      char addr_buf[INET_ADDRSTRLEN] = "?";
      inet_ntop(AF_INET, &from.sin_addr, addr_buf, sizeof(addr_buf));
      const std::string source = addr_buf;
      std::vector<std::thread> finished;
      {
        absl::MutexLock l(&mu_);
        for (auto it = handshakes_.begin(); it != handshakes_.end();) {
          if (it->done) {
            finished.push_back(std::move(it->thread));
            it = handshakes_.erase(it);
          } else {
            ++it;
          }
        }
        int& mine = handshakes_by_source_[source];
        const bool admit = !stopping_ && mine < kMaxHandshakesPerSource &&
                           (active_handshakes_ < kMaxConcurrentHandshakes || EvictHandshakeForLocked(mine));
        if (!admit) {
          if (mine == 0) handshakes_by_source_.erase(source);
          close(fd);  // stopping, or flooded: the dialer is told "closed before proving" and retries
          if (!stopping_) {
            ++busy_refusals_;
            last_busy_source_ = source;
          }
        } else {
          ++mine;
          ++active_handshakes_;
          handshakes_.emplace_back();
          auto it = std::prev(handshakes_.end());
          it->fd = fd;
          it->source = source;
          // Holds mu_ until the thread is stored: the thread only touches `it` under mu_.
          it->thread = std::thread([this, it, fd] { AcceptHandshake(it, fd); });
        }
      }
      for (auto& t : finished) t.join();
    }
  }

  struct Handshake {
    int fd = -1;  // -1 once handed to parking_ or closed (under mu_): never shut down a reused number
    bool done = false;
    bool counted = true;  // still counted in handshakes_by_source_ / active_handshakes_
    std::string source;   // the dialer's address
    std::thread thread;
  };

  void UncountLocked(Handshake& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!h.counted) return;
    h.counted = false;
    --active_handshakes_;
    auto it = handshakes_by_source_.find(h.source);
    if (it != handshakes_by_source_.end() && --it->second <= 0) handshakes_by_source_.erase(it);
  }

  // All handshake slots are taken: close the oldest handshake of the address holding the most,
  // if it holds more than the newcomer's (`mine`). Its thread sees the shutdown and exits.
  bool EvictHandshakeForLocked(int mine) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string* heaviest = nullptr;
    int most = mine;
    for (const auto& [src, n] : handshakes_by_source_) {
      if (n > most) {
        most = n;
        heaviest = &src;
      }
    }
    if (heaviest == nullptr) return false;
    for (Handshake& h : handshakes_) {
      if (h.counted && h.fd >= 0 && h.source == *heaviest) {
        shutdown(h.fd, SHUT_RDWR);
        ++busy_refusals_;
        last_busy_source_ = h.source;
        UncountLocked(h);
        return true;
      }
    }
    return false;
  }

  // Hello, then channel authentication, all by kAcceptHandshakeTimeout. An authenticated
  // connection goes to parking_ under its (instance, round) (a Connect of that round picks it up); any other is closed, and if it named an
  // instance, counted against that instance for Connect's error message.
  void AcceptHandshake(std::list<Handshake>::iterator self, int fd) {
    const absl::Time deadline = absl::Now() + kAcceptHandshakeTimeout;
    uint32_t n = 0;
    std::string hello;
    bool ok = ReadAllBy(fd, &n, 4, deadline) && n < 4096;
    if (ok) {
      hello.resize(n);
      ok = ReadAllBy(fd, hello.data(), n, deadline);
    }
    const bool read = ok;  // a whole hello arrived (what it says is checked below)
    wire::Reader r(hello);
    uint32_t magic = r.U32();
    std::string inst = r.Str();
    uint32_t idx = r.U32(), total = r.U32();
    // The empty round's hello (also a binary's from before connection rounds): {kFrameMagic, id,
    // index, count}, nothing after. A non-empty round's: kHelloMagic, then the round (never empty:
    // one encoding per round).
    const bool empty_round = ok && magic == kFrameMagic && r.done();
    std::string round;
    if (!empty_round) {
      round = r.Str(kMaxRoundBytes);
      ok = ok && magic == kHelloMagic && !round.empty();
    }
    // Only a smaller instance dials this one (Connect), so a hello claiming an instance that is
    // not smaller could never be claimed: refused like a malformed one.
    ok = ok && r.done() && total >= 2 && total <= static_cast<uint32_t>(kMaxStreams) + 1 && idx < total &&
         inst < instance_id_;
    // A place in the park is reserved before the handshake, so that a dialer that would find it
    // full is closed before proving itself (it redials) rather than after its Connect succeeded.
    bool reserved = false;
    std::string secret;  // the one exported for `inst`
    if (read) {
      absl::MutexLock l(&mu_);
      const std::string* held = ok ? peer_secrets_.Find(inst) : nullptr;
      if (ok && empty_round) ++hellos_without_round_;
      if (!ok) {
        ++hellos_refused_;
      } else if (held == nullptr) {
        // No endpoint was exported for this instance (or its secret was dropped past the bound):
        // it cannot prove itself, and nothing is parked or counted per instance for it.
        ok = false;
        ++hellos_unknown_instance_;
      } else if (cancelled_.Has(round)) {
        // Its Connect here ended (CancelRound): nothing would ever take it.
        ok = false;
        parking_.RefuseCancelled();
      } else {
        secret = *held;
        ok = parking_.Admit({inst, round}, absl::Now(), &reserved);
      }
    }
    bool authenticated = false;
    if (ok) {
      ChannelAuthParams auth;
      auth.key = options_.auth_token;
      auth.peer_secret = secret;
      auth.self = instance_id_;
      auth.peer = inst;
      auth.context = hello;
      auth.deadline = deadline;
      authenticated = AuthenticateAcceptor(fd, auth).ok();
    }
    if (authenticated) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    absl::MutexLock l(&mu_);
    if (reserved) parking_.Unreserve();
    if (authenticated && !stopping_ && cancelled_.Has(round)) {
      close(fd);  // cancelled during its handshake
      parking_.RefuseCancelled();
    } else if (authenticated && !stopping_) {
      parking_.Park({inst, round}, idx, static_cast<int>(total), fd, absl::Now());
    } else {
      close(fd);
      if (ok && !stopping_ && (auth_failures_.count(inst) || auth_failures_.size() < kMaxAuthFailureIds)) {
        auth_failures_[inst]++;
      }
    }
    self->fd = -1;
    self->done = true;
    UncountLocked(*self);
    accept_cv_.SignalAll();
  }

  // A failed batch starts no further chunk: its queued send chunks are dropped here, and the
  // chunks already taken by a writer are counted in `active`, which Finished() waits out. So once
  // Wait retires it, no thread touches its memory again (transport.h).
  void FailLocked(TcpBatch* b, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (b->status.ok() && !b->Succeeded()) b->status = std::move(why);
    if (!b->status.ok() && b->peer != nullptr) {
      auto& q = b->peer->send_queue;
      q.erase(std::remove_if(q.begin(), q.end(), [b](const std::shared_ptr<TcpBatch>& x) { return x.get() == b; }),
              q.end());
    }
    cv_.SignalAll();
  }

  void BreakLocked(PeerConn* p, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!p->broken) {
      p->broken = true;
      p->broken_status = why;
      for (int fd : p->fds) shutdown(fd, SHUT_RDWR);
    }
    // Nothing posts on a broken channel (Post refuses it): what the peer sent early is dropped.
    p->early_manifest.clear();
    p->early_checksum.clear();
    p->early_ack.clear();
    for (auto& [tag, b] : p->batches) FailLocked(b.get(), why);
    cv_.SignalAll();
  }

  // Batch `tag` of `p` is being cancelled (our CancelBatches, the peer's kCancel or kCancelEnd). The
  // first time: our kCancel goes out, each data writer sends kCancelEnd after its current chunk, the
  // batch fails with `why` (its queued chunks dropped) or, not posted here yet, its later Post fails,
  // and what the peer sent early for it is dropped.
  // `from_peer`: the peer cancelled it (its kCancel, or `cancel_frame` false: its kCancelEnd).
  void CancelTagLocked(PeerConn* p, uint64_t tag, bool from_peer, const absl::Status& why, bool cancel_frame = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto [it, fresh] = p->cancelling.try_emplace(tag);
    PeerConn::Cancelling& c = it->second;
    if (from_peer && cancel_frame) c.peer_cancel_seen = true;
    if (fresh) {
      c.peer_ended.assign(p->fds.size(), false);
      ControlFrame f{};
      f.h = Header(kCancel, tag, 0, 0, 0);
      p->control.push_back(std::move(f));
      for (size_t i = 1; i < p->end_markers.size(); ++i) p->end_markers[i].push_back(tag);
      p->early_manifest.erase(tag);
      p->early_checksum.erase(tag);
      p->early_ack.erase(tag);
      auto b = p->batches.find(tag);
      if (b != p->batches.end()) {
        FailLocked(b->second.get(), why);
      } else if (from_peer) {
        p->peer_cancelled->Add(absl::StrCat(tag));
      }
    }
    MaybeEndCancelLocked(p, tag);
    cv_.SignalAll();
  }

  // Our cancel of batch `tag`: told to a peer that takes it; a peer from before kCancel has the
  // channel closed instead (the batch still ends with `why`, its other batches fail).
  void CancelOrBreakLocked(PeerConn* p, uint64_t tag, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (p->broken) return;
    if (p->peer_can_cancel) {
      CancelTagLocked(p, tag, /*from_peer=*/false, why);
      return;
    }
    if (auto b = p->batches.find(tag); b != p->batches.end()) FailLocked(b->second.get(), why);
    BreakLocked(p, absl::UnavailableError(absl::StrCat("channel closed: batch ", tag, " was cancelled and peer ", p->instance,
                                                       " runs a build that cannot take a cancel (its other batches fail)")));
  }

  // The peer's kCancelEnd for `tag` on data connection `stream`.
  void OnCancelEndLocked(PeerConn* p, size_t stream, uint64_t tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (p->cancelling.count(tag) == 0) {
      // The peer cancelled it and its kCancel has not come yet (another connection).
      CancelTagLocked(p, tag, /*from_peer=*/true,
                      absl::CancelledError(absl::StrCat("host_tcp batch ", tag, ": peer ", p->instance, " cancelled it")),
                      /*cancel_frame=*/false);
    }
    PeerConn::Cancelling& c = p->cancelling[tag];
    if (stream < c.peer_ended.size() && !c.peer_ended[stream]) {
      c.peer_ended[stream] = true;
      ++c.ended;
    }
    MaybeEndCancelLocked(p, tag);
  }

  void MaybeEndCancelLocked(PeerConn* p, uint64_t tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = p->cancelling.find(tag);
    if (it == p->cancelling.end()) return;
    const int data_streams = static_cast<int>(p->fds.size()) - 1;
    if (it->second.peer_cancel_seen && it->second.ended >= data_streams) p->cancelling.erase(it);
  }

  void OnManifestLocked(PeerConn* p, TcpBatch* b, uint64_t theirs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (theirs == b->manifest) {
      b->manifest_matched = true;
      MaybeFinishRecvLocked(p, b);
    } else {
      FailLocked(b, absl::InvalidArgumentError(absl::StrCat(
                        "host_tcp batch ", b->tag, ": the peer ", p->instance,
                        " posted a different mirror batch (ops, regions, offsets, strides or checksum flag differ)")));
      BreakLocked(p, absl::UnavailableError(absl::StrCat("channel closed after mirror mismatch in batch ", b->tag)));
    }
    cv_.SignalAll();
  }

  void OnAckLocked(TcpBatch* b, const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    b->ack_received = true;
    if (!s.ok()) FailLocked(b, s);
    cv_.SignalAll();
  }

  void MaybeFinishRecvLocked(PeerConn* p, TcpBatch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (b->recv_done || !b->status.ok() || !b->manifest_matched) return;
    if (b->recv_got < b->recv_expected) return;
    if (b->checksum && b->recv_expected > 0 && !b->peer_checksum_known) return;
    absl::Status result;
    if (b->checksum && b->recv_expected > 0 && b->recv_hash != b->peer_checksum) {
      result = absl::DataLossError(absl::StrCat("host_tcp batch ", b->tag, ": checksum mismatch on ", b->recv_expected,
                                                " bytes received from peer ", p->instance));
      FailLocked(b, result);  // before recv_done: a batch that already counts as succeeded cannot fail
    }
    b->recv_done = true;
    ControlFrame f{};
    std::string msg(result.message());
    f.h = Header(kAck, b->tag, static_cast<uint32_t>(result.code()), 0, msg.size());
    f.payload = std::move(msg);
    p->control.push_back(std::move(f));
    cv_.SignalAll();
  }

  void ControlWriter(std::shared_ptr<PeerConn> p) {
    const int fd = p->fds[0];
    absl::MutexLock l(&mu_);
    while (true) {
      while (!p->broken && p->control.empty()) cv_.Wait(&mu_);
      if (p->broken) return;
      ControlFrame f = std::move(p->control.front());
      p->control.pop_front();
      mu_.Unlock();
      struct iovec iov[2] = {{&f.h, sizeof(f.h)}, {f.payload.data(), f.payload.size()}};
      bool ok = WriteAll(fd, iov, f.payload.empty() ? 1 : 2);
      mu_.Lock();
      if (!ok) {
        BreakLocked(p.get(), absl::UnavailableError(absl::StrCat("host_tcp peer ", p->instance, ": ", Errno("send"))));
        return;
      }
    }
  }

  void ControlReader(std::shared_ptr<PeerConn> p) {
    const int fd = p->fds[0];
    while (true) {
      FrameHeader h;
      std::string payload;
      bool ok = ReadAll(fd, &h, sizeof(h)) && h.magic == kFrameMagic;
      if (ok && h.type == kAck) {
        ok = h.len >= 0 && h.len < (1 << 20);
        if (ok) {
          payload.resize(h.len);
          ok = ReadAll(fd, payload.data(), h.len);
        }
      }
      absl::MutexLock l(&mu_);
      if (!ok) {
        BreakLocked(p.get(), absl::UnavailableError(absl::StrCat("host_tcp peer ", p->instance,
                                                                 " vanished (control connection closed)")));
        return;
      }
      if (!p->features_known) {
        // The peer's first frame: kFeatures from a build that has it, anything else from one before.
        p->features_known = true;
        p->peer_can_cancel = h.type == kFeatures && (h.op & kFeatureCancel) != 0;
        for (const auto& [tag, why] : p->pending_cancels) CancelOrBreakLocked(p.get(), tag, why);
        p->pending_cancels.clear();
        cv_.SignalAll();
      }
      if (h.type == kFeatures) continue;
      if (h.type == kCancel) {
        // Counted like early frames (an entry lives until the peer's kCancelEnd on every connection).
        if (p->cancelling.count(h.tag) == 0 && p->early_frames() >= limits_.max_early_control_frames) {
          ++early_overflows_;
          BreakLocked(p.get(), absl::ResourceExhaustedError(absl::StrCat(
                                   "host_tcp peer ", p->instance, " cancelled more than ", limits_.max_early_control_frames,
                                   " batches without ending them on every connection; channel closed")));
          return;
        }
        if (!p->broken) {
          CancelTagLocked(p.get(), h.tag, /*from_peer=*/true,
                          absl::CancelledError(absl::StrCat("host_tcp batch ", h.tag, ": peer ", p->instance,
                                                            " cancelled it (CancelBatches there)")));
        }
        continue;
      }
      // A batch being cancelled: what the peer sent for it before it knew is void.
      if (p->cancelling.count(h.tag) > 0) continue;
      auto it = p->batches.find(h.tag);
      TcpBatch* b = it == p->batches.end() ? nullptr : it->second.get();
      // A frame for a batch this side has not posted yet is held until Post (not on a broken
      // channel: nothing is posted there again); at most max_early_control_frames per channel, so
      // a peer streaming frames of made-up tags cannot grow this side's memory without bound.
      const bool hold = b == nullptr && !p->broken;
      if (hold && (h.type == kManifest || h.type == kChecksum || h.type == kAck) &&
          p->early_frames() >= limits_.max_early_control_frames) {
        ++early_overflows_;
        BreakLocked(p.get(), absl::ResourceExhaustedError(absl::StrCat(
                                 "host_tcp peer ", p->instance, " sent more than ", limits_.max_early_control_frames,
                                 " control frames for batches this side has not posted (last: type ",
                                 static_cast<int>(h.type), " for batch ", h.tag, "); channel closed")));
        return;
      }
      if (h.type == kManifest) {
        if (b) {
          OnManifestLocked(p.get(), b, static_cast<uint64_t>(h.offset));
        } else if (hold) {
          p->early_manifest[h.tag] = static_cast<uint64_t>(h.offset);
        }
      } else if (h.type == kChecksum) {
        if (b) {
          b->peer_checksum_known = true;
          b->peer_checksum = static_cast<uint64_t>(h.offset);
          MaybeFinishRecvLocked(p.get(), b);
        } else if (hold) {
          p->early_checksum[h.tag] = static_cast<uint64_t>(h.offset);
        }
      } else if (h.type == kAck) {
        absl::Status s = h.op == 0 ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(h.op), payload);
        if (b) {
          OnAckLocked(b, s);
        } else if (hold) {
          p->early_ack[h.tag] = s;
        }
        if (!s.ok()) {
          // The peer failed the batch (checksum mismatch) while our frames of it may still be in
          // flight: its data readers would stall on them, or hand them to a later batch reusing
          // the tag. Close the channel, as a missed deadline does. Done here, on the side that
          // received the failure, so that the failure code itself always reaches this side.
          BreakLocked(p.get(), absl::UnavailableError(absl::StrCat("channel closed after peer ", p->instance,
                                                                   " failed batch ", h.tag, ": ", s.message())));
          return;
        }
      }
      cv_.SignalAll();
    }
  }

  void DataWriter(std::shared_ptr<PeerConn> p, size_t stream) {
    const int fd = p->fds[stream];
    std::vector<char> scratch;
    XxhState unit_state(XXH3_createState());
    absl::MutexLock l(&mu_);
    std::deque<uint64_t>& ends = p->end_markers[stream];
    while (true) {
      while (!p->broken && p->send_queue.empty() && ends.empty()) cv_.Wait(&mu_);
      if (p->broken) return;
      if (!ends.empty()) {
        // After the chunk this writer last sent: no frame of the cancelled batch follows it here.
        FrameHeader end = Header(kCancelEnd, ends.front(), 0, 0, 0);
        ends.pop_front();
        mu_.Unlock();
        struct iovec iov = {&end, sizeof(end)};
        const bool sent = WriteAll(fd, &iov, 1);
        mu_.Lock();
        if (!sent) {
          BreakLocked(p.get(), absl::UnavailableError(absl::StrCat("host_tcp peer ", p->instance, " vanished (", Errno("send"), ")")));
          return;
        }
        continue;
      }
      std::shared_ptr<TcpBatch> b = p->send_queue.front();
      const Chunk c = b->chunks[b->next_chunk++];
      if (b->next_chunk == b->chunks.size()) p->send_queue.pop_front();
      b->active++;
      const bool corrupt = b->corrupt_once;
      b->corrupt_once = false;
      mu_.Unlock();
      const OpLayout& op = b->layouts[c.op];
      char* base = b->local_base[c.op];
      uint64_t hash = 0;
      if (b->checksum) {
        XXH3_state_t* st = XXH3_createState();
        XXH3_64bits_reset_withSeed(st, ChunkSeed(c.op, c.offset));
        op.src.ForEachPiece(c.offset, c.offset + c.len,
                            [&](int64_t off, int64_t, int64_t n) { XXH3_64bits_update(st, base + off, n); });
        hash = XXH3_64bits_digest(st);
        XXH3_freeState(st);
      }
      FrameHeader h = Header(kData, b->tag, c.op, c.offset, c.len);
      // Unit hashing: this chunk holds whole units (Post cut it so); each slice is hashed right
      // before it is handed to the socket.
      const int64_t unit = b->unit.empty() ? 0 : b->unit[c.op];
      const int64_t end = c.offset + c.len;
      const int64_t units = WholeUnits(unit, c.offset, end, op.src.total_bytes());
      UnitHasher hasher(unit_state.get(), unit, op.src.total_bytes(), units > 0 ? b->unit_hashes->hashes[c.op].data() : nullptr);
      const bool gathered = corrupt || op.src.CountPieces(c.offset, end) > kMaxIov;
      // Egress cap (--max_send_gbps): this chunk's link time is booked before any of it is sent.
      // The wait ends early when the peer breaks (or the transport is destroyed: that breaks every
      // peer), so a low cap never holds a shutdown; the write below then fails as for any break.
      // A chunk that must wait is unit-hashed first: the wait is link time, which a NIC spends
      // draining the socket buffer while the writer hashes its next slices, so the hash should not
      // add to it (the slices stay in cache for the send).
      bool prehashed = false;
      if (pacer_ != nullptr) {
        const absl::Time at = pacer_->Reserve(c.len + static_cast<int64_t>(sizeof(FrameHeader)));
        if (at > absl::Now()) {
          if (units > 0 && !gathered) {
            ForEachSlice(op.src, c.offset, end, unit, [&](int64_t off, int64_t logical, int64_t n) { hasher.Update(logical, base + off, n); });
            prehashed = true;
          }
          absl::MutexLock wait(&mu_);
          mu_.AwaitWithDeadline(absl::Condition(+[](PeerConn* pc) { return pc->broken; }, p.get()), at);
        }
      }
      std::vector<struct iovec> iov;
      iov.push_back({&h, sizeof(h)});
      bool ok = true;
      if (gathered) {
        scratch.resize(c.len);
        op.src.ForEachPiece(c.offset, end, [&](int64_t off, int64_t logical, int64_t n) {
          std::memcpy(scratch.data() + (logical - c.offset), base + off, n);
        });
        for (int64_t l = c.offset; units > 0 && l < end;) {
          const int64_t n = std::min(unit - l % unit, end - l);
          hasher.Update(l, scratch.data() + (l - c.offset), n);
          l += n;
        }
        if (corrupt) scratch[0] ^= 0x5a;  // TEST ONLY: after the hashes were taken
        iov.push_back({scratch.data(), static_cast<size_t>(c.len)});
      } else if (units > 0) {
        int64_t pending = 0;
        ForEachSlice(op.src, c.offset, end, unit, [&](int64_t off, int64_t logical, int64_t n) {
          if (!prehashed) hasher.Update(logical, base + off, n);
          iov.push_back({base + off, static_cast<size_t>(n)});
          pending += n;
          if (pending >= kHashSlice || static_cast<int>(iov.size()) >= kMaxIov) {
            ok = ok && WriteAll(fd, iov.data(), iov.size());
            iov.clear();
            pending = 0;
          }
        });
      } else {
        op.src.ForEachPiece(c.offset, end, [&](int64_t off, int64_t, int64_t n) { iov.push_back({base + off, static_cast<size_t>(n)}); });
      }
      if (!iov.empty()) ok = ok && WriteAll(fd, iov.data(), iov.size());
      mu_.Lock();
      b->active--;
      if (!ok) {
        BreakLocked(p.get(), absl::UnavailableError(absl::StrCat("host_tcp peer ", p->instance,
                                                                 " vanished mid-transfer (", Errno("send"), ")")));
        cv_.SignalAll();
        return;
      }
      b->chunks_written++;
      b->send_hash ^= hash;
      if (units > 0 && (b->units_done[c.op] += units) == static_cast<int64_t>(b->unit_hashes->hashes[c.op].size())) {
        b->unit_hashes->complete[c.op] = 1;
      }
      stats_.bytes_copied += c.len;
      stats_.paths[p->path[stream]].bytes_sent += c.len;
      // (Not for a failed or cancelled batch: the peer dropped it, or must not hold it.)
      if (b->chunks_written == b->chunks.size() && b->checksum && b->status.ok()) {
        ControlFrame f{};
        f.h = Header(kChecksum, b->tag, 0, static_cast<int64_t>(b->send_hash), 0);
        p->control.push_back(std::move(f));
      }
      cv_.SignalAll();
    }
  }

  void DataReader(std::shared_ptr<PeerConn> p, size_t stream) {
    const int fd = p->fds[stream];
    std::vector<char> scratch;
    XxhState unit_state(XXH3_createState());
    while (true) {
      FrameHeader h;
      bool ok = ReadAll(fd, &h, sizeof(h)) && h.magic == kFrameMagic && (h.type == kData || (h.type == kCancelEnd && h.len == 0));
      absl::MutexLock l(&mu_);
      if (!ok) {
        BreakLocked(p.get(), absl::UnavailableError(absl::StrCat("host_tcp peer ", p->instance,
                                                                 " vanished mid-transfer (data connection closed)")));
        return;
      }
      if (h.type == kCancelEnd) {
        if (p->cancelling.count(h.tag) == 0 && p->early_frames() >= limits_.max_early_control_frames) {
          ++early_overflows_;
          BreakLocked(p.get(), absl::ResourceExhaustedError(absl::StrCat(
                                   "host_tcp peer ", p->instance, " cancelled more than ", limits_.max_early_control_frames,
                                   " batches without ending them on every connection; channel closed")));
          return;
        }
        if (!p->broken) OnCancelEndLocked(p.get(), stream, h.tag);
        continue;
      }
      // Nothing is written before this side posted the batch and both manifests matched. A frame of a
      // batch being cancelled is read and dropped (its memory may be the caller's again).
      auto ready = [&] {
        auto it = p->batches.find(h.tag);
        return p->broken || p->cancelling.count(h.tag) > 0 ||
               (it != p->batches.end() && (it->second->manifest_matched || !it->second->status.ok()));
      };
      while (!ready()) cv_.Wait(&mu_);
      if (p->broken) return;
      if (p->cancelling.count(h.tag) > 0) {
        if (h.len < 0 || h.len > (int64_t{1} << 31)) {
          BreakLocked(p.get(), absl::InternalError(absl::StrCat("host_tcp peer ", p->instance, " sent a bad frame (batch ",
                                                                h.tag, ": length ", h.len, ")")));
          return;
        }
        mu_.Unlock();
        scratch.resize(static_cast<size_t>(std::min(h.len, kDiscardPiece)));
        for (int64_t left = h.len; ok && left > 0; left -= kDiscardPiece) {
          ok = ReadAll(fd, scratch.data(), static_cast<size_t>(std::min(left, kDiscardPiece)));
        }
        mu_.Lock();
        if (!ok) {
          BreakLocked(p.get(), absl::UnavailableError(absl::StrCat("host_tcp peer ", p->instance,
                                                                   " vanished mid-transfer (", Errno("recv"), ")")));
          return;
        }
        stats_.paths[p->path[stream]].bytes_received += h.len;
        continue;
      }
      std::shared_ptr<TcpBatch> b = p->batches[h.tag];
      if (!b->status.ok()) {
        BreakLocked(p.get(), b->status);
        return;
      }
      // Bounds by subtraction: offset + len could overflow int64 (offset near INT64_MAX).
      const int64_t op_bytes = h.op < b->layouts.size() ? b->layouts[h.op].dst.total_bytes() : 0;
      std::string bad;
      if (h.op >= b->layouts.size() || b->is_send[h.op]) {
        bad = absl::StrCat("op ", h.op, " is not one this side receives in the batch");
      } else if (h.offset < 0 || h.len <= 0 || h.offset > op_bytes || h.len > op_bytes - h.offset) {
        bad = absl::StrCat("bytes at offset ", h.offset, " length ", h.len, " are outside op ", h.op, "'s ", op_bytes,
                           " bytes");
      } else if (!ClaimRange(b->recv_ranges[h.op], h.offset, h.offset + h.len)) {
        bad = absl::StrCat("op ", h.op, " bytes [", h.offset, ", ", h.offset + h.len,
                           ") overlap bytes of it already received (a duplicate frame)");
      }
      if (!bad.empty()) {
        BreakLocked(p.get(), absl::InternalError(absl::StrCat("host_tcp peer ", p->instance, " sent a bad frame (batch ",
                                                              h.tag, ": ", bad, ")")));
        return;
      }
      b->active++;
      mu_.Unlock();
      const OpLayout& op = b->layouts[h.op];
      char* base = b->local_base[h.op];
      const int64_t end = h.offset + h.len;
      // Unit hashing: a frame of whole units is hashed slice by slice as it lands (a frame that
      // cuts a unit is not: the op stays incomplete and the caller hashes its memory).
      const int64_t unit = b->unit.empty() ? 0 : b->unit[h.op];
      const int64_t units = WholeUnits(unit, h.offset, end, op.dst.total_bytes());
      UnitHasher hasher(unit_state.get(), unit, op.dst.total_bytes(), units > 0 ? b->unit_hashes->hashes[h.op].data() : nullptr);
      bool flip = test_flip_next_received_.exchange(false);  // TEST ONLY: a bit flipped on the wire
      if (op.dst.CountPieces(h.offset, end) > kMaxIov) {
        scratch.resize(h.len);
        ok = ReadAll(fd, scratch.data(), h.len);
        if (ok) {
          if (flip) scratch[0] ^= 0x20;
          op.dst.ForEachPiece(h.offset, end, [&](int64_t off, int64_t logical, int64_t n) {
            std::memcpy(base + off, scratch.data() + (logical - h.offset), n);
          });
          if (units > 0) ForEachSlice(op.dst, h.offset, end, unit, [&](int64_t off, int64_t logical, int64_t n) { hasher.Update(logical, base + off, n); });
        }
      } else if (units > 0) {
        ForEachSlice(op.dst, h.offset, end, unit, [&](int64_t off, int64_t logical, int64_t n) {
          ok = ok && ReadAll(fd, base + off, n);
          if (!ok) return;
          if (flip) base[off] ^= 0x20;
          flip = false;
          hasher.Update(logical, base + off, n);
        });
      } else {
        op.dst.ForEachPiece(h.offset, end, [&](int64_t off, int64_t, int64_t n) {
          ok = ok && ReadAll(fd, base + off, n);
          if (ok && flip) base[off] ^= 0x20;
          flip = false;
        });
      }
      uint64_t hash = 0;
      if (ok && b->checksum) {
        XXH3_state_t* st = XXH3_createState();
        XXH3_64bits_reset_withSeed(st, ChunkSeed(h.op, h.offset));
        op.dst.ForEachPiece(h.offset, end, [&](int64_t off, int64_t, int64_t n) { XXH3_64bits_update(st, base + off, n); });
        hash = XXH3_64bits_digest(st);
        XXH3_freeState(st);
      }
      mu_.Lock();
      b->active--;
      if (!ok) {
        BreakLocked(p.get(), absl::UnavailableError(absl::StrCat("host_tcp peer ", p->instance,
                                                                 " vanished mid-transfer (", Errno("recv"), ")")));
        return;
      }
      b->recv_got += h.len;
      b->recv_hash ^= hash;
      if (units > 0 && (b->units_done[h.op] += units) == static_cast<int64_t>(b->unit_hashes->hashes[h.op].size())) {
        b->unit_hashes->complete[h.op] = 1;
      }
      stats_.bytes_copied += h.len;
      stats_.paths[p->path[stream]].bytes_received += h.len;
      MaybeFinishRecvLocked(p.get(), b.get());
      cv_.SignalAll();
    }
  }

  const TcpOptions options_;
  const HostTcpLimits limits_;
  const std::string node_id_;
  const std::string instance_id_;
  const bool corrupt_;
  const std::vector<int> cpus_;  // stream threads' affinity; empty = float
  const bool multi_nic_;
  std::unique_ptr<SendPacer> pacer_;  // set once in the constructor when options_ caps egress; thread-safe
  std::atomic<bool> test_flip_next_received_{false};
  std::vector<Listener> listeners_;  // fixed after construction (threads joined in the destructor)

  mutable absl::Mutex mu_;
  absl::CondVar cv_;         // batch/peer state changes
  absl::CondVar accept_cv_;  // parking_ changes (connections parked, Connects waiting), rounds cancelled
  CancelledRounds cancelled_ ABSL_GUARDED_BY(mu_);          // CancelRound
  CancelledRounds cancelled_groups_ ABSL_GUARDED_BY(mu_){kMinRememberedCancelledGroups};  // CancelBatches (group as text)
  std::multimap<std::string, int> dialing_ ABSL_GUARDED_BY(mu_);  // round -> socket a Connect is dialling (DialingFd)
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  RegionRegistry<Region> regions_ ABSL_GUARDED_BY(mu_){kKind};
  std::map<uint64_t, std::shared_ptr<PeerConn>> peers_ ABSL_GUARDED_BY(mu_);
  BatchTable<TcpBatch> batches_ ABSL_GUARDED_BY(mu_){kKind};
  // Authenticated connections waiting for a Connect, by (claimed dialer instance, round).
  ParkingTable parking_ ABSL_GUARDED_BY(mu_);
  int64_t hellos_refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hellos_unknown_instance_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hellos_without_round_ ABSL_GUARDED_BY(mu_) = 0;
  // The secret made for each peer that dials this transport, handed out in ExportEndpoint(peer).
  PeerSecrets peer_secrets_ ABSL_GUARDED_BY(mu_);
  int64_t early_overflows_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<Handshake> handshakes_ ABSL_GUARDED_BY(mu_);          // accepted, not yet authenticated
  std::map<std::string, int> auth_failures_ ABSL_GUARDED_BY(mu_);  // claimed instance -> refusals
  std::map<std::string, int> handshakes_by_source_ ABSL_GUARDED_BY(mu_);  // dialer address -> in handshake
  size_t active_handshakes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t busy_refusals_ ABSL_GUARDED_BY(mu_) = 0;  // closed unread: per-source / total bound
  std::string last_busy_source_ ABSL_GUARDED_BY(mu_);
  TransportStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

namespace {

// A listening socket on addr (port chosen by the kernel). Errors start "bind/listen:" and end with
// "on <addr>"; the caller says whose address it is.
absl::StatusOr<Listener> Listen(const std::string& addr) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(Errno("host_tcp socket"));
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("host_tcp: bad bind address '", addr, "'"));
  }
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(fd, 128) != 0) {
    const bool foreign = errno == EADDRNOTAVAIL;
    std::string e = Errno("bind/listen");
    close(fd);
    return absl::UnavailableError(
        absl::StrCat(e, " on ", addr, foreign ? " (no interface of this host has that address)" : ""));
  }
  socklen_t len = sizeof(sa);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  Listener l;
  l.fd = fd;
  l.nic.addr = addr;
  l.nic.port = ntohs(sa.sin_port);
  return l;
}

}  // namespace

absl::StatusOr<std::vector<HostTcpStreamAddresses>> HostTcpStreams(const Transport& transport, PeerId peer) {
  const auto* t = dynamic_cast<const HostTcpTransport*>(&transport);
  if (t == nullptr) return absl::InvalidArgumentError("HostTcpStreams: not a host_tcp transport");
  return t->StreamAddresses(peer);
}

bool HostTcpTestWaitForAcceptors(Transport& transport, absl::string_view peer_instance, int n, absl::Time deadline) {
  auto* t = dynamic_cast<HostTcpTransport*>(&transport);
  return t != nullptr && t->WaitForAcceptors(std::string(peer_instance), n, deadline);
}

bool HostTcpTestWaitForParked(Transport& transport, absl::string_view peer_instance, absl::string_view round, int n,
                              absl::Time deadline) {
  auto* t = dynamic_cast<HostTcpTransport*>(&transport);
  return t != nullptr && t->WaitForParked({std::string(peer_instance), std::string(round)}, n, deadline);
}

absl::Status HostTcpTestFlipNextReceived(Transport& transport) {
  auto* t = dynamic_cast<HostTcpTransport*>(&transport);
  if (t == nullptr) return absl::InvalidArgumentError("HostTcpTestFlipNextReceived: not a host_tcp transport");
  t->TestFlipNextReceived();
  return absl::OkStatus();
}

absl::StatusOr<HostTcpCounters> HostTcpCountersOf(const Transport& transport) {
  const auto* t = dynamic_cast<const HostTcpTransport*>(&transport);
  if (t == nullptr) return absl::InvalidArgumentError("HostTcpCountersOf: not a host_tcp transport");
  return t->Counters();
}

absl::StatusOr<std::unique_ptr<Transport>> NewHostTcpTransport(const TransportConfig& config) {
  return NewHostTcpTransport(config, HostTcpLimits{});
}

absl::StatusOr<std::unique_ptr<Transport>> NewHostTcpTransport(const TransportConfig& config,
                                                               const HostTcpLimits& limits) {
  if (limits.max_parked_connections < 0 || limits.parked_timeout < absl::ZeroDuration() ||
      limits.max_early_control_frames < 0) {
    return absl::InvalidArgumentError("host_tcp: HostTcpLimits must not be negative");
  }
  if (limits.max_parked_rounds_per_instance < 1) {
    return absl::InvalidArgumentError("host_tcp: HostTcpLimits::max_parked_rounds_per_instance must be at least 1");
  }
  if (limits.max_peer_secrets < 1) {
    return absl::InvalidArgumentError("host_tcp: HostTcpLimits::max_peer_secrets must be at least 1");
  }
  if (config.tcp.streams < 1 || config.tcp.streams > kMaxStreams) {
    return absl::InvalidArgumentError("host_tcp: tcp.streams must be in [1, 64]");
  }
  if (!(config.tcp.max_send_bytes_per_s >= 0) || std::isinf(config.tcp.max_send_bytes_per_s)) {
    return absl::InvalidArgumentError(absl::StrCat("host_tcp: max_send_bytes_per_s must be a finite number >= 0 (0 = no cap), not ",
                                                   config.tcp.max_send_bytes_per_s));
  }
  if (!config.cpus.empty()) {
    if (absl::Status s = ValidateCpuSet(config.cpus); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("host_tcp: cpus ", FormatCpuList(config.cpus), ": ", s.message()));
    }
  }
  const bool multi_nic = !config.tcp.local_addresses.empty();
  std::vector<std::string> addrs;
  if (!multi_nic) {
    addrs.push_back(config.tcp.bind_address);
  } else {
    if (config.tcp.local_addresses.size() > kMaxNics) {
      return absl::InvalidArgumentError(absl::StrCat("host_tcp: at most ", kMaxNics, " local_addresses"));
    }
    if (!config.tcp.advertise_address.empty()) {
      return absl::InvalidArgumentError(
          "host_tcp: advertise_address applies to the single-address mode only; with local_addresses every NIC is "
          "advertised at its own address");
    }
    if (config.tcp.streams < static_cast<int>(config.tcp.local_addresses.size())) {
      return absl::InvalidArgumentError(absl::StrCat("host_tcp: tcp.streams (", config.tcp.streams, ") < ",
                                                     config.tcp.local_addresses.size(),
                                                     " local_addresses: some NIC would carry no stream"));
    }
    for (const std::string& nic : config.tcp.local_addresses) {
      absl::StatusOr<std::string> a = ResolveNic(nic);
      if (!a.ok()) return absl::Status(a.status().code(), absl::StrCat("host_tcp: ", a.status().message()));
      if (std::find(addrs.begin(), addrs.end(), *a) != addrs.end()) {
        return absl::InvalidArgumentError(absl::StrCat("host_tcp: local_addresses name ", *a, " twice (", nic, ")"));
      }
      addrs.push_back(*a);
    }
  }
  std::vector<Listener> listeners;
  for (size_t i = 0; i < addrs.size(); ++i) {
    absl::StatusOr<Listener> l = Listen(addrs[i]);
    if (!l.ok()) {
      for (Listener& x : listeners) close(x.fd);
      if (!multi_nic) return absl::Status(l.status().code(), absl::StrCat("host_tcp ", l.status().message()));
      const std::string& given = config.tcp.local_addresses[i];
      return absl::Status(l.status().code(), absl::StrCat("host_tcp: data NIC ", given, given != addrs[i] ? " (" + addrs[i] + ")" : "",
                                                          " cannot be used: ", l.status().message()));
    }
    listeners.push_back(std::move(*l));
  }
  return std::unique_ptr<Transport>(new HostTcpTransport(config, limits, std::move(listeners), multi_nic));
}

}  // namespace wb::transport
