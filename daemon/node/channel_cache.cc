#include "daemon/node/channel_cache.h"

namespace wb::daemon::node {

std::optional<ChannelCache::Entry> ChannelCache::Find(const std::string& model_id, const std::string& channel) const {
  absl::MutexLock l(&mu_);
  auto it = channels_.find({model_id, channel});
  if (it == channels_.end()) return std::nullopt;
  return it->second;
}

ChannelCache::Lookup ChannelCache::ForPeer(const std::string& model_id, const std::string& channel, const std::string& peer_instance) const {
  Lookup out;
  std::optional<Entry> e = Find(model_id, channel);
  if (!e.has_value()) return out;
  // A peer that restarted (new transport instance): the old incarnation's channel is dead and must
  // be disconnected (its sockets closed), not overwritten.
  (e->peer_instance == peer_instance ? out.reuse : out.stale) = e->id;
  return out;
}

transport::PeerId ChannelCache::Put(const std::string& model_id, const std::string& channel, transport::PeerId id,
                                    const std::string& peer_instance) {
  absl::MutexLock l(&mu_);
  Entry& slot = channels_[{model_id, channel}];
  const transport::PeerId replaced = slot.id != transport::kNoPeer && slot.id != id ? slot.id : transport::kNoPeer;
  slot = Entry{id, peer_instance};
  return replaced;
}

bool ChannelCache::EraseIf(const std::string& model_id, const std::string& channel, transport::PeerId id) {
  absl::MutexLock l(&mu_);
  auto it = channels_.find({model_id, channel});
  if (it == channels_.end() || it->second.id != id) return false;
  channels_.erase(it);
  return true;
}

std::vector<ChannelCache::Keyed> ChannelCache::All() const {
  absl::MutexLock l(&mu_);
  std::vector<Keyed> out;
  for (auto& [key, e] : channels_) out.push_back({key.first, key.second, e.id});
  return out;
}

}  // namespace wb::daemon::node
