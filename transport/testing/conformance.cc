#include "transport/testing/conformance.h"

#include <xxhash.h>

#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "transport/factory.h"
#include "transport/testing/peer_process.h"
#include "base/shm_segment.h"
#include "transport/testing/in_process_peer.h"
#include "transport/testing/peer_interpreter.h"
#include "transport/testing/test_buffer.h"

namespace wb::transport {
namespace {

constexpr uint64_t kLocalSeed = 11;
constexpr uint64_t kPeerSeed = 22;

// Element-by-element reference copy (independent of transport/strided.h).
void ReferenceCopy(const CopyOp& op, const std::vector<uint8_t>& src, std::vector<uint8_t>& dst) {
  int64_t n = 1;
  for (auto d : op.shape) n *= d;
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, so = op.src.offset_bytes, dof = op.dst.offset_bytes;
    for (int d = static_cast<int>(op.shape.size()) - 1; d >= 0; --d) {
      int64_t idx = rem % op.shape[d];
      rem /= op.shape[d];
      so += idx * op.src.strides[d] * op.element_size;
      dof += idx * op.dst.strides[d] * op.element_size;
    }
    std::memcpy(&dst[dof], &src[so], op.element_size);
  }
}

std::vector<uint8_t> Pattern(uint64_t seed, int64_t n) {
  std::vector<uint8_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = PatternByte(seed, i);
  return v;
}

uint64_t Hash(const std::vector<uint8_t>& v) { return XXH3_64bits(v.data(), v.size()); }

CopyOp Contig(int64_t src_off, int64_t dst_off, int64_t n_elems, int32_t elem) {
  CopyOp op;
  op.shape = {n_elems};
  op.element_size = elem;
  op.src.offset_bytes = src_off;
  op.src.strides = {1};
  op.dst.offset_bytes = dst_off;
  op.dst.strides = {1};
  return op;
}

// An op in test terms: does it read from the LOCAL buffer (and write the peer's) or the reverse?
struct TOp {
  bool src_local = true;
  CopyOp op;
};

struct Peer {
  std::unique_ptr<PeerHandle> proc;
  PeerId id;
  RegionHandle remote;  // our import of the peer's buffer
  int64_t size = 0;
  std::string my_ep;    // our endpoint bytes for the peer (what its Connect takes)
  std::string peer_ep;  // the peer's endpoint bytes for us
};

// A Connect of this process in a thread of its own (an attempt whose caller may give up on it).
class LocalAsyncConnect {
 public:
  LocalAsyncConnect(Transport& t, std::string endpoint, std::string round, absl::Duration timeout)
      : thread_([this, &t, endpoint = std::move(endpoint), round = std::move(round), deadline = absl::Now() + timeout] {
          absl::StatusOr<PeerId> r = t.Connect(endpoint, round, deadline);
          absl::MutexLock l(&mu_);
          result_ = std::move(r);
        }) {}
  ~LocalAsyncConnect() { thread_.join(); }
  // The result once the Connect returned within `timeout`, else nullopt (still waiting).
  std::optional<absl::StatusOr<PeerId>> Result(absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return result_.has_value(); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) return std::nullopt;
    return result_;
  }

 private:
  absl::Mutex mu_;
  std::optional<absl::StatusOr<PeerId>> result_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts once the rest is built
};

class Harness {
 public:
  explicit Harness(const ConformanceParam& p) : p_(p) {}

  absl::Status Init(int64_t local_size, bool corrupt = false) {
    TransportConfig config;
    config.test_corrupt_checksummed_payload = corrupt;
    config.nccl.device = 0;
    auto t = p_.make_transport ? p_.make_transport(config) : CreateTransport(p_.kind, config);
    if (!t.ok()) return t.status();
    t_ = std::move(*t);
    auto b = MakeTestBuffer(p_.memory, local_size, 0, "test-local buffer");
    if (!b.ok()) return b.status();
    local_ = std::move(*b);
    if (auto s = local_->Fill(kLocalSeed); !s.ok()) return s;
    auto h = t_->RegisterMemory(local_->spec());
    if (!h.ok()) return h.status();
    local_region_ = *h;
    return absl::OkStatus();
  }

  absl::StatusOr<Peer> StartPeer(int64_t size, std::vector<std::string> extra = {}) {
    absl::StatusOr<Peer> peer = PreparePeer(size, std::move(extra));
    if (!peer.ok()) return peer.status();
    absl::StatusOr<PeerId> local_conn = absl::UnknownError("not run");
    std::thread th([&] { local_conn = t_->Connect(peer->peer_ep, absl::Now() + absl::Seconds(30)); });
    auto remote_conn = peer->proc->Command("CONNECT " + HexEncode(peer->my_ep));
    th.join();
    if (!local_conn.ok()) return local_conn.status();
    if (!remote_conn.ok()) return remote_conn.status();
    peer->id = *local_conn;
    if (absl::Status s = ImportBoth(*peer); !s.ok()) return s;
    return peer;
  }

