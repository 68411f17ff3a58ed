#include "daemon/node/delta_exchange.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/delta/codec.h"
#include "daemon/digest/digest.h"
#include "transport/strided.h"

namespace wb::daemon::node {
namespace {

int64_t Align64(int64_t x) { return (x + 63) / 64 * 64; }

absl::StatusOr<transport::StridedLayout> SideLayout(const transport::StridedRef& side, const transport::CopyOp& copy, int64_t region_size) {
  absl::StatusOr<transport::StridedLayout> l = transport::StridedLayout::Make(side.offset_bytes, copy.shape, side.strides, copy.element_size);
  if (!l.ok()) return l.status();
  if (l->total_bytes() > 0 && (l->min_byte() < 0 || l->end_byte() > region_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("box reaches bytes [", l->min_byte(), ", ", l->end_byte(), ") of a region of ", region_size, " bytes"));
  }
  return l;
}

std::string OpWhat(const RouteOp& op, const std::string& label) {
  return absl::StrCat(label, " op ", op.op_index, " (tensor ", op.tensor, ", ", op.src_key, " -> ", op.dst_key, ")");
}

}  // namespace

std::shared_ptr<UninitVector<uint8_t>> DeltaBuffers::Get(const std::string& name, int64_t size) {
  UninitVector<uint8_t> buf;
  {
    absl::MutexLock l(&mu_);
    auto it = free_.find(name);
    if (it != free_.end()) {
      buf = std::move(it->second);
      free_.erase(it);
    }
  }
  if (static_cast<int64_t>(buf.size()) < size) {
    buf = UninitVector<uint8_t>();  // release the smaller one first (no copy of its bytes)
    buf.resize(static_cast<size_t>(size));
  }
  auto* raw = new UninitVector<uint8_t>(std::move(buf));
  return std::shared_ptr<UninitVector<uint8_t>>(raw, [this, name](UninitVector<uint8_t>* b) {
    absl::MutexLock l(&mu_);
    free_[name] = std::move(*b);
    delete b;
  });
}

DeltaLayout LayoutDeltaRegion(const std::vector<int64_t>& out_max, const std::vector<int64_t>& in_max) {
  DeltaLayout l;
  const int64_t n_out = static_cast<int64_t>(out_max.size()), n_in = static_cast<int64_t>(in_max.size());
  l.out_len = 0;
  l.in_len = 8 * n_out;
  l.out_ref = l.in_len + 8 * n_in;
  l.in_ref = l.out_ref + n_out;
  int64_t at = Align64(l.in_ref + n_in);
  for (int64_t m : out_max) {
    l.out_stream.push_back(at);
    at = Align64(at + m);
  }
  for (int64_t m : in_max) {
    l.in_land.push_back(at);
    at = Align64(at + m);
  }
  l.size = at;
  return l;
}

absl::Status PackSide(const uint8_t* region, int64_t region_size, const transport::StridedRef& side, const transport::CopyOp& copy,
                      uint8_t* out) {
  absl::StatusOr<transport::StridedLayout> l = SideLayout(side, copy, region_size);
  if (!l.ok()) return l.status();
  l->ForEachPiece(0, l->total_bytes(), [&](int64_t at, int64_t logical, int64_t len) { std::memcpy(out + logical, region + at, len); });
  return absl::OkStatus();
}

absl::Status UnpackSide(const uint8_t* in, uint8_t* region, int64_t region_size, const transport::StridedRef& side,
                        const transport::CopyOp& copy) {
  absl::StatusOr<transport::StridedLayout> l = SideLayout(side, copy, region_size);
  if (!l.ok()) return l.status();
  l->ForEachPiece(0, l->total_bytes(), [&](int64_t at, int64_t logical, int64_t len) { std::memcpy(region + at, in + logical, len); });
  return absl::OkStatus();
}

DeltaKey KeyOf(const RouteOp& op) { return DeltaKey::Of(op.tensor, op.box, op.copy.element_size, op.delta_variant); }

uint64_t SlotBase(const DeltaOptions& options, const RouteOp& op) {
  auto bv = options.base_versions.find(op.dst_worker);
  if (bv == options.base_versions.end()) return 0;
  if (op.into_shadow && options.without_shadows.count(op.dst_worker) > 0) return 0;
  return bv->second;
}

std::set<std::pair<uint32_t, bool>> DeltaHashedSides(const ExecPlan& plan, const DeltaOptions& options) {
  // As DeltaRun::Make picks slots and ops only cached.
  std::set<std::pair<uint32_t, bool>> out;
  const bool caching = options.cache != nullptr && options.cache->enabled();
  for (const BucketPlan& bucket : plan.buckets) {
    for (const Route& r : bucket.routes) {
      if (r.kind != RouteKind::kPeer) continue;
      for (const RouteOp& op : r.ops) {
        if (!op.delta || op.part != RouteOp::Part::kCanonical) continue;
        const bool slot = SlotBase(options, op) > 0;
        if (op.src_local && (slot || caching)) out.insert({op.op_index, false});
        if (op.dst_local && slot) out.insert({op.op_index, true});
      }
    }
  }
  return out;
}

uint64_t EncodeOp(const RouteOp& op, const uint8_t* src, int64_t src_size, uint64_t version, uint64_t base_version, DeltaCache& cache,
                  absl::Span<uint8_t> out, const std::string& label, std::optional<std::vector<uint64_t>>* unit_hashes) {
  const int elem = op.copy.element_size;
  const int64_t raw = op.copy.bytes();
  absl::StatusOr<transport::StridedLayout> l = SideLayout(op.copy.src, op.copy, src_size);
  if (!l.ok()) return 0;
  // Packs the box into the cache's buffer a codec chunk at a time, each hashed and encoded while it
  // is in cache: one pass over the source (issue 17.2 update time), not a pack and then an encode.
  const delta::FillFn fill = [&](size_t off, absl::Span<uint8_t> dst) {
    l->ForEachPiece(static_cast<int64_t>(off), static_cast<int64_t>(off + dst.size()),
                    [&](int64_t at, int64_t logical, int64_t len) { std::memcpy(dst.data() + (logical - off), src + at, len); });
  };
  // A box that is one run of the source (matching shards: most boxes) is encoded straight from the
  // source, and what the cache keeps of this version is the stream itself (DeltaCache::
  // AddPendingStream: applied to the cached copy in place after the commit, off the critical
  // path): nothing is packed, copied or read back.
  const uint8_t* contiguous = l->num_runs() == 1 && l->total_bytes() == raw ? src + l->RunOffset(0) : nullptr;
  // End-to-end digests' chunk hashes of the packed box: the chunk hashes the codec makes its target
  // digest of (one hash per side, delta::DigestOf).
  std::vector<uint64_t> units;
  std::vector<uint64_t>* want_units = unit_hashes != nullptr ? &units : nullptr;
  const bool codec_elem = elem == 1 || elem == 2 || elem == 4 || elem == 8;
  UninitVector<uint8_t> target;  // the full copy the cache keeps when no stream goes
  uint64_t len = 0;
  std::optional<delta::Digest> digest;
  if (!out.empty() && base_version > 0 && codec_elem) {
    std::shared_ptr<const DeltaEntry> base = cache.Committed(KeyOf(op), base_version);
    if (base != nullptr && static_cast<int64_t>(base->bytes.size()) == raw) {
      delta::EncodeOptions eo;
      eo.elem_size = elem;
      eo.base_digest = base->digest;  // computed when the base was packed: not hashed again
      const std::string what = OpWhat(op, label);
      eo.what = what;
      eo.target_unit_hashes = want_units;
      delta::Digest td;
      if (contiguous != nullptr) {
        absl::StatusOr<size_t> n =
            delta::EncodeInto({base_version, base->bytes}, {version, absl::MakeConstSpan(contiguous, static_cast<size_t>(raw))}, eo, out,
                              nullptr, &td);
        base.reset();  // the cache may apply to it in place once no encoder holds it
        std::vector<uint8_t> stream;
        if (n.ok() && static_cast<int64_t>(*n) < raw) {
          stream = cache.StreamBuffer(*n);
          stream.assign(out.data(), out.data() + *n);
        }
        if (!stream.empty() && cache.AddPendingStream(KeyOf(op), version, base_version, std::move(stream), td)) {
          if (unit_hashes != nullptr) *unit_hashes = std::move(units);
          return *n;
        }
        // Not smaller than the box, or the stream does not fit the cache: the box goes full and
        // the cache keeps a full copy (below).
        units.clear();
      } else {
        target = cache.Buffer(static_cast<size_t>(raw));  // recycled: no first touch; fresh: not zeroed (fully packed over)
        absl::StatusOr<size_t> n = delta::EncodeFilling({base_version, base->bytes}, version, fill, absl::MakeSpan(target), eo, out, &td);
        if (n.ok()) {
          digest = td;
          if (static_cast<int64_t>(*n) < raw) len = *n;
        }  // else refused before packing anything: packed again below
      }
    }
  }
  if (!digest.has_value()) {
    if (target.size() != static_cast<size_t>(raw)) target = cache.Buffer(static_cast<size_t>(raw));
    digest = contiguous != nullptr ? delta::CopyAndDigest(absl::MakeConstSpan(contiguous, static_cast<size_t>(raw)),
                                                          absl::MakeSpan(target), elem, 64 * 1024, {}, want_units)
                                   : delta::FillAndDigest(fill, absl::MakeSpan(target), elem, 64 * 1024, {}, want_units);
  }
  if (unit_hashes != nullptr) *unit_hashes = std::move(units);
  cache.AddPending(KeyOf(op), version, std::move(target), digest, /*packs=*/contiguous == nullptr);
  return len;
}

absl::Status DecodeOp(const RouteOp& op, uint8_t* dst, int64_t dst_size, const std::optional<DeltaBase>& base,
                      absl::Span<const uint8_t> stream, const std::string& label, std::optional<delta::Digest> recorded,
                      delta::Digest* decoded, std::vector<uint64_t>* unit_hashes) {
  const std::string what = OpWhat(op, label);
  if (!base.has_value() || base->data == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("delta for ", what, ": the destination holds no committed copy in host memory"));
  }
  const int64_t raw = op.copy.bytes();
  absl::StatusOr<transport::StridedLayout> l = SideLayout(op.copy.dst, op.copy, dst_size);
  if (!l.ok()) return absl::InvalidArgumentError(absl::StrCat("delta for ", what, ": ", l.status().message()));
  // The base is laid out as the staging as far as the box reaches: the same size for unquantised
  // rollouts; a quantised rollout's live buffers end where its staging's canonical shadows begin.
  if (base->size < l->end_byte()) {
    return absl::FailedPreconditionError(absl::StrCat("delta for ", what, ": the base (", base->what, ", version ", base->version, ") has ",
                                                      base->size, " bytes, the box reaches byte ", l->end_byte()));
  }
  const bool dense = l->num_runs() <= 1;
  std::vector<uint8_t> base_box, out_box;
  absl::Span<const uint8_t> b;
  absl::Span<uint8_t> out;
  if (dense) {
    b = absl::MakeConstSpan(base->data + l->min_byte(), static_cast<size_t>(raw));
    out = absl::MakeSpan(dst + l->min_byte(), static_cast<size_t>(raw));
  } else {
    base_box.resize(static_cast<size_t>(raw));
    out_box.resize(static_cast<size_t>(raw));
    if (absl::Status s = PackSide(base->data, base->size, op.copy.dst, op.copy, base_box.data()); !s.ok()) return s;
    b = base_box;
    out = absl::MakeSpan(out_box);
  }
  // End-to-end digests' chunk hashes of what lands in `dst`: a dense box is staging itself, and the
  // decoder's own chunk hashes of it (those it checked the target digest with) are handed over; a
  // strided one is hashed run by run as the scratch is copied out.
  std::vector<uint64_t>* decoder_units = unit_hashes != nullptr && dense ? unit_hashes : nullptr;
  absl::Status s;
  if (dense && base->data == dst) {
    // The destination still holds the base (a sync commit's staging taken back from the pool,
    // NodeDeltas::For): decoded in place, writing only the changed elements. The base is the
    // node's own memory, which nothing but this decode writes, so a recorded digest is not retried
    // against the bytes: any failure refuses the op (its full copy overwrites the box).
    s = delta::DecodeInPlace(stream, base->version, recorded, out, what, {}, decoder_units);
  } else {
    s = delta::Decode(stream, {base->version, b, recorded}, out, what, {}, decoder_units);
    // A recorded digest is a shortcut, never the judge: on any failure decide on the base itself
    // (a base changed behind the node is refused as "made against ... digest", a bad stream stays
    // DATA_LOSS). A failed attempt hands out no hashes.
    if (!s.ok() && recorded.has_value()) s = delta::Decode(stream, {base->version, b, std::nullopt}, out, what, {}, decoder_units);
  }
  if (!s.ok()) return s;
  if (decoded != nullptr) {
    absl::StatusOr<delta::StreamHeader> h = delta::ReadHeader(stream, what);
    if (!h.ok()) return h.status();
    *decoded = h->target_digest;
  }
  if (!dense) {
    digest::ChunkStreamHasher hasher(op.copy.element_size);
    // `l` was checked against dst_size above.
    l->ForEachPiece(0, l->total_bytes(), [&](int64_t at, int64_t logical, int64_t len) {
      std::memcpy(dst + at, out_box.data() + logical, static_cast<size_t>(len));
      if (unit_hashes != nullptr) hasher.Update(dst + at, static_cast<size_t>(len));
    });
    if (unit_hashes != nullptr) *unit_hashes = hasher.Finish();
  }
  return absl::OkStatus();
}

