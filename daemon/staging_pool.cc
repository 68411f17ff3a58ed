#include "daemon/staging_pool.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace wb::daemon {
namespace {

// Writes zeros over `buffer` from the kernel (read(2) of /dev/zero: copy_to_user), best effort.
// Why: on a VM that shadows page tables separately for the guest's kernel and user modes (PVM,
// measured on the 2-core CI VM), the first access to a page from each mode traps to the
// hypervisor: a buffer only user code touched still costs ~1.5-6 s per GB the first time a
// socket recv(2) lands in it (loopback TCP into such a buffer: 6.3 s vs 0.97 s kernel-warmed, same
// load). A pre-allocated staging buffer's next writer is usually host_tcp's recv, so it is
// warmed from both modes here, outside any version. A plain memset on bare metal.
void ZeroFromKernel(std::vector<uint8_t>& buffer) {
  const int fd = ::open("/dev/zero", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  size_t done = 0;
  while (done < buffer.size()) {
    const ssize_t n = ::read(fd, buffer.data() + done, std::min<size_t>(buffer.size() - done, size_t{64} << 20));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

}  // namespace

StagingPool::~StagingPool() { options_.clock->Forget(&mu_); }

void StagingPool::CountFreed(const std::list<Idle>& freed) {
  for (const Idle& i : freed) tagged_freed_ += i.tag.empty() ? 0 : 1;
}

void StagingPool::Lend(const std::string& tag, std::weak_ptr<void> holder) {
  if (tag.empty()) return;
  absl::MutexLock l(&mu_);
  // Bounded by the live holders: entries of holders gone without giving their buffer back (a
  // device buffer, a pool that refused it) are dropped here.
  for (auto it = lent_.begin(); it != lent_.end();) it = it->second.expired() ? lent_.erase(it) : std::next(it);
  lent_[tag] = std::move(holder);
}

StagingPool::Tagged StagingPool::TakeTagged(int64_t size, const std::string& tag, absl::Time deadline) {
  Tagged out;
  if (size <= 0 || tag.empty()) return out;
  absl::MutexLock l(&mu_);
  // Back (idle with the tag), gone for good (no entry: given back and then taken or freed, or
  // never lent), or held: all but "let go, not given back yet", which Give ends under this lock.
  auto settled = [this, &tag]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = lent_.find(tag);
    return it == lent_.end() || !it->second.expired();
  };
  // At most a second: a deleter gives its buffers back within microseconds, and an entry that
  // never settles (a buffer given back under another tag) must not hold a version's start.
  if (!settled()) options_.clock->WaitUntil(&mu_, absl::Condition(&settled), std::min(deadline, options_.clock->Now() + absl::Seconds(1)));
  for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
    if (static_cast<int64_t>(it->buffer.size()) != size || it->tag != tag) continue;
    out.buffer = std::move(it->buffer);
    idle_.erase(std::next(it).base());
    idle_bytes_ -= size;
    ++reused_;
    return out;
  }
  auto it = lent_.find(tag);
  if (it != lent_.end()) out.holder = it->second.lock();
  return out;
}

std::vector<uint8_t> StagingPool::Take(int64_t size, bool* reused, const std::string& tag, bool* tag_matched) {
  if (reused != nullptr) *reused = false;
  if (tag_matched != nullptr) *tag_matched = false;
  if (size <= 0) return {};
  {
    absl::MutexLock l(&mu_);
    auto take = [&](std::list<Idle>::reverse_iterator it) {
      std::vector<uint8_t> out = std::move(it->buffer);
      idle_.erase(std::next(it).base());
      idle_bytes_ -= size;
      ++reused_;
      if (reused != nullptr) *reused = true;
      return out;
    };
    // The buffer with this tag; else newest first (the buffer given back last is the one most
    // likely still in cache), untagged before tagged (those are someone's next base).
    for (int pass = tag.empty() ? 1 : 0; pass < 3; ++pass) {
      for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
        if (static_cast<int64_t>(it->buffer.size()) != size) continue;
        if (pass == 0 && it->tag != tag) continue;
        if (pass == 1 && !it->tag.empty()) continue;
        if (pass == 0 && tag_matched != nullptr) *tag_matched = true;
        if (pass == 2 && !it->tag.empty() && it->tag != tag) ++tagged_given_away_;
        return take(it);
      }
    }
    ++allocated_;
  }
  // Outside the lock: faulting in a model-sized buffer takes a while.
  return std::vector<uint8_t>(static_cast<size_t>(size));
}