  // Connects both sides in `round` (Connect's deadline `timeout`) and imports each other's buffer.
  absl::Status ConnectInRound(Peer& peer, const std::string& round, absl::Duration timeout) {
    absl::StatusOr<PeerId> local_conn = absl::UnknownError("not run");
    std::thread th([&] { local_conn = t_->Connect(peer.peer_ep, round, absl::Now() + timeout); });
    auto remote_conn = peer.proc->Command(absl::StrCat("CONNECT_ROUND ", HexEncode(peer.my_ep), " ", HexEncode(round), " ",
                                                       absl::ToInt64Milliseconds(timeout)),
                                          timeout + absl::Seconds(10));
    th.join();
    if (!local_conn.ok()) return local_conn.status();
    if (!remote_conn.ok()) return remote_conn.status();
    peer.id = *local_conn;
    return ImportBoth(peer);
  }

  // A peer whose endpoints are exchanged with ours, not connected yet.
  absl::StatusOr<Peer> PreparePeer(int64_t size, std::vector<std::string> extra = {}) {
    Peer peer;
    peer.size = size;
    std::vector<std::string> args = {"--kind=" + p_.kind, std::string("--memory=") + MemoryKindName(p_.memory),
                                     absl::StrCat("--size=", size), absl::StrCat("--seed=", kPeerSeed),
                                     absl::StrCat("--device=", p_.peer_device)};
    args.insert(args.end(), extra.begin(), extra.end());
    if (p_.make_transport) {
      auto proc = StartInProcessPeer(size, extra);
      if (!proc.ok()) return proc.status();
      peer.proc = std::move(*proc);
    } else {
      auto proc = PeerProcess::Spawn(p_.peer_binary, args);
      if (!proc.ok()) return proc.status();
      peer.proc = std::move(*proc);
    }
    auto inst = peer.proc->Command("ID");
    if (!inst.ok()) return inst.status();
    auto my_ep = t_->ExportEndpoint(*inst);
    if (!my_ep.ok()) return my_ep.status();
    auto peer_ep_hex = peer.proc->Command("ENDPOINT " + t_->instance_id());
    if (!peer_ep_hex.ok()) return peer_ep_hex.status();
    auto peer_ep = HexDecode(*peer_ep_hex);
    if (!peer_ep.ok()) return peer_ep.status();
    peer.my_ep = std::move(*my_ep);
    peer.peer_ep = std::move(*peer_ep);
    return peer;
  }

  absl::Status ImportBoth(Peer& peer) {
    auto desc = peer.proc->Command("DESC");
    if (!desc.ok()) return desc.status();
    auto desc_bytes = HexDecode(*desc);
    if (!desc_bytes.ok()) return desc_bytes.status();
    auto remote = t_->ImportDescriptor(*desc_bytes);
    if (!remote.ok()) return remote.status();
    peer.remote = *remote;
    auto my_desc = t_->ExportDescriptor(local_region_);
    if (!my_desc.ok()) return my_desc.status();
    auto imp = peer.proc->Command("IMPORT " + HexEncode(*my_desc));
    if (!imp.ok()) return imp.status();
    return absl::OkStatus();
  }

  // The in-process equivalent of spawning transport_peer with `extra` flags.
  absl::StatusOr<std::unique_ptr<PeerHandle>> StartInProcessPeer(int64_t size, const std::vector<std::string>& extra) {
    TransportConfig config;
    for (const std::string& f : extra) {
      if (f == "--corrupt") config.test_corrupt_checksummed_payload = true;
    }
    auto t = p_.make_transport(config);
    if (!t.ok()) return t.status();
    auto b = MakeTestBuffer(p_.memory, size, p_.peer_device, "in-process peer buffer");
    if (!b.ok()) return b.status();
    if (auto s = (*b)->Fill(kPeerSeed); !s.ok()) return s;
    auto interp = PeerInterpreter::Create(std::move(*b), std::move(*t));
    if (!interp.ok()) return interp.status();
    return std::unique_ptr<PeerHandle>(std::make_unique<InProcessPeer>(std::move(*interp), p_.vanish));
  }

  Batch MakeBatch(const Peer& peer, const std::vector<TOp>& ops, uint64_t tag, bool checksum, uint64_t group = 0) {
    Batch b;
    b.tag = tag;
    b.group = group;
    b.peer = peer.id;
    b.checksum = checksum;
    for (const TOp& o : ops) {
      CopyOp op = o.op;
      op.src.region = o.src_local ? local_region_ : peer.remote;
      op.dst.region = o.src_local ? peer.remote : local_region_;
      b.ops.push_back(op);
    }
    return b;
  }

  // Tells the peer to post the mirror (two-sided transports only). Returns the peer's batch id.
  // `group`: the peer's Batch::group for it (0: none).
  absl::StatusOr<std::string> PostMirror(Peer& peer, const std::vector<TOp>& ops, uint64_t tag, bool checksum,
                                         uint64_t group = 0) {
    MirrorBatch m;
    m.tag = tag;
    m.checksum = checksum;
    for (const TOp& o : ops) m.ops.push_back({!o.src_local, o.op});
    return peer.proc->Command("POST " + HexEncode(EncodeMirror(m)) + (group != 0 ? absl::StrCat(" ", group) : ""));
  }