// ---- DeltaWorkers ----

DeltaWorkers::DeltaWorkers(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Loop(); });
}

DeltaWorkers::~DeltaWorkers() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    encode_.clear();
    decode_.clear();
  }
  for (std::thread& t : threads_) t.join();
}

void DeltaWorkers::Encode(std::function<void()> job) {
  absl::MutexLock l(&mu_);
  encode_.push_back(std::move(job));
}

void DeltaWorkers::Decode(std::function<void()> job) {
  absl::MutexLock l(&mu_);
  decode_.push_back(std::move(job));
}

bool DeltaWorkers::Drain(absl::Time deadline) {
  absl::MutexLock l(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return encode_.empty() && decode_.empty() && running_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

void DeltaWorkers::Loop() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || !encode_.empty() || !decode_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      std::deque<std::function<void()>>& q = decode_.empty() ? encode_ : decode_;
      job = std::move(q.front());
      q.pop_front();
      ++running_;
    }
    job();
    absl::MutexLock l(&mu_);
    --running_;
  }
}

// ---- DeltaRun ----

DeltaRun::DeltaRun(const DeltaOptions& o, uint64_t version, std::string label, HostMemory host)
    : o_(o), version_(version), label_(std::move(label)), host_(std::move(host)) {}

DeltaRun::~DeltaRun() { workers_.reset(); }

