#include "daemon/node/delta_cache.h"

#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wb::daemon::node {

std::string DeltaKey::ToString() const {
  std::vector<std::string> dims;
  for (size_t d = 0; d < begin.size() && d < end.size(); ++d) dims.push_back(absl::StrCat(begin[d], ":", end[d]));
  return absl::StrCat("tensor ", tensor, " box [", absl::StrJoin(dims, ", "), "]");
}

namespace {
constexpr size_t kMinPooledStream = 64 * 1024;
}  // namespace

DeltaCache::DeltaCache(uint64_t capacity_bytes) : pool_(std::make_shared<Pool>()), capacity_(capacity_bytes) {
  pool_->limit = capacity_bytes;
}

std::shared_ptr<const DeltaEntry> DeltaCache::NewEntry(DeltaEntry entry) const {
  std::weak_ptr<Pool> pool = pool_;
  auto* e = new DeltaEntry(std::move(entry));
  return std::shared_ptr<const DeltaEntry>(e, [pool](const DeltaEntry* d) {
    std::unique_ptr<DeltaEntry> owned(const_cast<DeltaEntry*>(d));
    std::shared_ptr<Pool> p = pool.lock();
    if (p == nullptr) return;
    absl::MutexLock l(&p->mu);
    if (!owned->bytes.empty() && p->bytes + owned->bytes.size() <= p->limit) {
      p->bytes += owned->bytes.size();
      const size_t size = owned->bytes.size();
      p->free.emplace(size, std::move(owned->bytes));
    }
    // Streams below the allocator's mmap threshold come back warm from malloc anyway.
    const size_t cap = owned->stream.capacity();
    if (cap >= kMinPooledStream && p->bytes + cap <= p->limit) {
      p->bytes += cap;
      owned->stream.clear();
      p->free_streams.emplace(cap, std::move(owned->stream));
    }
  });
}

std::vector<uint8_t> DeltaCache::StreamBuffer(size_t size) {
  if (size >= kMinPooledStream) {
    absl::MutexLock l(&pool_->mu);
    // The smallest free one that holds it, unless it is much bigger (a small stream would pin it).
    auto it = pool_->free_streams.lower_bound(size);
    if (it != pool_->free_streams.end() && it->first <= 2 * size) {
      std::vector<uint8_t> out = std::move(it->second);
      pool_->bytes -= it->first;
      pool_->free_streams.erase(it);
      return out;
    }
  }
  std::vector<uint8_t> out;
  out.reserve(size);
  return out;
}

namespace {
uint64_t PendingBytes(const DeltaEntry& e) { return e.bytes.size() + e.stream.size(); }
}  // namespace

uint64_t DeltaCache::SlotBytes(const Slot& slot) {
  uint64_t n = slot.size;
  for (const auto& q : slot.queued) n += q->stream.size();
  return n;
}

UninitVector<uint8_t> DeltaCache::Buffer(size_t size) {
  {
    absl::MutexLock l(&pool_->mu);
    auto it = pool_->free.find(size);
    if (it != pool_->free.end()) {
      UninitVector<uint8_t> out = std::move(it->second);
      pool_->free.erase(it);
      pool_->bytes -= size;
      return out;
    }
  }
  return UninitVector<uint8_t>(size);
}

std::shared_ptr<const DeltaEntry> DeltaCache::Committed(const DeltaKey& key, uint64_t version) {
  {
    absl::MutexLock l(&mu_);
    // Another thread applies this key's queued streams (the background applier right after a
    // commit): wait for it - CPU work bounded by the box's size - rather than send the box full.
    auto idle = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto at = committed_.find(key);
      return at == committed_.end() || !at->second.applying;
    };
    mu_.AwaitWithTimeout(absl::Condition(&idle), kApplyWait);
    auto it = committed_.find(key);
    if (it == committed_.end() || it->second.applying) return nullptr;
    Slot& slot = it->second;
    const uint64_t logical = slot.queued.empty() ? slot.entry->version : slot.queued.back()->version;
    if (logical != version) return nullptr;
    lru_.splice(lru_.begin(), lru_, slot.lru);
    if (slot.queued.empty()) return slot.entry;
  }
  // Streams committed since the background applier last ran: apply them here (the encoder needs
  // this version's bytes now).
  std::shared_ptr<const DeltaEntry> e = ApplySlot(key);
  return e != nullptr && e->version == version ? e : nullptr;
}