  // Runs ops to completion on both sides; returns the first error (local first).
  absl::Status Run(Peer& peer, const std::vector<TOp>& ops, uint64_t tag, bool checksum,
                   absl::Duration timeout = absl::Seconds(60), uint64_t group = 0) {
    std::string peer_batch;
    if (two_sided()) {
      auto id = PostMirror(peer, ops, tag, checksum);
      if (!id.ok()) return id.status();
      peer_batch = *id;
      if (auto s = peer.proc->Send(absl::StrCat("WAIT ", peer_batch, " ", absl::ToInt64Milliseconds(timeout)));
          !s.ok()) {
        return s;
      }
    }
    auto id = t_->Post(MakeBatch(peer, ops, tag, checksum, group));
    absl::Status local = id.ok() ? t_->Wait(*id, absl::Now() + timeout) : id.status();
    absl::Status remote;
    if (two_sided()) {
      auto r = peer.proc->Reply(timeout + absl::Seconds(10));
      remote = r.status();
    }
    if (!local.ok()) return local;
    return remote;
  }

  // Expected contents of both buffers after `ops` applied to their initial patterns.
  void Expect(const Peer& peer, const std::vector<TOp>& ops, std::vector<uint8_t>* local,
              std::vector<uint8_t>* remote) {
    const auto local0 = Pattern(kLocalSeed, local_->size());
    const auto remote0 = Pattern(kPeerSeed, peer.size);
    *local = local0;
    *remote = remote0;
    for (const TOp& o : ops) {
      if (o.src_local) {
        ReferenceCopy(o.op, local0, *remote);
      } else {
        ReferenceCopy(o.op, remote0, *local);
      }
    }
  }

  absl::StatusOr<uint64_t> PeerHash(Peer& peer) {
    auto r = peer.proc->Command(absl::StrCat("HASH 0 ", peer.size));
    if (!r.ok()) return r.status();
    uint64_t h = 0;
    if (!absl::SimpleAtoi(*r, &h)) return absl::InternalError("bad HASH reply " + *r);
    return h;
  }

  // Checks both buffers against the expectation; "" if equal, else what differs.
  std::string Verify(Peer& peer, const std::vector<TOp>& ops) {
    std::vector<uint8_t> el, er;
    Expect(peer, ops, &el, &er);
    std::string out;
    auto got = local_->ReadAll();
    if (!got.ok()) return std::string(got.status().message());
    if (*got != el) {
      int64_t first = 0;
      while ((*got)[first] == el[first]) ++first;
      absl::StrAppend(&out, "local buffer differs from expectation first at byte ", first, "; ");
    }
    auto ph = PeerHash(peer);
    if (!ph.ok()) return std::string(ph.status().message());
    if (*ph != Hash(er)) absl::StrAppend(&out, "peer buffer differs from expectation; ");
    return out;
  }

  bool two_sided() const { return t_->capabilities().two_sided; }
  Transport& t() { return *t_; }
  TestBuffer& local() { return *local_; }
  RegionHandle local_region() const { return local_region_; }

 private:
  ConformanceParam p_;
  std::unique_ptr<Transport> t_;
  std::unique_ptr<TestBuffer> local_;
  RegionHandle local_region_;
};

#define SKIP_WITHOUT_GPU()                                                                 \
  do {                                                                                     \
    if (GetParam().min_gpus > 0 && VisibleCudaDevices() < GetParam().min_gpus) {           \
      GTEST_SKIP() << GetParam().kind << " needs " << GetParam().min_gpus                  \
                   << " visible CUDA device(s), found " << VisibleCudaDevices();           \
    }                                                                                      \
  } while (0)

#define SETUP_OR_FAIL(h, local_size, peer_size, peer)           \
  Harness h(GetParam());                                        \
  {                                                             \
    absl::Status init_ = h.Init(local_size);                    \
    ASSERT_TRUE(init_.ok()) << init_;                           \
  }                                                             \
  auto peer##_or = h.StartPeer(peer_size);                      \
  ASSERT_TRUE(peer##_or.ok()) << peer##_or.status();            \
  Peer& peer = *peer##_or;

constexpr int64_t kSize = 4 << 20;

TEST_P(TransportConformanceTest, ContiguousBothDirections) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  std::vector<TOp> ops = {
      {true, Contig(0, 4096, (1 << 20) / 4, 4)},
      {false, Contig((2 << 20) + 123, (1 << 20) + 128, 1000001, 1)},  // sources never overlap destinations
      {true, Contig(3 << 20, 0, 17, 2)},
  };
  for (bool checksum : {false, true}) {
    absl::Status s = h.Run(peer, ops, checksum ? 2 : 1, checksum);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(h.Verify(peer, ops), "") << "checksum=" << checksum;
  }
}

TEST_P(TransportConformanceTest, StridedBothDirections) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  std::vector<TOp> ops;
  // 2-D box of a padded matrix (rows of 1000 bf16, box 300x200) -> dense.
  CopyOp a;
  a.shape = {300, 200};
  a.element_size = 2;
  a.src = {{}, 1000 * 2 * 5 + 2 * 7, {1000, 1}};
  a.dst = {{}, 0, {200, 1}};
  ops.push_back({true, a});
  // 3-D with padding on both sides, peer -> local.
  CopyOp b;
  b.shape = {7, 9, 33};
  b.element_size = 4;
  b.src = {{}, (3 << 20) + 8, {9 * 40, 40, 1}};
  b.dst = {{}, 1 << 20, {10 * 33, 33, 1}};
  ops.push_back({false, b});
  // Transposed placement (column-major destination), local -> peer.
  CopyOp c;
  c.shape = {64, 48};
  c.element_size = 2;
  c.src = {{}, 2 << 20, {48, 1}};
  c.dst = {{}, 2 << 20, {1, 64}};
  ops.push_back({true, c});
  absl::Status s = h.Run(peer, ops, 7, true);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(h.Verify(peer, ops), "");
}

