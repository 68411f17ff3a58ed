#include "daemon/node/channel_cache.h"

namespace wb::daemon::node {

std::optional<ChannelCache::Entry> ChannelCache::Find(const std::string& model_id, const std::string& channel) const {
  absl::MutexLock l(&mu_);
  auto it = channels_.find({model_id, channel});
  if (it == channels_.end()) return std::nullopt;
  return it->second;
}

bool ChannelCache::CachedLocked(const Conn& c) const {
  auto it = channels_.find({std::get<0>(c), std::get<1>(c)});
  return it != channels_.end() && it->second.id.id == std::get<2>(c);
}

bool ChannelCache::UnusedLocked(const Conn& c) const { return !CachedLocked(c) && holders_.count(c) == 0; }

bool ChannelCache::ForgetLocked(const Conn& c) {
  if (CachedLocked(c)) channels_.erase({std::get<0>(c), std::get<1>(c)});
  return holders_.count(c) == 0;
}

bool ChannelCache::ReleaseLocked(Holder holder, const Conn& c, bool forget) {
  if (forget) ForgetLocked(c);
  auto it = holders_.find(c);
  if (it != holders_.end()) {
    it->second.erase(holder);
    if (it->second.empty()) holders_.erase(it);
  }
  return UnusedLocked(c);
}

ChannelCache::Lookup ChannelCache::ForPeer(const std::string& model_id, const std::string& channel, const std::string& peer_instance,
                                           Holder holder) {
  absl::MutexLock l(&mu_);
  Lookup out;
  auto it = channels_.find({model_id, channel});
  if (it == channels_.end()) return out;
  const Conn c{model_id, channel, it->second.id.id};
  if (it->second.peer_instance == peer_instance) {
    out.reuse = it->second.id;
    out.round = it->second.round;
    holders_[c].insert(holder);
    return out;
  }
  // A peer that restarted (new transport instance): the old incarnation's channel is dead and must
  // be disconnected (its sockets closed), not overwritten - by its last holder if one still runs.
  const transport::PeerId stale = it->second.id;
  if (ForgetLocked(c)) out.stale = stale;
  return out;
}

transport::PeerId ChannelCache::Put(const std::string& model_id, const std::string& channel, transport::PeerId id,
                                    const std::string& peer_instance, Holder holder, const std::string& round) {
  absl::MutexLock l(&mu_);
  holders_[{model_id, channel, id.id}].insert(holder);
  Entry& slot = channels_[{model_id, channel}];
  const transport::PeerId before = slot.id;
  slot = Entry{id, peer_instance, round};
  if (before == transport::kNoPeer || before == id) return transport::kNoPeer;
  return holders_.count({model_id, channel, before.id}) == 0 ? before : transport::kNoPeer;
}

bool ChannelCache::Forget(const std::string& model_id, const std::string& channel, transport::PeerId id) {
  absl::MutexLock l(&mu_);
  return ForgetLocked({model_id, channel, id.id});
}

void ChannelCache::Drop(const std::string& model_id, const std::string& channel, transport::PeerId id) {
  absl::MutexLock l(&mu_);
  const Conn c{model_id, channel, id.id};
  ForgetLocked(c);
  holders_.erase(c);
}

bool ChannelCache::Release(Holder holder, const std::string& model_id, const std::string& channel, transport::PeerId id, bool forget) {
  absl::MutexLock l(&mu_);
  return ReleaseLocked(holder, {model_id, channel, id.id}, forget);
}

std::vector<ChannelCache::Keyed> ChannelCache::ReleaseAll(Holder holder, bool forget) {
  absl::MutexLock l(&mu_);
  std::vector<Conn> mine;
  for (const auto& [c, hs] : holders_) {
    if (hs.count(holder) > 0) mine.push_back(c);
  }
  std::vector<Keyed> out;
  for (const Conn& c : mine) {
    if (ReleaseLocked(holder, c, forget)) out.push_back({std::get<0>(c), std::get<1>(c), transport::PeerId{std::get<2>(c)}});
  }
  return out;
}

std::vector<ChannelCache::Keyed> ChannelCache::Abandon(Holder holder, const std::set<std::string>& busy) {
  absl::MutexLock l(&mu_);
  std::vector<Keyed> out;
  for (auto it = holders_.begin(); it != holders_.end();) {
    const Conn& c = it->first;
    if (it->second.count(holder) == 0) {
      ++it;
      continue;
    }
    ForgetLocked(c);
    if (it->second.size() > 1 && busy.count(std::get<1>(c)) == 0) {
      ++it;
      continue;
    }
    out.push_back({std::get<0>(c), std::get<1>(c), transport::PeerId{std::get<2>(c)}});
    it = holders_.erase(it);
  }
  return out;
}

size_t ChannelCache::Holders(const std::string& model_id, const std::string& channel, transport::PeerId id) const {
  absl::MutexLock l(&mu_);
  auto it = holders_.find({model_id, channel, id.id});
  return it == holders_.end() ? 0 : it->second.size();
}

std::vector<ChannelCache::Keyed> ChannelCache::All() const {
  absl::MutexLock l(&mu_);
  std::vector<Keyed> out;
  std::set<Conn> seen;
  for (auto& [key, e] : channels_) {
    out.push_back({key.first, key.second, e.id});
    seen.insert({key.first, key.second, e.id.id});
  }
  for (const auto& [c, hs] : holders_) {
    if (seen.count(c) == 0) out.push_back({std::get<0>(c), std::get<1>(c), transport::PeerId{std::get<2>(c)}});
  }
  return out;
}

}  // namespace wb::daemon::node