std::shared_ptr<const DeltaEntry> DeltaCache::ApplySlot(const DeltaKey& key) {
  std::shared_ptr<const DeltaEntry> base;
  std::vector<std::shared_ptr<const DeltaEntry>> queued;
  uint64_t generation = 0;
  bool in_place = false;
  {
    absl::MutexLock l(&mu_);
    auto it = committed_.find(key);
    if (it == committed_.end() || it->second.applying) return nullptr;
    Slot& slot = it->second;
    if (slot.queued.empty()) return slot.entry;
    slot.applying = true;  // Committed() hands out nothing of this key until we are done
    queued = slot.queued;
    base = slot.entry;
    generation = slot.generation;
    // Only the slot and `base` hold it: no encoder reads these bytes, and none can get them while
    // `applying`, so they may change in place. Otherwise (an encode of a version in flight still
    // reads them) the streams go to a copy.
    in_place = base.use_count() == 2;
  }
  UninitVector<uint8_t> bytes;
  if (in_place) {
    bytes = std::move(const_cast<DeltaEntry*>(base.get())->bytes);  // allocated non-const (NewEntry)
  } else {
    bytes = Buffer(base->bytes.size());
    std::memcpy(bytes.data(), base->bytes.data(), base->bytes.size());
  }
  uint64_t version = base->version;
  std::optional<delta::Digest> digest = base->digest;
  bool ok = true;
  uint64_t stream_bytes = 0;
  for (const auto& q : queued) {
    // Checks the base (version, digest) and the result (target digest): a wrong byte never becomes
    // a committed entry.
    const std::string what = absl::StrCat("the sender's cached ", key.ToString(), " (version ", q->version, ")");
    if (!delta::DecodeInPlace(q->stream, version, digest, absl::MakeSpan(bytes), what).ok()) {
      ok = false;
      break;
    }
    version = q->version;
    digest = q->digest;
    stream_bytes += q->stream.size();
  }
  absl::MutexLock l(&mu_);
  auto it = committed_.find(key);
  const bool same = it != committed_.end() && it->second.generation == generation;
  if (same) it->second.applying = false;
  if (!ok) {
    ++failed_applies_;
    if (same) {
      EvictLocked(key);
      ++evictions_;
    }
    return nullptr;
  }
  applied_ += queued.size();
  if (!in_place) ++copied_applies_;
  if (!same) return nullptr;  // evicted or replaced meanwhile: the result is nobody's base
  Slot& slot = it->second;
  slot.queued.erase(slot.queued.begin(), slot.queued.begin() + static_cast<std::ptrdiff_t>(queued.size()));
  committed_bytes_ -= stream_bytes;
  const bool packs = base->packs;
  slot.entry = NewEntry(DeltaEntry{version, std::move(bytes), digest, {}, 0, packs});
  return slot.queued.empty() ? slot.entry : nullptr;
}

void DeltaCache::EvictLocked(const DeltaKey& key) {
  auto it = committed_.find(key);
  if (it == committed_.end()) return;
  committed_bytes_ -= SlotBytes(it->second);
  lru_.erase(it->second.lru);
  committed_.erase(it);
}

bool DeltaCache::AddPending(const DeltaKey& key, uint64_t version, UninitVector<uint8_t> bytes,
                            std::optional<delta::Digest> digest, bool packs) {
  std::shared_ptr<const DeltaEntry> e = NewEntry(DeltaEntry{version, std::move(bytes), digest, {}, 0, packs});
  absl::MutexLock l(&mu_);
  return FilePendingLocked(key, version, std::move(e), /*may_evict_own=*/true);
}

bool DeltaCache::AddPendingStream(const DeltaKey& key, uint64_t version, uint64_t base_version, std::vector<uint8_t> stream,
                                  const delta::Digest& target_digest) {
  std::shared_ptr<const DeltaEntry> e = NewEntry(DeltaEntry{version, {}, target_digest, std::move(stream), base_version, false});
  absl::MutexLock l(&mu_);
  return FilePendingLocked(key, version, std::move(e), /*may_evict_own=*/false);
}

bool DeltaCache::FilePendingLocked(const DeltaKey& key, uint64_t version, std::shared_ptr<const DeltaEntry> entry,
                                   bool may_evict_own) {
  const uint64_t size = PendingBytes(*entry);
  auto& pv = pending_[version];
  if (auto old = pv.find(key); old != pv.end()) {
    pending_bytes_ -= PendingBytes(*old->second);
    pv.erase(old);
  }
  auto over = [&] { return committed_bytes_ + pending_bytes_ + size > capacity_; };
  // A full copy evicts the key's own committed copy first: the encoder has just read it for this
  // version, and once this version commits it is replaced anyway (a cache of 1x the bytes then
  // keeps every key). A stream never evicts it: it is the stream's base.
  if (may_evict_own && over() && committed_.count(key) > 0) {
    EvictLocked(key);
    ++evictions_;
  }
  // Then least recently used first.
  for (auto victim = lru_.end(); over() && victim != lru_.begin();) {
    --victim;
    if (*victim == key) continue;  // (only left when a stream's base)
    const DeltaKey k = *victim;
    victim = std::next(victim);  // EvictLocked erases the element `victim` named
    EvictLocked(k);
    ++evictions_;
  }
  if (over()) {
    ++refused_;
    if (pv.empty()) pending_.erase(version);
    return false;
  }
  pv[key] = std::move(entry);
  pending_bytes_ += size;
  return true;
}