TEST_P(TransportConformanceTest, ManySmallOps) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  std::mt19937 rng(5);
  std::vector<TOp> ops;
  int64_t dst_local = 0, dst_peer = 0;
  for (int i = 0; i < 2000; ++i) {
    const int64_t n = 1 + rng() % 300;
    const bool to_peer = rng() % 2;
    int64_t& dst = to_peer ? dst_peer : dst_local;
    const int64_t src = (2 << 20) + 2 * (rng() % ((1 << 20) / 2));  // upper half: never a destination
    ops.push_back({to_peer, Contig(src, dst, n, 2)});
    dst += n * 2 + 2 * (rng() % 4);
  }
  absl::Status s = h.Run(peer, ops, 9, false);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(h.Verify(peer, ops), "");
}

TEST_P(TransportConformanceTest, OneLargeOp) {
  SKIP_WITHOUT_GPU();
  const int64_t big = GetParam().large_op_bytes;
  SETUP_OR_FAIL(h, big + 4096, big + 4096, peer);
  std::vector<TOp> ops = {{true, Contig(4096, 0, big / 8, 8)}};
  absl::Status s = h.Run(peer, ops, 10, true);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(h.Verify(peer, ops), "");
  std::vector<TOp> back = {{false, Contig(0, 0, big / 2, 2)}};
  s = h.Run(peer, back, 11, false);
  ASSERT_TRUE(s.ok()) << s;
}

TEST_P(TransportConformanceTest, ZeroLengthOps) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  CopyOp z;
  z.shape = {0, 5};
  z.element_size = 2;
  z.src = {{}, 1 << 30, {5, 1}};  // offsets of zero-length ops are never checked
  z.dst = {{}, 0, {5, 1}};
  std::vector<TOp> only_zero = {{true, z}, {false, Contig(0, 0, 0, 4)}};
  absl::Status s = h.Run(peer, only_zero, 12, true);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(h.Verify(peer, only_zero), "");
  std::vector<TOp> mixed = {{true, z}, {true, Contig(0, 0, 100, 4)}, {false, Contig(0, 0, 0, 4)}};
  s = h.Run(peer, mixed, 13, false);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(h.Verify(peer, mixed), "");
}

TEST_P(TransportConformanceTest, OutOfBoundsIsInvalidArgumentAndWritesNothing) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  const std::vector<std::vector<TOp>> bad_batches = {
      {{true, Contig(0, 0, 1000, 4)}, {true, Contig(0, kSize - 8, 4, 4)}},       // dst past the end
      {{false, Contig(0, 0, 1000, 4)}, {false, Contig(kSize - 2, 0, 1, 4)}},      // src past the end
      {{true, Contig(0, 0, 10, 0)}},                                               // element size 0
  };
  for (const auto& ops : bad_batches) {
    auto id = h.t().Post(h.MakeBatch(peer, ops, 20, false));
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << id.status();
  }
  CopyOp strided_oob;
  strided_oob.shape = {10, 10};
  strided_oob.element_size = 4;
  strided_oob.src = {{}, 0, {10, 1}};
  strided_oob.dst = {{}, 0, {kSize / 4 / 9, 1}};
  auto id = h.t().Post(h.MakeBatch(peer, {{true, Contig(0, 0, 64, 4)}, {true, strided_oob}}, 21, false));
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(id.status().message().find("op 1"), std::string::npos) << id.status();
  EXPECT_EQ(h.Verify(peer, {}), "") << "a rejected batch wrote bytes";
}

TEST_P(TransportConformanceTest, DescriptorFromWrongPeerOrGarbage) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  auto other = h.StartPeer(kSize);
  ASSERT_TRUE(other.ok()) << other.status();
  // A batch for `peer` that names `other`'s region.
  Batch b = h.MakeBatch(peer, {{true, Contig(0, 0, 64, 4)}}, 30, false);
  b.ops.push_back(b.ops[0]);
  b.ops[1].dst.region = other->remote;
  auto id = h.t().Post(b);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << id.status();
  EXPECT_EQ(h.Verify(peer, {}), "");
  EXPECT_EQ(h.Verify(*other, {}), "");
  // Bytes that are not a descriptor.
  EXPECT_EQ(h.t().ImportDescriptor("definitely not a descriptor").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.t().ImportDescriptor("").status().code(), absl::StatusCode::kInvalidArgument);
  // Same-node transports refuse descriptors from another node.
  if (!h.t().capabilities().cross_node) {
    auto far = PeerProcess::Spawn(GetParam().peer_binary,
                                  {"--kind=" + GetParam().kind, std::string("--memory=") + MemoryKindName(GetParam().memory),
                                   "--size=4096", "--seed=1", "--node_id=some-other-node"});
    ASSERT_TRUE(far.ok());
    auto desc = (*far)->Command("DESC");
    ASSERT_TRUE(desc.ok()) << desc.status();
    auto imported = h.t().ImportDescriptor(*HexDecode(*desc));
    EXPECT_EQ(imported.status().code(), absl::StatusCode::kInvalidArgument) << imported.status();
  }
}

