#include "transport/testing/fake_transport.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "transport/registry.h"
#include "transport/strided.h"

namespace wb::transport::testing {
namespace {

constexpr absl::string_view kEndpointMagic = "WBFAKE1-EP";
constexpr absl::string_view kDescMagic = "WBFAKE1-DESC";
constexpr int64_t kChunk = int64_t{1} << 20;  // copies check for cancellation this often
// How long a cancelled or failed batch may wait for the fabric's copy thread to let go of its
// memory (a chunk is 1 MiB, so this is never reached unless the machine is frozen).
constexpr absl::Duration kStopBound = absl::Seconds(10);

// Which bytes a side of an op names, independent of who looks: (owner instance, owner's region id).
struct RegionKey {
  std::string owner;
  uint64_t region = 0;
  friend bool operator==(const RegionKey& a, const RegionKey& b) { return a.owner == b.owner && a.region == b.region; }
};

struct Region {
  bool local = true;
  uint8_t* base = nullptr;
  int64_t size = 0;
  std::string label;
  RegionKey key;        // for imports: the exporter's region
  PeerId peer = kNoPeer;  // imports: our peer id of the exporter when connected
};

struct Match;

// One side's posted batch.
struct Half {
  std::string poster, peer;  // instances
  uint64_t id = 0, tag = 0;
  bool checksum = false;
  struct Op {
    CopyOp op;  // as posted (region handles are the poster's)
    OpLayout layout;
    RegionKey src, dst;
    bool src_local = true;
    uint8_t* src_base = nullptr;
    uint8_t* dst_base = nullptr;
  };
  std::vector<Op> ops;
  std::set<uint64_t> regions;  // poster's handles referenced
  int64_t bytes = 0;
  bool done = false;
  absl::Status status;
  // Weak: the Match owns both halves, so a strong pointer back would be a cycle that keeps every
  // matched batch alive forever (LeakSanitizer). The queue, and the copy thread while it runs,
  // own the Match; once it is done nothing needs it.
  std::weak_ptr<Match> match;
};

struct Match {
  std::shared_ptr<Half> a, b;  // a = first poster, b = second
  std::atomic<bool> cancel{false};
  bool running = false;  // the copy thread holds pointers into a's and b's memory
  int64_t link_bps = 0;
  bool corrupt_a = false, corrupt_b = false;
};

struct Node {
  FakeOptions opts;
  std::map<uint64_t, Region> regions;
  uint64_t next_region = 1;
  std::map<uint64_t, std::shared_ptr<Half>> batches;  // not yet retired
  uint64_t next_batch = 1;
  std::map<uint64_t, std::string> peers;  // peer id -> instance
  uint64_t next_peer = 1;
  TransportStats stats;
};

std::string NewInstanceId(const std::string& node) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return absl::StrCat("fake-", node, "-", counter.fetch_add(1), "-", absl::Hex(rd()));
}

std::pair<std::string, std::string> Pair(const std::string& a, const std::string& b) {
  return a < b ? std::make_pair(a, b) : std::make_pair(b, a);
}

}  // namespace

class FakeFabric::Impl {
 public:
  Impl() : worker_([this] { Work(); }) {}
  ~Impl() {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    worker_.join();
  }

  // ---- transports ----
  void Add(const std::string& inst, const FakeOptions& o) {
    absl::MutexLock l(&mu_);
    nodes_[inst].opts = o;
  }
  void Remove(const std::string& inst) {
    absl::MutexLock l(&mu_);
    VanishLocked(inst, "was destroyed");
    AwaitStoppedLocked([&](const Match& m) { return m.a->poster == inst || m.b->poster == inst; });
    nodes_.erase(inst);
    vanished_.erase(inst);
    cancelled_.erase(inst);
  }
  int Live() const {
    absl::MutexLock l(&mu_);
    return static_cast<int>(nodes_.size());
  }

  void Vanish(absl::string_view inst) {
    absl::MutexLock l(&mu_);
    VanishLocked(std::string(inst), "vanished");
  }
  void FailNext(absl::string_view inst, absl::Status s, int n) {
    absl::MutexLock l(&mu_);
    for (int i = 0; i < n; ++i) fail_next_[std::string(inst)].push_back(s);
  }