absl::StatusOr<std::unique_ptr<DeltaRun>> DeltaRun::Make(const ExecPlan& plan, const DeltaOptions& options, uint64_t version,
                                                         std::string label, HostMemory host) {
  std::unique_ptr<DeltaRun> run(new DeltaRun(options, version, std::move(label), std::move(host)));
  for (uint32_t b = 0; b < plan.buckets.size(); ++b) {
    for (const Route& r : plan.buckets[b].routes) {
      if (r.kind != RouteKind::kPeer) continue;
      for (size_t i = 0; i < r.ops.size(); ++i) {
        const RouteOp& op = r.ops[i];
        if (!op.delta) continue;  // canonical ops, and both parts of sender-quantised ones
        const uint64_t base = SlotBase(options, op);
        if (base == 0) {
          if (op.src_local && options.cache != nullptr && options.cache->enabled()) run->cache_only_.push_back({&op, b});
          continue;
        }
        Peer& p = run->peers_[r.peer];
        p.peer = r.peer;
        p.channel = r.channel;
        Slot s;
        s.route = &r;
        s.pos = i;
        s.op = &op;
        s.base = base;
        s.max = static_cast<int64_t>(delta::MaxEncodedBytes(static_cast<size_t>(op.copy.bytes()), op.copy.element_size));
        std::vector<Slot>& list = op.src_local ? p.out : p.in;
        auto& range = (op.src_local ? p.out_b : p.in_b)[b];
        if (range.first == range.second) range = {list.size(), list.size()};
        list.push_back(s);
        range.second = list.size();
      }
    }
  }
  if (run->peers_.empty() && run->cache_only_.empty()) return std::unique_ptr<DeltaRun>();
  for (auto& [name, p] : run->peers_) {
    std::vector<int64_t> out_max, in_max;
    for (const Slot& s : p.out) out_max.push_back(s.max);
    for (const Slot& s : p.in) in_max.push_back(s.max);
    p.mine = LayoutDeltaRegion(out_max, in_max);
    p.theirs = LayoutDeltaRegion(in_max, out_max);
    const std::string key = "d." + name;
    p.mem = options.buffers != nullptr ? options.buffers->Get(key, p.mine.size)
                                       : std::make_shared<UninitVector<uint8_t>>(static_cast<size_t>(p.mine.size));
    run->stats_.region_bytes += static_cast<uint64_t>(p.mine.size);
    for (const auto& [b, range] : p.out_b) run->encoding_[b] += static_cast<int>(range.second - range.first);
  }
  run->workers_ = std::make_unique<DeltaWorkers>(options.threads);
  return run;
}