TEST_P(TransportConformanceTest, ChecksumMismatchDetected) {
  SKIP_WITHOUT_GPU();
  Harness h(GetParam());
  ASSERT_TRUE(h.Init(kSize, /*corrupt=*/true).ok());
  if (!h.t().capabilities().checksums) {
    GTEST_SKIP() << GetParam().kind << " has no checksums";
  }
  auto peer = h.StartPeer(kSize);
  ASSERT_TRUE(peer.ok()) << peer.status();
  std::vector<TOp> ops = {{true, Contig(0, 0, 1 << 18, 4)}};
  const absl::Time start = absl::Now();
  absl::Status s = h.Run(*peer, ops, 40, true, absl::Seconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

TEST_P(TransportConformanceTest, ChecksumMismatchDetectedWhenPeerCorrupts) {
  SKIP_WITHOUT_GPU();
  Harness h(GetParam());
  ASSERT_TRUE(h.Init(kSize).ok());
  if (!h.t().capabilities().checksums || !h.t().capabilities().two_sided) {
    GTEST_SKIP() << "only two-sided transports have a remote sender";
  }
  // A peer spawned with --corrupt corrupts what it sends.
  auto proc = h.StartPeer(kSize, {"--corrupt"});
  ASSERT_TRUE(proc.ok()) << proc.status();
  std::vector<TOp> ops = {{false, Contig(0, 0, 1 << 18, 4)}};
  absl::Status s = h.Run(*proc, ops, 41, true, absl::Seconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
}

TEST_P(TransportConformanceTest, MissingMirrorHitsDeadline) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  if (!h.two_sided()) {
    GTEST_SKIP() << "one-sided transports need no mirror";
  }
  auto id = h.t().Post(h.MakeBatch(peer, {{true, Contig(0, 0, kSize, 1)}}, 60, false));
  ASSERT_TRUE(id.ok());
  const absl::Time start = absl::Now();
  absl::Status s = h.t().Wait(*id, start + absl::Milliseconds(500));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(h.t().Poll(*id).status().code(), absl::StatusCode::kNotFound) << "Wait retires the batch";
}

TEST_P(TransportConformanceTest, RegionInUseCannotBeReleased) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  std::vector<TOp> ops = {{true, Contig(0, 0, 1024, 4)}};
  if (h.two_sided()) {
    ASSERT_TRUE(h.PostMirror(peer, ops, 70, false).ok());
  }
  auto id = h.t().Post(h.MakeBatch(peer, ops, 70, false));
  ASSERT_TRUE(id.ok()) << id.status();
  absl::Status early = h.t().Release(h.local_region());
  absl::Status s = h.t().Wait(*id, absl::Now() + absl::Seconds(30));
  EXPECT_TRUE(s.ok()) << s;
  // Either the batch had already finished (release allowed) or release was refused.
  if (!early.ok()) {
    EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition) << early;
    EXPECT_TRUE(h.t().Release(h.local_region()).ok());
  }
  EXPECT_EQ(h.t().Release(h.local_region()).code(), absl::StatusCode::kNotFound);
}

// CancelBatches(G) ends G's batches promptly with CANCELLED and leaves the channel and the other
// batches on it alone: a batch of group 7 whose mirror the peer never posts (host_tcp: its frames
// hold the peer's connections) is cancelled while a batch of group 8, posted after it, still runs;
// that one completes byte for byte, a later Post in group 7 is refused, and the channel carries a
// new batch both ways. A transport without the capability says UNIMPLEMENTED and leaves a batch of
// the group to complete as before (the caller disconnects instead).
TEST_P(TransportConformanceTest, CancelBatchesEndsOneGroupAndLeavesTheChannel) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  if (!h.t().capabilities().cancel_batches) {
    EXPECT_EQ(h.t().CancelBatches(1, "test").code(), absl::StatusCode::kUnimplemented);
    const std::vector<TOp> ops = {{true, Contig(0, 0, 1024, 4)}, {false, Contig(kSize / 2, kSize / 2, 1024, 4)}};
    absl::Status s = h.Run(peer, ops, 80, true, absl::Seconds(30), /*group=*/1);
    ASSERT_TRUE(s.ok()) << "a group whose cancel was refused must run as before: " << s;
    EXPECT_EQ(h.Verify(peer, ops), "");
    return;
  }
  EXPECT_EQ(h.t().CancelBatches(0, "test").code(), absl::StatusCode::kInvalidArgument) << "group 0 is no group";
  const std::vector<TOp> aborted = {{true, Contig(0, 0, kSize / 2, 1)}};  // never mirrored
  const std::vector<TOp> sibling = {{true, Contig(kSize / 2, kSize / 2, kSize / 4, 1)},
                                    {false, Contig(3 * kSize / 4, 3 * kSize / 4, kSize / 4, 1)}};  // sources never overlap destinations
  absl::StatusOr<BatchId> a = h.t().Post(h.MakeBatch(peer, aborted, 80, false, /*group=*/7));
  ASSERT_TRUE(a.ok()) << a.status();
  auto mirror = h.PostMirror(peer, sibling, 81, true, /*group=*/99);
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  ASSERT_TRUE(peer.proc->Send(absl::StrCat("WAIT ", *mirror, " 30000")).ok());
  absl::StatusOr<BatchId> b = h.t().Post(h.MakeBatch(peer, sibling, 81, true, /*group=*/8));
  ASSERT_TRUE(b.ok()) << b.status();
  const absl::Time start = absl::Now();
  ASSERT_TRUE(h.t().CancelBatches(7, "version 3 aborted").ok());
  absl::Status sa = h.t().Wait(*a, start + absl::Seconds(30));
  EXPECT_EQ(sa.code(), absl::StatusCode::kCancelled) << sa;
  EXPECT_NE(sa.message().find("version 3 aborted"), std::string::npos) << sa;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the cancelled batch waited for its deadline";
  absl::Status sb = h.t().Wait(*b, start + absl::Seconds(30));
  EXPECT_TRUE(sb.ok()) << "the other group's batch on the channel: " << sb;
  auto peer_b = peer.proc->Reply(absl::Seconds(40));
  EXPECT_TRUE(peer_b.ok()) << "the peer's mirror of the other group's batch: " << peer_b.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(h.Verify(peer, sibling), "") << "the cancelled batch wrote bytes, or the other one did not land";
  absl::StatusOr<BatchId> late = h.t().Post(h.MakeBatch(peer, aborted, 82, false, /*group=*/7));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kCancelled) << "a Post in a cancelled group";
  const std::vector<TOp> after = {{true, Contig(kSize / 4, 0, 4096, 4)}, {false, Contig(kSize / 4, 0, 4096, 4)}};
  absl::Status s = h.Run(peer, after, 83, true, absl::Seconds(30), /*group=*/8);
  ASSERT_TRUE(s.ok()) << "the channel after the cancel: " << s;
  std::vector<TOp> all = sibling;
  all.insert(all.end(), after.begin(), after.end());
  EXPECT_EQ(h.Verify(peer, all), "");
}

