#pragma once
// The node's healthy cross-node channels, per (model, channel name): a later version of the model
// reuses its channel to a peer instead of connecting again (docs/daemon.md "Flow of one version").
// A channel is tied to the peer's transport instance: a peer that restarted has a new instance and
// its old channel is stale (dropped, never reused). Own lock, a leaf: nothing else is taken while it
// is held, so callers may hold node::Versions::mu_ around these calls.
//
// Disconnecting is the caller's (outside any lock): these calls only say which channel to drop.

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "transport/transport.h"

namespace wb::daemon::node {

class ChannelCache {
 public:
  struct Entry {
    transport::PeerId id;
    std::string peer_instance;  // the peer transport's instance_id() the channel was made with
  };
  struct Keyed {
    std::string model_id, channel;
    transport::PeerId id;
  };

  std::optional<Entry> Find(const std::string& model_id, const std::string& channel) const;
  // What a new version of the model may do with the cached channel to a peer whose transport is
  // `peer_instance` now: `reuse` it (same instance), or drop a `stale` one (the peer restarted).
  struct Lookup {
    transport::PeerId reuse = transport::kNoPeer;
    transport::PeerId stale = transport::kNoPeer;
  };
  Lookup ForPeer(const std::string& model_id, const std::string& channel, const std::string& peer_instance) const;
  // Caches `id` as the channel; returns the different channel it replaced (kNoPeer if none).
  transport::PeerId Put(const std::string& model_id, const std::string& channel, transport::PeerId id, const std::string& peer_instance);
  // Forgets the channel if it is still `id` (a newer one stays); true when it was.
  bool EraseIf(const std::string& model_id, const std::string& channel, transport::PeerId id);
  std::vector<Keyed> All() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, Entry> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace wb::daemon::node