  // ---- peers ----
  // Both sides meet only in the same round (transport.h): a Connect left waiting by an abandoned
  // attempt does not pair with the peer's Connect of the next one.
  absl::StatusOr<PeerId> Connect(const std::string& me, absl::string_view endpoint, absl::string_view round_view,
                                 absl::Time deadline) {
    if (round_view.size() > kMaxConnectRoundBytes) {
      return absl::InvalidArgumentError(absl::StrCat("fake: a connection round of ", round_view.size(), " bytes (at most ",
                                                     kMaxConnectRoundBytes, ")"));
    }
    const std::string round(round_view);
    std::vector<std::string> w = absl::StrSplit(endpoint, ' ');
    if (w.size() != 3 || w[0] != kEndpointMagic) return absl::InvalidArgumentError("fake: not a fake endpoint");
    const std::string& them = w[1];
    if (w[2] != me) {
      return absl::InvalidArgumentError(absl::StrCat("fake: endpoint of ", them, " was exported for ", w[2], ", not for ", me));
    }
    absl::MutexLock l(&mu_);
    if (auto s = UsableLocked(me); !s.ok()) return s;
    auto cancelled = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      auto c = cancelled_.find(me);
      return c != cancelled_.end() && c->second.Has(round);
    };
    if (cancelled()) return CancelledRounds::Error("fake", them, round);
    want_.insert({me, them, round});
    cv_.SignalAll();  // the peer may be waiting for this side's Connect
    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return want_.count({them, me, round}) > 0 || !nodes_.count(them) || vanished_.count(them) > 0 ||
             vanished_.count(me) > 0 || cancelled();
    };
    while (!ready()) {
      if (cv_.WaitWithDeadline(&mu_, deadline) && !ready()) {
        want_.erase({me, them, round});
        return absl::DeadlineExceededError(absl::StrCat("fake: peer ", them, " did not connect to ", me, " in time (round '",
                                                        round, "')"));
      }
    }
    if (cancelled()) {
      want_.erase({me, them, round});
      return CancelledRounds::Error("fake", them, round);
    }
    if (auto s = UsableLocked(me); !s.ok()) return s;
    if (!nodes_.count(them) || vanished_.count(them)) {
      want_.erase({me, them, round});
      return absl::UnavailableError(absl::StrCat("fake: peer ", them, " is gone"));
    }
    broken_.erase(Pair(me, them));
    Node& n = nodes_[me];
    for (const auto& [id, inst] : n.peers) {
      if (inst == them) return PeerId{id};
    }
    const uint64_t id = n.next_peer++;
    n.peers[id] = them;
    for (auto& [rid, r] : n.regions) {
      if (!r.local && r.key.owner == them) r.peer = PeerId{id};
    }
    return PeerId{id};
  }

  // Its waiting Connects wake (they check cancelled_), later ones fail at once.
  absl::Status CancelRound(const std::string& me, absl::string_view round) {
    if (absl::Status s = CancelledRounds::Check("fake", round); !s.ok()) return s;
    absl::MutexLock l(&mu_);
    cancelled_[me].Add(round);
    cv_.SignalAll();
    return absl::OkStatus();
  }

  absl::Status Disconnect(const std::string& me, PeerId peer) {
    absl::MutexLock l(&mu_);
    Node& n = nodes_[me];
    auto it = n.peers.find(peer.id);
    if (it == n.peers.end()) return absl::NotFoundError(absl::StrCat("fake: no peer ", peer.id));
    const std::string them = it->second;
    n.peers.erase(it);
    BreakLocked(me, them, absl::StrCat("fake: ", me, " disconnected from ", them));
    return absl::OkStatus();
  }

  // ---- memory ----
  absl::StatusOr<RegionHandle> Register(const std::string& me, const MemorySpec& spec) {
    if (spec.kind != MemoryKind::kHost) return absl::InvalidArgumentError("fake: host memory only");
    if (spec.size_bytes < 0 || (spec.base == nullptr && spec.size_bytes > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("fake: bad memory spec for ", spec.label));
    }
    absl::MutexLock l(&mu_);
    if (auto s = UsableLocked(me); !s.ok()) return s;
    Node& n = nodes_[me];
    const uint64_t id = n.next_region++;
    n.regions[id] = Region{true, static_cast<uint8_t*>(spec.base), spec.size_bytes, spec.label, RegionKey{me, id}, kNoPeer};
    return RegionHandle{id};
  }

  absl::StatusOr<std::string> Export(const std::string& me, RegionHandle h) {
    absl::MutexLock l(&mu_);
    Node& n = nodes_[me];
    auto it = n.regions.find(h.id);
    if (it == n.regions.end() || !it->second.local) {
      return absl::NotFoundError(absl::StrCat("fake: no local region ", h.id));
    }
    return absl::StrCat(kDescMagic, " ", me, " ", h.id, " ", it->second.size);
  }

  absl::StatusOr<RegionHandle> Import(const std::string& me, absl::string_view desc) {
    std::vector<std::string> w = absl::StrSplit(desc, ' ');
    uint64_t rid = 0;
    int64_t size = 0;
    if (w.size() != 4 || w[0] != kDescMagic || !absl::SimpleAtoi(w[2], &rid) || !absl::SimpleAtoi(w[3], &size)) {
      return absl::InvalidArgumentError("fake: not a fake region descriptor");
    }
    absl::MutexLock l(&mu_);
    if (auto s = UsableLocked(me); !s.ok()) return s;
    auto owner = nodes_.find(w[1]);
    if (owner == nodes_.end() || vanished_.count(w[1])) {
      return absl::InvalidArgumentError(absl::StrCat("fake: descriptor names transport ", w[1], ", which is gone"));
    }
    auto r = owner->second.regions.find(rid);
    if (r == owner->second.regions.end() || !r->second.local || r->second.size != size) {
      return absl::InvalidArgumentError(absl::StrCat("fake: descriptor names no region ", rid, " of size ", size, " of ", w[1]));
    }
    Node& n = nodes_[me];
    PeerId peer = kNoPeer;
    for (const auto& [pid, inst] : n.peers) {
      if (inst == w[1]) peer = PeerId{pid};
    }
    const uint64_t id = n.next_region++;
    n.regions[id] = Region{false, r->second.base, size, r->second.label, RegionKey{w[1], rid}, peer};
    return RegionHandle{id};
  }

  absl::StatusOr<RegionInfo> Describe(const std::string& me, RegionHandle h) const {
    absl::MutexLock l(&mu_);
    auto n = nodes_.find(me);
    if (n == nodes_.end()) return absl::UnavailableError("fake: transport gone");
    auto it = n->second.regions.find(h.id);
    if (it == n->second.regions.end()) return absl::NotFoundError(absl::StrCat("fake: no region ", h.id));
    RegionInfo info;
    info.local = it->second.local;
    info.size_bytes = it->second.size;
    info.peer = it->second.peer;
    info.owner_instance = it->second.key.owner;
    info.label = it->second.label;
    return info;
  }

  absl::Status Release(const std::string& me, RegionHandle h) {
    absl::MutexLock l(&mu_);
    Node& n = nodes_[me];
    auto it = n.regions.find(h.id);
    if (it == n.regions.end()) return absl::NotFoundError(absl::StrCat("fake: no region ", h.id));
    for (const auto& [bid, half] : n.batches) {
      const std::shared_ptr<Match> m = half->match.lock();
      const bool busy = !half->done || (m != nullptr && m->running);
      if (busy && half->regions.count(h.id)) {
        return absl::FailedPreconditionError(
            absl::StrCat("fake: region ", h.id, " (", it->second.label, ") is used by unfinished batch tag ", half->tag));
      }
    }
    n.regions.erase(it);
    return absl::OkStatus();
  }

  // ---- copies ----
  absl::StatusOr<BatchId> Post(const std::string& me, const Batch& batch) {
    absl::MutexLock l(&mu_);
    if (auto s = UsableLocked(me); !s.ok()) return s;
    Node& n = nodes_[me];
    auto half = std::make_shared<Half>();
    half->poster = me;
    half->tag = batch.tag;
    half->checksum = batch.checksum;
    if (batch.peer != kNoPeer) {
      auto p = n.peers.find(batch.peer.id);
      if (p == n.peers.end()) return absl::InvalidArgumentError(absl::StrCat("fake: batch tag ", batch.tag, ": unknown peer ", batch.peer.id));
      half->peer = p->second;
    }
    for (size_t i = 0; i < batch.ops.size(); ++i) {
      auto op = ResolveOpLocked(n, batch, static_cast<int>(i), *half);
      if (!op.ok()) return op.status();
      half->bytes += op->op.bytes();
      half->ops.push_back(std::move(*op));
    }
    half->id = n.next_batch++;
    ++n.stats.batches_posted;
    n.batches[half->id] = half;
    if (half->peer.empty()) {  // nothing remote (no ops): done at once
      half->done = true;
      return BatchId{half->id};
    }
    if (broken_.count(Pair(me, half->peer)) || vanished_.count(half->peer) || !nodes_.count(half->peer)) {
      FailLocked(*half, absl::UnavailableError(absl::StrCat("fake: channel to ", half->peer, " is down (reconnect)")));
      return BatchId{half->id};
    }
    const auto mirror_key = std::make_tuple(half->peer, me, batch.tag);
    auto m = unmatched_.find(mirror_key);
    if (m == unmatched_.end()) {
      const auto key = std::make_tuple(me, half->peer, batch.tag);
      if (unmatched_.count(key)) {
        n.batches.erase(half->id);
        return absl::InvalidArgumentError(absl::StrCat("fake: tag ", batch.tag, " already has an unfinished batch to ", half->peer));
      }
      unmatched_[key] = half;
      return BatchId{half->id};
    }
    std::shared_ptr<Half> first = m->second;
    unmatched_.erase(m);
    MatchLocked(first, half);
    return BatchId{half->id};
  }

  absl::StatusOr<BatchState> Poll(const std::string& me, BatchId id) {
    absl::MutexLock l(&mu_);
    Node& n = nodes_[me];
    auto it = n.batches.find(id.id);
    if (it == n.batches.end()) return absl::NotFoundError(absl::StrCat("fake: no batch ", id.id));
    if (!it->second->done) return BatchState::kRunning;
    if (!it->second->status.ok()) return it->second->status;
    return BatchState::kDone;
  }

  absl::Status Wait(const std::string& me, BatchId id, absl::Time deadline) {
    absl::MutexLock l(&mu_);
    Node& n = nodes_[me];
    auto it = n.batches.find(id.id);
    if (it == n.batches.end()) return absl::NotFoundError(absl::StrCat("fake: no batch ", id.id));
    std::shared_ptr<Half> half = it->second;
    while (!half->done) {
      if (cv_.WaitWithDeadline(&mu_, deadline) && !half->done) {
        FailLocked(*half, absl::DeadlineExceededError(absl::StrCat("fake: batch tag ", half->tag, " to ", half->peer,
                                                                   " did not finish by its deadline")));
        // Like closing a TCP connection: the peer's mirror fails, the channel must be re-connected.
        BreakLocked(me, half->peer, absl::StrCat("fake: ", me, " cancelled batch tag ", half->tag));
        break;
      }
    }
    // After Wait returns the transport holds no reference to the batch's memory.
    if (std::shared_ptr<Match> m = half->match.lock(); m != nullptr) {
      AwaitStoppedLocked([&](const Match& x) { return &x == m.get(); });
    }
    unmatched_.erase(std::make_tuple(me, half->peer, half->tag));
    nodes_[me].batches.erase(id.id);
    return half->status;
  }

  TransportStats Stats(const std::string& me) const {
    absl::MutexLock l(&mu_);
    auto n = nodes_.find(me);
    return n == nodes_.end() ? TransportStats{} : n->second.stats;
  }

 private:
  absl::Status UsableLocked(const std::string& me) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (vanished_.count(me)) return absl::UnavailableError(absl::StrCat("fake: transport ", me, " vanished"));
    return absl::OkStatus();
  }

  absl::StatusOr<Half::Op> ResolveOpLocked(Node& n, const Batch& batch, int i, Half& half) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const CopyOp& op = batch.ops[i];
    auto src = n.regions.find(op.src.region.id);
    auto dst = n.regions.find(op.dst.region.id);
    if (src == n.regions.end() || dst == n.regions.end()) {
      return absl::InvalidArgumentError(absl::StrCat("op ", i, ": unknown or released region"));
    }
    if (src->second.local == dst->second.local) {
      return absl::InvalidArgumentError(absl::StrCat("op ", i, ": a two-sided op needs one local and one remote region"));
    }
    const Region& remote = src->second.local ? dst->second : src->second;
    if (remote.key.owner != half.peer) {
      return absl::InvalidArgumentError(absl::StrCat("op ", i, ": region ", remote.label, " was not imported from the batch's peer"));
    }
    auto layout = ValidateOp(op, i, src->second.size, dst->second.size, src->second.label, dst->second.label);
    if (!layout.ok()) return layout.status();
    half.regions.insert(op.src.region.id);
    half.regions.insert(op.dst.region.id);
    return Half::Op{op, std::move(*layout), src->second.key, dst->second.key, src->second.local, src->second.base, dst->second.base};
  }

  // Both halves are posted: check that they mirror each other, then queue the copy.
  void MatchLocked(std::shared_ptr<Half> a, std::shared_ptr<Half> b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto fail_both = [&](const absl::Status& s) {
      FailLocked(*a, s);
      FailLocked(*b, s);
    };
    if (a->ops.size() != b->ops.size()) {
      return fail_both(absl::InvalidArgumentError(
          absl::StrCat("fake: mirror of batch tag ", a->tag, " has ", b->ops.size(), " ops, expected ", a->ops.size())));
    }
    for (size_t i = 0; i < a->ops.size(); ++i) {
      const Half::Op& x = a->ops[i];
      const Half::Op& y = b->ops[i];
      const bool same = x.src == y.src && x.dst == y.dst && x.op.shape == y.op.shape && x.op.element_size == y.op.element_size &&
                        x.op.src.offset_bytes == y.op.src.offset_bytes && x.op.src.strides == y.op.src.strides &&
                        x.op.dst.offset_bytes == y.op.dst.offset_bytes && x.op.dst.strides == y.op.dst.strides;
      if (!same) {
        return fail_both(absl::InvalidArgumentError(
            absl::StrCat("fake: mirror of batch tag ", a->tag, " disagrees at op ", i, " (regions, shape, offsets or strides)")));
      }
    }
    for (const std::shared_ptr<Half>& h : {a, b}) {
      auto f = fail_next_.find(h->poster);
      if (f != fail_next_.end() && !f->second.empty()) {
        absl::Status s = f->second.front();
        f->second.pop_front();
        return fail_both(s);
      }
    }
    auto m = std::make_shared<Match>();
    m->a = a;
    m->b = b;
    m->link_bps = std::max(nodes_[a->poster].opts.link_bytes_per_second, nodes_[b->poster].opts.link_bytes_per_second);
    m->corrupt_a = nodes_[a->poster].opts.corrupt;
    m->corrupt_b = nodes_[b->poster].opts.corrupt;
    a->match = m;
    b->match = m;
    queue_.push_back(m);
  }

  void FailLocked(Half& h, const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (h.done) return;
    h.done = true;
    h.status = s;
    if (std::shared_ptr<Match> m = h.match.lock(); m != nullptr) m->cancel = true;
    auto n = nodes_.find(h.poster);
    if (n != nodes_.end()) ++n->second.stats.batches_failed;
    cv_.SignalAll();
  }

  // Every unfinished batch between `x` and `y` fails UNAVAILABLE; later posts fail until both re-connect.
  void BreakLocked(const std::string& x, const std::string& y, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    broken_.insert(Pair(x, y));
    for (auto it = want_.begin(); it != want_.end();) {
      const auto& [from, to, round] = *it;
      it = Pair(from, to) == Pair(x, y) ? want_.erase(it) : std::next(it);
    }
    for (const std::string& inst : {x, y}) {
      auto n = nodes_.find(inst);
      if (n == nodes_.end()) continue;
      for (auto& [id, h] : n->second.batches) {
        if (h->peer == (inst == x ? y : x)) FailLocked(*h, absl::UnavailableError(why));
      }
    }
    for (auto it = unmatched_.begin(); it != unmatched_.end();) {
      const auto& [p, q, tag] = it->first;
      it = Pair(p, q) == Pair(x, y) ? unmatched_.erase(it) : std::next(it);
    }
    cv_.SignalAll();
  }

  void VanishLocked(const std::string& inst, const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    vanished_.insert(inst);
    const std::string why = absl::StrCat("fake: peer ", inst, " ", what);
    for (auto& [name, node] : nodes_) {
      for (auto& [id, h] : node.batches) {
        if (h->poster == inst || h->peer == inst) FailLocked(*h, absl::UnavailableError(why));
      }
    }
    for (auto it = unmatched_.begin(); it != unmatched_.end();) {
      const auto& [p, q, tag] = it->first;
      it = (p == inst || q == inst) ? unmatched_.erase(it) : std::next(it);
    }
    for (auto it = want_.begin(); it != want_.end();) {
      it = (std::get<0>(*it) == inst || std::get<1>(*it) == inst) ? want_.erase(it) : std::next(it);
    }
    cv_.SignalAll();
  }

  // Waits (bounded) until no running copy satisfies `pred`.
  template <typename Pred>
  void AwaitStoppedLocked(Pred pred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time until = absl::Now() + kStopBound;
    auto busy = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return running_ != nullptr && pred(*running_); };
    while (busy() && !cv_.WaitWithDeadline(&mu_, until)) {
    }
  }

  // The fabric's copy thread: one match at a time, outside the lock, in chunks.
  void Work() {
    for (;;) {
      std::shared_ptr<Match> m;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(
            +[](Impl* self) ABSL_NO_THREAD_SAFETY_ANALYSIS { return self->stop_ || !self->queue_.empty(); }, this));
        if (stop_) return;
        m = queue_.front();
        queue_.pop_front();
        if (m->cancel) continue;
        m->running = true;
        running_ = m;
      }
      absl::Status s = Copy(*m);
      absl::MutexLock l(&mu_);
      m->running = false;
      running_ = nullptr;
      for (const std::shared_ptr<Half>& h : {m->a, m->b}) {
        if (!s.ok()) {
          FailLocked(*h, s);
        } else if (!h->done) {
          h->done = true;
          auto n = nodes_.find(h->poster);
          if (n != nodes_.end()) n->second.stats.bytes_copied += h->bytes;
        }
      }
      cv_.SignalAll();
    }
  }

  absl::Status Copy(Match& m) {
    const absl::Time start = absl::Now();
    int64_t moved = 0;
    const Half& a = *m.a;
    for (size_t i = 0; i < a.ops.size(); ++i) {
      const Half::Op& op = a.ops[i];
      const int64_t total = op.layout.src.total_bytes();
      for (int64_t begin = 0; begin < total; begin += kChunk) {
        if (m.cancel) return absl::CancelledError("fake: copy cancelled");
        const int64_t end = std::min(total, begin + kChunk);
        ForEachCopyPiece(op.layout, begin, end, [&](int64_t so, int64_t dof, int64_t len) {
          std::memmove(op.dst_base + dof, op.src_base + so, len);
        });
        moved += end - begin;
        if (m.link_bps > 0) {  // simulated link: hold the batch until its bytes could have crossed
          const absl::Time due = start + absl::Seconds(static_cast<double>(moved) / m.link_bps);
          absl::MutexLock l(&mu_);
          mu_.AwaitWithDeadline(absl::Condition(
                                    +[](Match* x) { return x->cancel.load(); }, &m),
                                due);
        }
      }
      if (!a.checksum || total == 0) continue;
      // The sender of op i is the side whose source is local; a corrupting sender flips one byte.
      const bool a_sends = op.src_local;
      if (a_sends ? m.corrupt_a : m.corrupt_b) {
        int64_t first = -1;
        ForEachCopyPiece(op.layout, 0, 1, [&](int64_t, int64_t dof, int64_t) { first = dof; });
        if (first >= 0) op.dst_base[first] ^= 0x5a;
      }
      XXH3_state_t* hs = XXH3_createState();
      XXH3_state_t* hd = XXH3_createState();
      XXH3_64bits_reset(hs);
      XXH3_64bits_reset(hd);
      op.layout.src.ForEachPiece(0, total, [&](int64_t off, int64_t, int64_t len) { XXH3_64bits_update(hs, op.src_base + off, len); });
      op.layout.dst.ForEachPiece(0, total, [&](int64_t off, int64_t, int64_t len) { XXH3_64bits_update(hd, op.dst_base + off, len); });
      const bool equal = XXH3_64bits_digest(hs) == XXH3_64bits_digest(hd);
      XXH3_freeState(hs);
      XXH3_freeState(hd);
      if (!equal) return absl::DataLossError(absl::StrCat("fake: checksum mismatch in batch tag ", a.tag, " op ", i));
    }
    return absl::OkStatus();
  }

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> vanished_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::deque<absl::Status>> fail_next_ ABSL_GUARDED_BY(mu_);
  // (from, to, round): Connect called
  std::set<std::tuple<std::string, std::string, std::string>> want_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, CancelledRounds> cancelled_ ABSL_GUARDED_BY(mu_);  // instance -> its CancelRound calls
  std::set<std::pair<std::string, std::string>> broken_ ABSL_GUARDED_BY(mu_);  // channels to re-connect
  std::map<std::tuple<std::string, std::string, uint64_t>, std::shared_ptr<Half>> unmatched_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Match>> queue_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Match> running_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;  // last: starts after every member above exists
};