// A cancel reaches the peer: its mirror of a cancelled batch ends too (CANCELLED, or OK when it had
// completed first), well before its deadline; a batch the peer cancels whose mirror this side never
// posted ends there although its frames reached this side (dropped here), and a Post of that mirror
// here is refused; the channel carries bytes both ways after both cancels.
TEST_P(TransportConformanceTest, CancelBatchesEndsThePeersMirror) {
  SKIP_WITHOUT_GPU();
  SETUP_OR_FAIL(h, kSize, kSize, peer);
  if (!h.t().capabilities().cancel_batches || !h.two_sided()) {
    GTEST_SKIP() << GetParam().kind
                 << " cannot cancel a group of batches, or has no mirrors (CancelBatchesEndsOneGroupAndLeavesTheChannel)";
  }
  // Batch 91, this side's group 9, cancelled right after it was posted (its bytes on their way).
  const std::vector<TOp> sent = {{true, Contig(0, 0, kSize / 2, 1)}};
  auto y = h.PostMirror(peer, sent, 91, true);
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_TRUE(peer.proc->Send(absl::StrCat("WAIT ", *y, " 30000")).ok());
  absl::StatusOr<BatchId> mine = h.t().Post(h.MakeBatch(peer, sent, 91, true, /*group=*/9));
  ASSERT_TRUE(mine.ok()) << mine.status();
  absl::Time start = absl::Now();
  ASSERT_TRUE(h.t().CancelBatches(9, "aborted here").ok());
  absl::Status s = h.t().Wait(*mine, start + absl::Seconds(30));
  EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kCancelled) << s;
  auto theirs = peer.proc->Reply(absl::Seconds(40));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the peer's mirror waited for its deadline";
  EXPECT_TRUE(theirs.ok() || theirs.status().code() == absl::StatusCode::kCancelled) << theirs.status();
  if (s.ok()) {
    EXPECT_TRUE(theirs.ok()) << "completed here, cancelled there: " << theirs.status();
  }
  // The peer's batch 90 (its group 5), never posted here, cancelled there: it ends although its
  // frames came here.
  const std::vector<TOp> unmirrored = {{false, Contig(0, 0, kSize / 2, 1)}};
  auto x = h.PostMirror(peer, unmirrored, 90, false, /*group=*/5);
  ASSERT_TRUE(x.ok()) << x.status();
  start = absl::Now();
  ASSERT_TRUE(peer.proc->Command("CANCEL_GROUP 5").ok());
  auto xs = peer.proc->Command(absl::StrCat("WAIT ", *x, " 30000"), absl::Seconds(40));
  EXPECT_EQ(xs.status().code(), absl::StatusCode::kCancelled) << xs.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the peer's cancelled batch waited for its deadline";
  // Fresh contents, then a batch both ways on the same channel.
  ASSERT_TRUE(h.local().Fill(kLocalSeed).ok());
  ASSERT_TRUE(peer.proc->Command(absl::StrCat("FILL ", kPeerSeed)).ok());
  const std::vector<TOp> after = {{true, Contig(kSize / 4, 0, 4096, 4)}, {false, Contig(kSize / 2, 0, 4096, 4)}};
  absl::Status again = h.Run(peer, after, 92, true, absl::Seconds(30));
  ASSERT_TRUE(again.ok()) << "the channel after both cancels: " << again;
  EXPECT_EQ(h.Verify(peer, after), "");
  // (Batch 92 completed, so this side has heard of the peer's cancel of 90, sent before it.)
  absl::StatusOr<BatchId> late = h.t().Post(h.MakeBatch(peer, unmirrored, 90, false));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kCancelled) << "the mirror of a batch the peer cancelled";
  if (late.ok()) (void)h.t().Wait(*late, absl::Now());
}