void StagingPool::Give(std::vector<uint8_t> buffer, std::string tag) {
  const int64_t size = static_cast<int64_t>(buffer.size());
  std::list<Idle> freed;  // destroyed after the lock is released (munmap of large buffers)
  {
    absl::MutexLock l(&mu_);
    // Back (or freed): a TakeTagged waiting for it settles under this same lock. Only a holder
    // that let go: a newer holder of the same tag keeps its entry.
    if (auto it = tag.empty() ? lent_.end() : lent_.find(tag); it != lent_.end() && it->second.expired()) lent_.erase(it);
    if (size == 0) return;
    if (size > options_.max_idle_bytes) {
      tagged_freed_ += tag.empty() ? 0 : 1;
      return;  // `buffer` is freed on return, outside the lock
    }
    while (idle_bytes_ + size > options_.max_idle_bytes && !idle_.empty()) {
      idle_bytes_ -= static_cast<int64_t>(idle_.front().buffer.size());
      freed.splice(freed.end(), idle_, idle_.begin());
    }
    CountFreed(freed);
    idle_.push_back(Idle{std::move(buffer), options_.clock->Now(), std::move(tag)});
    idle_bytes_ += size;
  }
}

bool StagingPool::Prewarm(int64_t size, int64_t room) {
  if (size <= 0) return false;
  {
    absl::MutexLock l(&mu_);
    if (idle_bytes_ + size > std::min(room, options_.max_idle_bytes)) return false;
    // Only an untagged buffer counts: a tagged one is some rollout's next delta base, and a
    // late rollout's catch-up that took it (Take's last pass) would leave that rollout without its
    // base - deltas into its receiver-quantised shadows refused and resent in full.
    for (const Idle& i : idle_) {
      if (static_cast<int64_t>(i.buffer.size()) == size && i.tag.empty()) return false;
    }
  }
  std::vector<uint8_t> buffer(static_cast<size_t>(size));  // zero-filled: every page faulted in, outside the lock
  ZeroFromKernel(buffer);
  Give(std::move(buffer));
  return true;
}

void StagingPool::Trim() {
  std::list<Idle> freed;  // destroyed after the lock is released
  const absl::Time cutoff = options_.clock->Now() - options_.max_idle_time;
  absl::MutexLock l(&mu_);
  while (!idle_.empty() && idle_.front().since <= cutoff) {
    idle_bytes_ -= static_cast<int64_t>(idle_.front().buffer.size());
    freed.splice(freed.end(), idle_, idle_.begin());
  }
  CountFreed(freed);
}

void StagingPool::TrimTo(int64_t max_idle_bytes) {
  std::list<Idle> freed;  // destroyed after the lock is released
  absl::MutexLock l(&mu_);
  while (!idle_.empty() && idle_bytes_ > max_idle_bytes) {
    idle_bytes_ -= static_cast<int64_t>(idle_.front().buffer.size());
    freed.splice(freed.end(), idle_, idle_.begin());
  }
  CountFreed(freed);
}

void StagingPool::Clear() {
  std::list<Idle> freed;  // destroyed after the lock is released
  absl::MutexLock l(&mu_);
  freed.swap(idle_);
  idle_bytes_ = 0;
  CountFreed(freed);
}

StagingPool::Stats StagingPool::stats() const {
  absl::MutexLock l(&mu_);
  Stats s;
  s.reused = reused_;
  s.allocated = allocated_;
  s.idle_bytes = idle_bytes_;
  s.idle_buffers = idle_.size();
  s.tagged_given_away = tagged_given_away_;
  s.tagged_freed = tagged_freed_;
  return s;
}

}  // namespace wb::daemon