std::map<std::string, std::pair<uint8_t*, int64_t>> DeltaRun::Regions() const {
  std::map<std::string, std::pair<uint8_t*, int64_t>> out;
  for (const auto& [name, p] : peers_) out["d." + name] = {p.mem->data(), p.mine.size};
  return out;
}

std::optional<std::pair<uint8_t*, int64_t>> DeltaRun::SourceWhenReady(const RouteOp& op, uint32_t bucket) {
  // A sender-quantised part reads the q staging the node's quantiser is still filling.
  if (op.part != RouteOp::Part::kCanonical && o_.source_ready && !o_.source_ready(bucket).ok()) return std::nullopt;
  return host_(op.src_key);
}

void DeltaRun::EncodeSlot(Peer& p, size_t i) {
  Slot& s = p.out[i];
  const absl::Time t0 = absl::Now();
  uint64_t len = 0;
  std::optional<std::pair<uint8_t*, int64_t>> src = SourceWhenReady(*s.op, s.route->bucket);
  std::optional<std::vector<uint64_t>> units;
  if (src.has_value() && o_.cache != nullptr && o_.cache->enabled()) {
    len = EncodeOp(*s.op, src->first, src->second, version_, s.base, *o_.cache,
                   absl::MakeSpan(p.mem->data() + p.mine.out_stream[i], static_cast<size_t>(s.max)), label_, WantUnits(*s.op) ? &units : nullptr);
  }
  HandUnits(*s.op, false, units);
  s.len = len;
  std::memcpy(p.mem->data() + p.mine.out_len + 8 * static_cast<int64_t>(i), &len, 8);
  absl::MutexLock l(&mu_);
  stats_.encode_s += absl::ToDoubleSeconds(absl::Now() - t0);
  if (len > 0) {
    ++stats_.ops_sent_delta;
    stats_.bytes_sent_stream += len;
    stats_.bytes_sent_raw += static_cast<uint64_t>(s.op->copy.bytes());
  } else {
    ++stats_.ops_sent_full;
    stats_.bytes_sent_full += static_cast<uint64_t>(s.op->copy.bytes());
  }
  ++stats_.cache_candidates;
  --encoding_[s.route->bucket];
}