// An attempt's Connect of one side's, abandoned: started in round A on `local` (this process) or
// the peer, for `timeout`. Result(t) as LocalAsyncConnect's; Cancel() is that side's CancelRound.
class AbandonedConnect {
 public:
  AbandonedConnect(Transport& t, Peer& peer, bool local, const std::string& round, absl::Duration timeout)
      : t_(t), peer_(peer), local_(local), round_(round) {
    if (local_) {
      local_connect_.emplace(t, peer.peer_ep, round, timeout);
    } else {
      started_ = peer.proc->Command(absl::StrCat("CONNECT_ASYNC ", HexEncode(peer.my_ep), " ", HexEncode(round), " ",
                                                 absl::ToInt64Milliseconds(timeout)))
                     .status();
    }
  }
  absl::Status started() const { return started_; }
  std::optional<absl::StatusOr<PeerId>> Result(absl::Duration timeout) {
    if (local_) return local_connect_->Result(timeout);
    auto r = peer_.proc->Command(absl::StrCat("CONNECT_RESULT ", absl::ToInt64Milliseconds(timeout)),
                                 timeout + absl::Seconds(10));
    if (r.ok() && *r == "RUNNING") return std::nullopt;
    if (!r.ok()) return absl::StatusOr<PeerId>(r.status());
    uint64_t id = 0;
    if (!absl::SimpleAtoi(*r, &id)) return absl::StatusOr<PeerId>(absl::InternalError("bad CONNECT_RESULT " + *r));
    return absl::StatusOr<PeerId>(PeerId{id});
  }
  absl::Status Cancel() {
    if (local_) return t_.CancelRound(round_);
    return peer_.proc->Command("CANCEL_ROUND " + HexEncode(round_)).status();
  }
  // A later Connect of the round on the same side.
  absl::StatusOr<PeerId> ConnectAgain(absl::Duration timeout) {
    if (local_) return t_.Connect(peer_.peer_ep, round_, absl::Now() + timeout);
    auto r = peer_.proc->Command(absl::StrCat("CONNECT_ROUND ", HexEncode(peer_.my_ep), " ", HexEncode(round_), " ",
                                              absl::ToInt64Milliseconds(timeout)),
                                 timeout + absl::Seconds(10));
    if (!r.ok()) return r.status();
    return PeerId{1};
  }

 private:
  Transport& t_;
  Peer& peer_;
  const bool local_;
  const std::string round_;
  absl::Status started_;
  std::optional<LocalAsyncConnect> local_connect_;
};

// How long an abandoned Connect is given to show that it waits for its peer (a Connect that needs
// none - one-sided transports, host_tcp's dialer - returns within it).
constexpr absl::Duration kStillWaiting = absl::Milliseconds(300);

// The chaos-run stall (docs/transport.md, "host_tcp channel setup: rounds"): one side's Connect of
// round A is abandoned (its version aborted) and keeps waiting; the next attempt, round B, connects
// both sides and moves bytes both ways, and the round-A Connect takes nothing of it: it still
// waits after round B moved its bytes, and ends CANCELLED when its round is cancelled.
TEST_P(TransportConformanceTest, AbandonedConnectLeavesTheNextRoundAlone) {
  SKIP_WITHOUT_GPU();
  if (GetParam().kind == "nccl") {
    GTEST_SKIP() << "nccl pairs by the unique id of the endpoint, not by round: an abandoned rank-1 Connect can meet "
                    "rank 0 of the next attempt unless its round is cancelled first (docs/transport.md, \"nccl\")";
  }
  for (bool local_abandons : {false, true}) {
    SCOPED_TRACE(local_abandons ? "this process abandons round A" : "the peer abandons round A");
    Harness h(GetParam());
    ASSERT_TRUE(h.Init(kSize).ok());
    auto peer = h.PreparePeer(kSize);
    ASSERT_TRUE(peer.ok()) << peer.status();
    const std::string a = "conformance round A", b = "conformance round B";
    AbandonedConnect abandoned(h.t(), *peer, local_abandons, a, absl::Seconds(30));
    ASSERT_TRUE(abandoned.started().ok()) << abandoned.started();
    std::optional<absl::StatusOr<PeerId>> early = abandoned.Result(kStillWaiting);
    const bool waits = !early.has_value();
    if (!waits) {
      EXPECT_TRUE(early->ok()) << "a Connect that needs no peer: " << early->status();
    }
    if (h.two_sided() && GetParam().kind != "host_tcp") {
      EXPECT_TRUE(waits) << "a two-sided Connect waits for its peer";
    }

    absl::Status b_connected = h.ConnectInRound(*peer, b, absl::Seconds(15));
    ASSERT_TRUE(b_connected.ok()) << "round B: " << b_connected;
    std::vector<TOp> ops = {{true, Contig(0, 4096, (1 << 20) / 4, 4)}, {false, Contig(2 << 20, 1 << 20, 100000, 1)}};
    absl::Status moved = h.Run(*peer, ops, 80, true, absl::Seconds(20));
    ASSERT_TRUE(moved.ok()) << "round B: " << moved;
    EXPECT_EQ(h.Verify(*peer, ops), "");

    if (waits) {
      EXPECT_FALSE(abandoned.Result(absl::ZeroDuration()).has_value())
          << "the abandoned round-A Connect returned while round B connected: it took round B's channel";
    }
    const absl::Time cancelled = absl::Now();
    ASSERT_TRUE(abandoned.Cancel().ok());
    std::optional<absl::StatusOr<PeerId>> end = abandoned.Result(absl::Seconds(10));
    ASSERT_TRUE(end.has_value()) << "the round-A Connect did not end after CancelRound";
    if (waits) {
      EXPECT_EQ(end->status().code(), absl::StatusCode::kCancelled) << end->status();
      EXPECT_LT(absl::Now() - cancelled, absl::Seconds(5));
    }
  }
}