void DeltaCache::Commit(uint64_t version) {
  absl::MutexLock l(&mu_);
  for (auto it = pending_.begin(); it != pending_.end() && it->first <= version;) {
    if (it->first == version) {
      for (auto& [key, e] : it->second) {
        pending_bytes_ -= PendingBytes(*e);
        if (!e->stream.empty()) {
          auto c = committed_.find(key);
          const uint64_t logical =
              c == committed_.end() ? 0 : (c->second.queued.empty() ? c->second.entry->version : c->second.queued.back()->version);
          if (c != committed_.end() && logical == e->stream_base) {
            committed_bytes_ += e->stream.size();
            c->second.queued.push_back(std::move(e));
            lru_.splice(lru_.begin(), lru_, c->second.lru);
          } else if (c != committed_.end()) {
            // Made against another version (two versions in flight against one base, and the
            // other committed first): nothing here is anyone's base any more.
            EvictLocked(key);
            ++evictions_;
          }
          continue;
        }
        EvictLocked(key);
        const uint64_t size = e->bytes.size();
        committed_bytes_ += size;
        lru_.push_front(key);
        committed_[key] = Slot{std::move(e), lru_.begin(), {}, false, ++next_generation_, size};
      }
    } else {
      for (auto& [key, e] : it->second) pending_bytes_ -= PendingBytes(*e);  // superseded
    }
    it = pending_.erase(it);
  }
}

void DeltaCache::Drop(uint64_t version) {
  absl::MutexLock l(&mu_);
  auto it = pending_.find(version);
  if (it == pending_.end()) return;
  for (auto& [key, e] : it->second) pending_bytes_ -= PendingBytes(*e);
  pending_.erase(it);
}

void DeltaCache::Clear() {
  absl::MutexLock l(&mu_);
  committed_.clear();
  lru_.clear();
  pending_.clear();
  committed_bytes_ = pending_bytes_ = 0;
}

int DeltaCache::ApplyQueued() {
  int n = 0;
  while (!stop_warming_.load()) {
    std::optional<DeltaKey> next;
    {
      absl::MutexLock l(&mu_);
      for (const auto& [key, slot] : committed_) {
        if (!slot.queued.empty() && !slot.applying) {
          next = key;
          break;
        }
      }
    }
    if (!next.has_value()) break;
    ApplySlot(*next);  // applied, or evicted on failure: either way it is not picked again
    ++n;
  }
  return n;
}

uint64_t DeltaCache::WarmSpares() {
  // Sizes of committed entries without a free buffer of their size (counted per size).
  std::map<size_t, int64_t> need;
  {
    absl::MutexLock l(&mu_);
    // Entries whose next version packs a full copy again (strided boxes); the others travel as
    // streams (AddPendingStream) and need no second buffer.
    for (const auto& [key, slot] : committed_) {
      if (slot.entry->packs) ++need[slot.size];
    }
  }
  {
    absl::MutexLock l(&pool_->mu);
    for (auto& [size, n] : need) n -= static_cast<int64_t>(pool_->free.count(size));
  }
  uint64_t added = 0;
  for (const auto& [size, n] : need) {
    for (int64_t i = 0; i < n && size > 0; ++i) {
      if (stop_warming_.load()) return added;
      {
        absl::MutexLock l(&pool_->mu);
        if (pool_->bytes + size > pool_->limit) return added;
      }
      UninitVector<uint8_t> buf(size);
      constexpr size_t kPage = 4096;
      for (size_t off = 0; off < size; off += kPage) buf[off] = 0;  // fault each page in now
      absl::MutexLock l(&pool_->mu);
      if (pool_->bytes + size > pool_->limit) return added;
      pool_->bytes += size;
      pool_->free.emplace(size, std::move(buf));
      added += size;
    }
  }
  return added;
}

DeltaCache::Stats DeltaCache::stats() const {
  absl::MutexLock l(&mu_);
  Stats s;
  s.committed_bytes = committed_bytes_;
  s.pending_bytes = pending_bytes_;
  s.committed_entries = committed_.size();
  for (auto& [v, m] : pending_) s.pending_entries += m.size();
  s.evictions = evictions_;
  s.refused_adds = refused_;
  for (const auto& [key, slot] : committed_) s.queued_streams += slot.queued.size();
  s.applied_streams = applied_;
  s.failed_applies = failed_applies_;
  s.copied_applies = copied_applies_;
  absl::MutexLock pl(&pool_->mu);
  s.free_bytes = pool_->bytes;
  return s;
}

uint64_t DeltaCache::bytes() const {
  absl::MutexLock l(&mu_);
  return committed_bytes_ + pending_bytes_;
}

}  // namespace wb::daemon::node