void DeltaRun::Start() {
  std::map<uint32_t, std::vector<std::pair<Peer*, size_t>>> by_bucket;
  for (auto& [name, p] : peers_) {
    for (const auto& [b, range] : p.out_b) {
      for (size_t i = range.first; i < range.second; ++i) by_bucket[b].push_back({&p, i});
    }
  }
  for (auto& [b, jobs] : by_bucket) {
    // Largest first (LPT): a bucket's lengths go once its last encode is done, and one big box
    // (an embedding) started last would keep the other threads idle while it runs alone.
    std::stable_sort(jobs.begin(), jobs.end(), [](const std::pair<Peer*, size_t>& x, const std::pair<Peer*, size_t>& y) {
      return x.first->out[x.second].op->copy.bytes() > y.first->out[y.second].op->copy.bytes();
    });
    for (auto [p, i] : jobs) workers_->Encode([this, p = p, i = i] { EncodeSlot(*p, i); });
  }
  for (auto [op, b] : cache_only_) {
    workers_->Encode([this, op = op, b = b] {
      std::optional<std::pair<uint8_t*, int64_t>> src = SourceWhenReady(*op, b);
      std::optional<std::vector<uint64_t>> units;
      if (!src.has_value()) {
        HandUnits(*op, false, units);
        return;
      }
      const absl::Time t0 = absl::Now();
      EncodeOp(*op, src->first, src->second, version_, 0, *o_.cache, {}, label_, WantUnits(*op) ? &units : nullptr);
      HandUnits(*op, false, units);
      absl::MutexLock l(&mu_);
      stats_.encode_s += absl::ToDoubleSeconds(absl::Now() - t0);
      ++stats_.cache_candidates;
    });
  }
}