// CancelRound(R) wakes a Connect of R waiting for its peer (well before its deadline) with
// CANCELLED naming R, and every later Connect of R on that side fails the same way at once.
TEST_P(TransportConformanceTest, CancelRoundWakesAWaitingConnect) {
  SKIP_WITHOUT_GPU();
  // One pair for both sides, so that each role of a transport whose sides differ (host_tcp: the
  // dialer's Connect needs no peer, the acceptor's waits) is exercised.
  Harness h(GetParam());
  ASSERT_TRUE(h.Init(kSize).ok());
  auto peer = h.PreparePeer(kSize);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(h.t().CancelRound("").code(), absl::StatusCode::kInvalidArgument) << "the empty round names no attempt";
  bool woken = false;
  for (bool local : {false, true}) {
    SCOPED_TRACE(local ? "this process's Connect" : "the peer's Connect");
    const std::string round = local ? "conformance round C local" : "conformance round C peer";
    AbandonedConnect waiting(h.t(), *peer, local, round, absl::Seconds(30));
    ASSERT_TRUE(waiting.started().ok()) << waiting.started();
    std::optional<absl::StatusOr<PeerId>> early = waiting.Result(kStillWaiting);
    const absl::Time cancelled = absl::Now();
    ASSERT_TRUE(waiting.Cancel().ok());
    if (!early.has_value()) {
      std::optional<absl::StatusOr<PeerId>> end = waiting.Result(absl::Seconds(10));
      ASSERT_TRUE(end.has_value()) << "CancelRound did not wake the waiting Connect";
      EXPECT_EQ(end->status().code(), absl::StatusCode::kCancelled) << end->status();
      EXPECT_NE(end->status().message().find(round), std::string::npos) << end->status();
      EXPECT_LT(absl::Now() - cancelled, absl::Seconds(5)) << "woken late (the deadline is 30 s)";
      woken = true;
    } else {
      EXPECT_TRUE(early->ok()) << "a Connect that needs no peer: " << early->status();
    }
    const absl::Time again = absl::Now();
    absl::StatusOr<PeerId> later = waiting.ConnectAgain(absl::Seconds(20));
    EXPECT_EQ(later.status().code(), absl::StatusCode::kCancelled) << later.status();
    EXPECT_NE(later.status().message().find(round), std::string::npos) << later.status();
    EXPECT_LT(absl::Now() - again, absl::Seconds(5)) << "a Connect of a cancelled round must fail at once";
  }
  if (h.two_sided()) {
    EXPECT_TRUE(woken) << "no side's Connect waited for its peer";
  }
}

// Last on purpose (gtest runs a file's tests in order): on a GPU, a copy that touches the memory of
// a process killed mid-transfer may raise a sticky CUDA error (e.g. cudaErrorIllegalAddress) that
// leaves this test process's CUDA context unusable; as the last test it cannot take others down.
TEST_P(TransportConformanceTest, PeerKilledMidTransferFailsWithinDeadline) {
  SKIP_WITHOUT_GPU();
  const int64_t big = GetParam().large_op_bytes;
  for (bool send : {true, false}) {
    SETUP_OR_FAIL(h, big, big, peer);
    std::vector<TOp> ops = {{send, Contig(0, 0, big, 1)}};
    // Two-sided: the peer posts its mirror for the receive direction only; either way it is
    // killed right after the transfer started and never finishes.
    if (h.two_sided() && !send) {
      ASSERT_TRUE(h.PostMirror(peer, ops, 50, false).ok());
    }
    auto shm_name = peer.proc->Command("NAME");  // a killed peer cannot unlink its segment: we do
    auto id = h.t().Post(h.MakeBatch(peer, ops, 50, false));
    ASSERT_TRUE(id.ok()) << id.status();
    peer.proc->Kill9();
    if (shm_name.ok() && !shm_name->empty()) (void)ShmSegment::Unlink(*shm_name);
    const absl::Time start = absl::Now();
    const absl::Duration deadline = absl::Seconds(15);
    absl::Status s = h.t().Wait(*id, start + deadline);
    EXPECT_LT(absl::Now() - start, deadline + absl::Seconds(2)) << "Wait overran its deadline";
    if (h.two_sided()) {
      EXPECT_FALSE(s.ok()) << "send=" << send;
      EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_LT(absl::Now() - start, deadline) << "vanished peer should be noticed before the deadline";
    } else if (!s.ok()) {
      // One-sided transports may finish from memory that outlives the process; if not, a clear error.
      EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kInternal) << s;
    }
  }
}

}  // namespace
}  // namespace wb::transport
