#include "transport/host_tcp/parking.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>

namespace wb::transport {

bool ParkingTable::Admit(const Key& key, absl::Time now, bool* reserved) {
  *reserved = false;
  Expire(now);
  // A Connect waiting for this key takes its connections whatever the bound, so parked junk
  // delays only a dialer whose acceptor has not called Connect yet.
  if (Awaited(key)) return true;
  if (counters_.parked + reserved_ >= limits_.max_connections) {
    ++counters_.refused;
    last_refused_instance_ = key.first.substr(0, 64);
    return false;
  }
  ++reserved_;
  *reserved = true;
  return true;
}

void ParkingTable::Unreserve() {
  if (reserved_ > 0) --reserved_;
}

void ParkingTable::Park(const Key& key, uint32_t idx, int total, int fd, absl::Time now) {
  const bool new_round = sets_.count(key) == 0;
  Set& set = sets_[key];
  if (auto old = set.fds.find(idx); old != set.fds.end()) {
    close(old->second);  // the same stream again (a redial): the newer connection wins
  } else {
    ++counters_.parked;
  }
  set.fds[idx] = fd;
  set.total = total;
  set.last = now;
  if (new_round) Supersede(key.first, key);
  Expire(now);
}

void ParkingTable::Supersede(const std::string& instance, const Key& keep) {
  while (true) {
    int unawaited = 0;
    auto oldest = sets_.end();
    for (auto it = sets_.lower_bound(Key(instance, std::string())); it != sets_.end() && it->first.first == instance;
         ++it) {
      if (Awaited(it->first)) continue;
      ++unawaited;
      if (it->first != keep && (oldest == sets_.end() || it->second.last < oldest->second.last)) oldest = it;
    }
    if (unawaited <= limits_.max_rounds_per_instance || oldest == sets_.end()) return;
    CloseSet(oldest, &counters_.superseded);
  }
}

void ParkingTable::Await(const Key& key) { ++awaited_[key]; }

void ParkingTable::Unawait(const Key& key) {
  auto it = awaited_.find(key);
  if (it != awaited_.end() && --it->second <= 0) awaited_.erase(it);
}

// A dialer whose Connect went through while no Connect here took its connections (the acceptor's
// attempt ended first) may close them later (it dropped that channel). Taken, they would be a dead
// channel; a stream the dialer connects again replaces its parked one anyway (Park).
int ParkingTable::AwaitedFor(const std::string& instance) const {
  int n = 0;
  for (auto it = awaited_.lower_bound(Key(instance, std::string())); it != awaited_.end() && it->first.first == instance;
       ++it) {
    n += it->second;
  }
  return n;
}

bool ParkingTable::Ready(const Key& key) {
  auto it = sets_.find(key);
  if (it == sets_.end()) return false;
  for (auto f = it->second.fds.begin(); f != it->second.fds.end();) {
    pollfd p{f->second, POLLRDHUP, 0};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) {
      close(f->second);
      --counters_.parked;
      ++counters_.hung_up;
      f = it->second.fds.erase(f);
    } else {
      ++f;
    }
  }
  if (it->second.fds.empty()) {
    sets_.erase(it);
    return false;
  }
  return static_cast<int>(it->second.fds.size()) == it->second.total;
}

std::vector<int> ParkingTable::Take(const Key& key) {
  std::vector<int> fds;
  auto it = sets_.find(key);
  if (it == sets_.end()) return fds;
  for (const auto& [idx, fd] : it->second.fds) fds.push_back(fd);
  counters_.parked -= static_cast<int64_t>(fds.size());
  sets_.erase(it);
  return fds;
}

void ParkingTable::CloseSet(std::map<Key, Set>::iterator it, int64_t* counter) {
  for (const auto& [idx, fd] : it->second.fds) close(fd);
  const int64_t n = static_cast<int64_t>(it->second.fds.size());
  counters_.parked -= n;
  if (counter != nullptr) *counter += n;
  sets_.erase(it);
}

void ParkingTable::Expire(absl::Time now) {
  for (auto it = sets_.begin(); it != sets_.end();) {
    auto next = std::next(it);
    if (!Awaited(it->first) && now - it->second.last > limits_.timeout) CloseSet(it, &counters_.expired);
    it = next;
  }
}

void ParkingTable::CloseRound(const std::string& round) {
  for (auto it = sets_.begin(); it != sets_.end();) {
    auto next = std::next(it);
    if (it->first.second == round) CloseSet(it, &counters_.cancelled);
    it = next;
  }
}

void ParkingTable::CloseAll() {
  while (!sets_.empty()) CloseSet(sets_.begin(), nullptr);
}

void ParkingTable::InstancesInUse(std::set<std::string>& out) const {
  for (const auto& [key, set] : sets_) out.insert(key.first);
  for (const auto& [key, n] : awaited_) out.insert(key.first);
}

std::vector<std::pair<std::string, int>> ParkingTable::OtherRounds(const std::string& instance, const std::string& round,
                                                                   size_t max, size_t* more) const {
  std::vector<std::pair<std::string, int>> out;
  *more = 0;
  for (auto it = sets_.lower_bound(Key(instance, std::string())); it != sets_.end() && it->first.first == instance; ++it) {
    if (it->first.second == round) continue;
    if (out.size() < max) {
      out.emplace_back(it->first.second, static_cast<int>(it->second.fds.size()));
    } else {
      ++*more;
    }
  }
  return out;
}

}  // namespace wb::transport