absl::StatusOr<std::vector<DeltaBatchPlan>> DeltaRun::LengthsBatches(uint32_t b, absl::Time deadline) {
  std::vector<DeltaBatchPlan> out;
  {
    absl::MutexLock l(&mu_);
    auto done = [this, b]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      auto it = encoding_.find(b);
      return it == encoding_.end() || it->second <= 0;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(label_, ": encoding the deltas of bucket ", b, " did not finish in time"));
    }
  }
  for (auto& [name, p] : peers_) {
    auto ob = p.out_b.find(b);
    auto ib = p.in_b.find(b);
    if (ob == p.out_b.end() && ib == p.in_b.end()) continue;
    DeltaBatchPlan batch{p.peer, p.channel, LengthsTag(version_, b), {}};
    std::vector<DeltaCopy> sends, receives;
    if (ob != p.out_b.end()) {
      const int64_t i0 = static_cast<int64_t>(ob->second.first), n = static_cast<int64_t>(ob->second.second) - i0;
      sends.push_back({true, "d." + p.peer, "d." + o_.me, p.mine.out_len + 8 * i0, p.theirs.in_len + 8 * i0, 8 * n});
    }
    if (ib != p.in_b.end()) {
      const int64_t j0 = static_cast<int64_t>(ib->second.first), n = static_cast<int64_t>(ib->second.second) - j0;
      receives.push_back({false, "d." + o_.me, "d." + p.peer, p.theirs.out_len + 8 * j0, p.mine.in_len + 8 * j0, 8 * n});
    }
    // One order on both nodes: the lower node id's sends first.
    for (auto* part : Lo(p) ? std::vector{&sends, &receives} : std::vector{&receives, &sends}) {
      for (DeltaCopy& c : *part) batch.copies.push_back(std::move(c));
    }
    out.push_back(std::move(batch));
  }
  return out;
}

absl::Status DeltaRun::LengthsLanded(uint32_t b) {
  for (auto& [name, p] : peers_) {
    auto ib = p.in_b.find(b);
    if (ib == p.in_b.end()) continue;
    for (size_t j = ib->second.first; j < ib->second.second; ++j) {
      uint64_t len = 0;
      std::memcpy(&len, p.mem->data() + p.mine.in_len + 8 * static_cast<int64_t>(j), 8);
      if (len > static_cast<uint64_t>(p.in[j].max)) {
        return absl::DataLossError(absl::StrCat(label_, ": node ", p.peer, " announced a delta of ", len, " bytes for op ",
                                                p.in[j].op->op_index, ", more than its bound ", p.in[j].max));
      }
      p.in[j].len = len;
      if (len == 0) HandUnits(*p.in[j].op, true, std::nullopt);  // travels in full: not decoded here
    }
  }
  for (auto& [name, p] : peers_) {
    auto ob = p.out_b.find(b);
    auto ib = p.in_b.find(b);
    if (ob != p.out_b.end()) {
      for (size_t i = ob->second.first; i < ob->second.second; ++i) p.streams = p.streams || p.out[i].len > 0;
    }
    if (ib != p.in_b.end()) {
      for (size_t j = ib->second.first; j < ib->second.second; ++j) p.streams = p.streams || p.in[j].len > 0;
    }
  }
  return absl::OkStatus();
}

