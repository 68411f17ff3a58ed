#include "daemon/node/delta_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace wb::daemon::node {

std::string DeltaKey::ToString() const {
  std::vector<std::string> dims;
  for (size_t d = 0; d < begin.size() && d < end.size(); ++d) dims.push_back(absl::StrCat(begin[d], ":", end[d]));
  return absl::StrCat("tensor ", tensor, " box [", absl::StrJoin(dims, ", "), "]");
}

DeltaCache::DeltaCache(uint64_t capacity_bytes) : pool_(std::make_shared<Pool>()), capacity_(capacity_bytes) {
  pool_->limit = capacity_bytes;
}

std::shared_ptr<const DeltaEntry> DeltaCache::NewEntry(uint64_t version, UninitVector<uint8_t> bytes,
                                                       std::optional<delta::Digest> digest) const {
  std::weak_ptr<Pool> pool = pool_;
  auto* e = new DeltaEntry{version, std::move(bytes), digest};
  return std::shared_ptr<const DeltaEntry>(e, [pool](const DeltaEntry* d) {
    std::unique_ptr<DeltaEntry> owned(const_cast<DeltaEntry*>(d));
    std::shared_ptr<Pool> p = pool.lock();
    if (p == nullptr || owned->bytes.empty()) return;
    absl::MutexLock l(&p->mu);
    if (p->bytes + owned->bytes.size() > p->limit) return;
    p->bytes += owned->bytes.size();
    const size_t size = owned->bytes.size();
    p->free.emplace(size, std::move(owned->bytes));
  });
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
  absl::MutexLock l(&mu_);
  auto it = committed_.find(key);
  if (it == committed_.end() || it->second.entry->version != version) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.entry;
}

void DeltaCache::EvictLocked(const DeltaKey& key) {
  auto it = committed_.find(key);
  if (it == committed_.end()) return;
  committed_bytes_ -= it->second.entry->bytes.size();
  lru_.erase(it->second.lru);
  committed_.erase(it);
}

bool DeltaCache::AddPending(const DeltaKey& key, uint64_t version, UninitVector<uint8_t> bytes,
                            std::optional<delta::Digest> digest) {
  absl::MutexLock l(&mu_);
  const uint64_t size = bytes.size();
  auto& pv = pending_[version];
  if (auto old = pv.find(key); old != pv.end()) {
    pending_bytes_ -= old->second->bytes.size();
    pv.erase(old);
  }
  // First the key's own committed copy: the encoder has just read it for this version, and once
  // this version commits it is replaced anyway (a cache of 1x the bytes then keeps every key).
  if (committed_bytes_ + pending_bytes_ + size > capacity_ && committed_.count(key) > 0) {
    EvictLocked(key);
    ++evictions_;
  }
  while (committed_bytes_ + pending_bytes_ + size > capacity_ && !lru_.empty()) {
    EvictLocked(lru_.back());
    ++evictions_;
  }
  if (committed_bytes_ + pending_bytes_ + size > capacity_) {
    ++refused_;
    if (pv.empty()) pending_.erase(version);
    return false;
  }
  pv[key] = NewEntry(version, std::move(bytes), digest);
  pending_bytes_ += size;
  return true;
}

void DeltaCache::Commit(uint64_t version) {
  absl::MutexLock l(&mu_);
  for (auto it = pending_.begin(); it != pending_.end() && it->first <= version;) {
    if (it->first == version) {
      for (auto& [key, e] : it->second) {
        EvictLocked(key);
        pending_bytes_ -= e->bytes.size();
        committed_bytes_ += e->bytes.size();
        lru_.push_front(key);
        committed_[key] = Slot{std::move(e), lru_.begin()};
      }
    } else {
      for (auto& [key, e] : it->second) pending_bytes_ -= e->bytes.size();  // superseded
    }
    it = pending_.erase(it);
  }
}

void DeltaCache::Drop(uint64_t version) {
  absl::MutexLock l(&mu_);
  auto it = pending_.find(version);
  if (it == pending_.end()) return;
  for (auto& [key, e] : it->second) pending_bytes_ -= e->bytes.size();
  pending_.erase(it);
}

void DeltaCache::Clear() {
  absl::MutexLock l(&mu_);
  committed_.clear();
  lru_.clear();
  pending_.clear();
  committed_bytes_ = pending_bytes_ = 0;
}

uint64_t DeltaCache::WarmSpares() {
  // Sizes of committed entries without a free buffer of their size (counted per size).
  std::map<size_t, int64_t> need;
  {
    absl::MutexLock l(&mu_);
    for (const auto& [key, slot] : committed_) ++need[slot.entry->bytes.size()];
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
  absl::MutexLock pl(&pool_->mu);
  s.free_bytes = pool_->bytes;
  return s;
}

uint64_t DeltaCache::bytes() const {
  absl::MutexLock l(&mu_);
  return committed_bytes_ + pending_bytes_;
}

}  // namespace wb::daemon::node