namespace {

class FakeTransport final : public Transport {
 public:
  FakeTransport(FakeFabric* fabric, FakeOptions o)
      : fabric_(fabric), opts_(std::move(o)), instance_(NewInstanceId(opts_.node_id)) {
    fabric_->impl()->Add(instance_, opts_);
  }
  ~FakeTransport() override { fabric_->impl()->Remove(instance_); }

  Capabilities capabilities() const override {
    Capabilities c;
    c.kind = opts_.kind;
    c.memory_kinds = {MemoryKind::kHost};
    c.same_node = true;
    c.cross_node = true;
    c.two_sided = true;
    c.checksums = true;
    c.native_strides = true;
    return c;
  }
  std::string instance_id() const override { return instance_; }
  absl::StatusOr<std::string> ExportEndpoint(absl::string_view peer) override {
    return absl::StrCat(kEndpointMagic, " ", instance_, " ", peer);
  }
  using Transport::Connect;
  absl::StatusOr<PeerId> Connect(absl::string_view ep, absl::string_view round, absl::Time deadline) override {
    return fabric_->impl()->Connect(instance_, ep, round, deadline);
  }
  absl::Status CancelRound(absl::string_view round) override { return fabric_->impl()->CancelRound(instance_, round); }
  absl::Status Disconnect(PeerId peer) override { return fabric_->impl()->Disconnect(instance_, peer); }
  absl::StatusOr<RegionHandle> RegisterMemory(const MemorySpec& spec) override { return fabric_->impl()->Register(instance_, spec); }
  absl::StatusOr<std::string> ExportDescriptor(RegionHandle r) override { return fabric_->impl()->Export(instance_, r); }
  absl::StatusOr<RegionHandle> ImportDescriptor(absl::string_view d) override { return fabric_->impl()->Import(instance_, d); }
  absl::StatusOr<RegionInfo> Describe(RegionHandle r) const override { return fabric_->impl()->Describe(instance_, r); }
  absl::Status Release(RegionHandle r) override { return fabric_->impl()->Release(instance_, r); }
  absl::StatusOr<BatchId> Post(const Batch& b) override { return fabric_->impl()->Post(instance_, b); }
  absl::StatusOr<BatchState> Poll(BatchId b) override { return fabric_->impl()->Poll(instance_, b); }
  absl::Status Wait(BatchId b, absl::Time deadline) override { return fabric_->impl()->Wait(instance_, b, deadline); }
  TransportStats stats() const override { return fabric_->impl()->Stats(instance_); }

 private:
  FakeFabric* fabric_;
  FakeOptions opts_;
  std::string instance_;
};

}  // namespace

FakeFabric::FakeFabric() : impl_(std::make_unique<Impl>()) {}
FakeFabric::~FakeFabric() = default;

FakeFabric* FakeFabric::Default() {
  static FakeFabric* fabric = new FakeFabric();
  return fabric;
}

void FakeFabric::Vanish(absl::string_view instance) { impl_->Vanish(instance); }
void FakeFabric::FailNextBatches(absl::string_view instance, absl::Status status, int count) {
  impl_->FailNext(instance, std::move(status), count);
}
int FakeFabric::live_transports() const { return impl_->Live(); }

std::unique_ptr<Transport> MakeFakeTransport(const FakeOptions& options) {
  FakeFabric* fabric = options.fabric != nullptr ? options.fabric : FakeFabric::Default();
  return std::make_unique<FakeTransport>(fabric, options);
}

}  // namespace wb::transport::testing