std::map<size_t, DeltaCopy> DeltaRun::Substitutions(const Route& r) const {
  std::map<size_t, DeltaCopy> out;
  auto it = peers_.find(r.peer);
  if (r.kind != RouteKind::kPeer || it == peers_.end()) return out;
  const Peer& p = it->second;
  auto add = [&](const std::vector<Slot>& slots, const std::map<uint32_t, std::pair<size_t, size_t>>& ranges, bool outgoing) {
    auto range = ranges.find(r.bucket);
    if (range == ranges.end()) return;
    for (size_t k = range->second.first; k < range->second.second; ++k) {
      const Slot& s = slots[k];
      if (s.route != &r || s.len == 0) continue;
      const int64_t len = static_cast<int64_t>(s.len);
      out[s.pos] = outgoing ? DeltaCopy{true, "d." + p.peer, "d." + o_.me, p.mine.out_stream[k], p.theirs.in_land[k], len}
                            : DeltaCopy{false, "d." + o_.me, "d." + p.peer, p.theirs.out_stream[k], p.mine.in_land[k], len};
    }
  };
  add(p.out, p.out_b, true);
  add(p.in, p.in_b, false);
  return out;
}

void DeltaRun::DecodeSlot(Peer& p, size_t j) {
  Slot& s = p.in[j];
  const absl::Time t0 = absl::Now();
  absl::Span<uint8_t> stream(p.mem->data() + p.mine.in_land[j], static_cast<size_t>(s.len));
  if (o_.on_landed) o_.on_landed(s.op->op_index, stream);
  std::optional<std::pair<uint8_t*, int64_t>> dst = host_(s.op->dst_key);
  std::optional<DeltaBase> base = o_.base ? o_.base(s.op->dst_key) : std::nullopt;
  std::optional<delta::Digest> recorded;
  if (o_.recorded && base.has_value()) recorded = o_.recorded(*s.op, base->version);
  const bool in_place = base.has_value() && dst.has_value() && base->data == dst->first;
  delta::Digest decoded;
  std::vector<uint64_t> units;
  absl::Status st = dst.has_value() ? DecodeOp(*s.op, dst->first, dst->second, base, stream, label_, recorded, &decoded,
                                               WantUnits(*s.op) ? &units : nullptr)
                                    : absl::FailedPreconditionError(absl::StrCat(label_, ": ", s.op->dst_key, " is not host staging"));
  s.refused = !st.ok();
  // A refused op is resent in full: what lands then is hashed some other way.
  HandUnits(*s.op, true, st.ok() ? std::optional<std::vector<uint64_t>>(std::move(units)) : std::nullopt);
  p.mem->data()[p.mine.in_ref + static_cast<int64_t>(j)] = s.refused ? 1 : 0;
  if (st.ok() && o_.record) o_.record(*s.op, version_, decoded);
  if (st.ok() && o_.decoded) o_.decoded(*s.op);
  absl::MutexLock l(&mu_);
  stats_.decode_s += absl::ToDoubleSeconds(absl::Now() - t0);
  if (recorded.has_value()) ++stats_.base_digests_recorded;
  stats_.bytes_received_stream += s.len;
  if (s.refused) {
    ++stats_.ops_refused;
    if (stats_.first_refusal.empty()) stats_.first_refusal = std::string(st.message());
  } else {
    ++stats_.ops_decoded;
    if (in_place) ++stats_.ops_decoded_in_place;
  }
  --decoding_;
}

bool DeltaRun::Landed(const Route& r, std::set<const RouteOp*>* decoding) {
  auto it = peers_.find(r.peer);
  if (r.kind != RouteKind::kPeer || it == peers_.end()) return false;
  Peer& p = it->second;
  auto range = p.in_b.find(r.bucket);
  if (range == p.in_b.end()) return false;
  std::vector<size_t> jobs;
  for (size_t j = range->second.first; j < range->second.second; ++j) {
    if (p.in[j].route != &r || p.in[j].len == 0) continue;
    jobs.push_back(j);
    if (decoding != nullptr) decoding->insert(p.in[j].op);
  }
  // Largest first, as the encodes (Start).
  std::stable_sort(jobs.begin(), jobs.end(), [&p](size_t x, size_t y) { return p.in[x].op->copy.bytes() > p.in[y].op->copy.bytes(); });
  for (size_t j : jobs) {
    {
      absl::MutexLock l(&mu_);
      ++decoding_;
    }
    workers_->Decode([this, &p, j] { DecodeSlot(p, j); });
  }
  return !jobs.empty();
}

absl::StatusOr<std::vector<DeltaBatchPlan>> DeltaRun::RefusalsBatches(absl::Time deadline) {
  {
    absl::MutexLock l(&mu_);
    auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return decoding_ == 0; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(label_, ": decoding the deltas did not finish in time"));
    }
  }
  std::vector<DeltaBatchPlan> out;
  for (auto& [name, p] : peers_) {
    if (!p.streams) continue;
    DeltaBatchPlan batch{p.peer, p.channel, RefusalsTag(version_), {}};
    std::vector<DeltaCopy> mine, theirs;  // refusals of the slots we received / they received
    if (!p.in.empty()) mine.push_back({true, "d." + p.peer, "d." + o_.me, p.mine.in_ref, p.theirs.out_ref, static_cast<int64_t>(p.in.size())});
    if (!p.out.empty()) {
      theirs.push_back({false, "d." + o_.me, "d." + p.peer, p.theirs.in_ref, p.mine.out_ref, static_cast<int64_t>(p.out.size())});
    }
    // Lower node id's sends first: its out slots' refusals travel from the higher node.
    for (auto* part : Lo(p) ? std::vector{&theirs, &mine} : std::vector{&mine, &theirs}) {
      for (DeltaCopy& c : *part) batch.copies.push_back(std::move(c));
    }
    // Slots sent in full are never refused.
    for (size_t j = 0; j < p.in.size(); ++j) {
      if (p.in[j].len == 0) p.mem->data()[p.mine.in_ref + static_cast<int64_t>(j)] = 0;
    }
    out.push_back(std::move(batch));
  }
  return out;
}

std::vector<Route> DeltaRun::FallbackRoutes() {
  std::vector<Route> out;
  for (auto& [name, p] : peers_) {
    if (!p.streams) continue;
    for (size_t i = 0; i < p.out.size(); ++i) p.out[i].refused = p.out[i].len > 0 && p.mem->data()[p.mine.out_ref + static_cast<int64_t>(i)] != 0;
    Route r;
    r.kind = RouteKind::kPeer;
    r.bucket = 0xFFFFFFu;
    r.peer = p.peer;
    r.channel = p.channel;
    r.checksum = true;
    r.what = absl::StrCat("node ", o_.me, " <-> node ", p.peer, " (full resend of refused deltas)");
    std::vector<const Slot*> sends, receives;
    for (const Slot& s : p.out) if (s.refused) sends.push_back(&s);
    for (const Slot& s : p.in) if (s.refused && s.len > 0) receives.push_back(&s);
    for (auto* part : Lo(p) ? std::vector{&sends, &receives} : std::vector{&receives, &sends}) {
      for (const Slot* s : *part) {
        r.ops.push_back(*s->op);
        r.bytes += static_cast<int64_t>(s->op->bytes);
        if (s->op->dst_local) r.incoming += static_cast<int64_t>(s->op->bytes);
      }
    }
    if (r.ops.empty()) continue;
    absl::MutexLock l(&mu_);
    for (const Slot* s : sends) stats_.bytes_sent_full += static_cast<uint64_t>(s->op->copy.bytes());
    for (const Slot* s : receives) stats_.bytes_fallback += static_cast<uint64_t>(s->op->copy.bytes());
    out.push_back(std::move(r));
  }
  return out;
}

bool DeltaRun::WantUnits(const RouteOp& op) const { return o_.unit_hashes && op.part == RouteOp::Part::kCanonical; }

void DeltaRun::HandUnits(const RouteOp& op, bool landed, const std::optional<std::vector<uint64_t>>& units) {
  if (!WantUnits(op)) return;
  o_.unit_hashes(op, landed, units.has_value() ? &*units : nullptr);
}

absl::Status DeltaRun::Finish(absl::Time deadline) {
  if (!workers_->Drain(deadline)) return absl::DeadlineExceededError(absl::StrCat(label_, ": delta encodes did not finish in time"));
  return absl::OkStatus();
}

DeltaStats DeltaRun::stats() const {
  absl::MutexLock l(&mu_);
  return stats_;
}

}  // namespace wb::daemon::node
