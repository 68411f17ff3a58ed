#pragma once
// The node's cross-node channels, per (model, channel name): the healthy one a later version of the
// model reuses instead of connecting again (docs/daemon.md "Flow of one version"), and which running
// executions hold each connection. A channel is tied to the peer's transport instance: a peer that
// restarted has a new instance and its old channel is stale (dropped, never reused).
//
// Several executions of one model run at once on a node (the next version, a catch-up) and share
// the cached channel. A connection is disconnected only once nothing uses it: neither the cache nor
// a running execution (a holder). Forgetting a channel (a failed execution's, a stale one, one
// replaced by a newer connection) takes it out of the cache at once, so that later executions set
// up a fresh one, while the executions still holding it finish on it; the last one's Release says
// to disconnect it. Before, a failed or aborted execution disconnected every channel it used, and a
// sibling still running on one failed ("host_tcp batch ...: unknown peer N"; docs/soak.md).
//
// Own lock, a leaf: nothing else is taken while it is held, so callers may hold
// node::Versions::mu_ around these calls. Disconnecting is the caller's (outside any lock): these
// calls only say which connection to drop.

#include <map>
#include <optional>
#include <set>
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
  // What holds a connection while it runs: an execution (node::Exec's address; every hold is
  // released before the execution ends, so an address is never mistaken for a later execution's).
  using Holder = const void*;
  struct Entry {
    transport::PeerId id;
    std::string peer_instance;  // the peer transport's instance_id() the channel was made with
    // The connection round it was connected in (node::ConnectRound: both nodes name it alike, so it
    // tells the two ends of one connection from those of another); empty: the empty round.
    std::string round;
  };
  struct Keyed {
    std::string model_id, channel;
    transport::PeerId id;
  };

  std::optional<Entry> Find(const std::string& model_id, const std::string& channel) const;
  // What a new execution `holder` of the model may do with the cached channel to a peer whose
  // transport is `peer_instance` now: `reuse` it (same instance; held by `holder` from now on, so
  // that a sibling forgetting it meanwhile does not disconnect it under this one), or drop a
  // `stale` one (the peer restarted): it is forgotten here, and `stale` is set only when nothing
  // holds it (disconnect it now; else its last holder's Release returns it).
  struct Lookup {
    transport::PeerId reuse = transport::kNoPeer;
    std::string round;  // reuse's Entry::round
    transport::PeerId stale = transport::kNoPeer;
  };
  Lookup ForPeer(const std::string& model_id, const std::string& channel, const std::string& peer_instance, Holder holder);
  // Caches `id` (connected in `round`) as the channel, held by `holder`. Returns the different
  // channel it replaced when nothing holds that one (disconnect it now); one still held is
  // disconnected after its last Release. kNoPeer if none.
  transport::PeerId Put(const std::string& model_id, const std::string& channel, transport::PeerId id, const std::string& peer_instance,
                        Holder holder, const std::string& round = "");
  // Takes `id` out of the cache if it is still the cached channel (a newer one stays). True when
  // nothing holds it: disconnect it now (else the last holder's Release says so).
  bool Forget(const std::string& model_id, const std::string& channel, transport::PeerId id);
  // Forgets `id` and its holders entirely: the caller disconnects it now, whoever holds it (their
  // batches fail). Later Releases of it return nothing.
  void Drop(const std::string& model_id, const std::string& channel, transport::PeerId id);
  // `holder` lets go of `id` (forgetting it first with `forget`). True when `id` is now neither
  // cached nor held: disconnect it now.
  bool Release(Holder holder, const std::string& model_id, const std::string& channel, transport::PeerId id, bool forget);
  // Every connection `holder` holds, released (each forgotten first with `forget`: a failed
  // execution's channels are not reused). Returns those neither cached nor held now.
  std::vector<Keyed> ReleaseAll(Holder holder, bool forget);
  // An aborted execution `holder`: every connection it holds leaves the cache. Those no other
  // execution holds, and those on a channel in `busy` (its batches are in flight there: only a
  // disconnect ends its waits, and the peer may never post their mirrors, which would stall the
  // channel for everyone), are forgotten entirely and returned: disconnect them now. The others
  // stay held, by it until its Release and by the executions sharing them, which finish on them.
  std::vector<Keyed> Abandon(Holder holder, const std::set<std::string>& busy);
  // How many holders `id` has (tests, logs).
  size_t Holders(const std::string& model_id, const std::string& channel, transport::PeerId id) const;
  // Every connection known: cached or held.
  std::vector<Keyed> All() const;

 private:
  using Conn = std::tuple<std::string, std::string, uint64_t>;  // model, channel, PeerId::id
  bool CachedLocked(const Conn& c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool UnusedLocked(const Conn& c) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ForgetLocked(const Conn& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReleaseLocked(Holder holder, const Conn& c, bool forget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, Entry> channels_ ABSL_GUARDED_BY(mu_);
  std::map<Conn, std::set<Holder>> holders_ ABSL_GUARDED_BY(mu_);  // never an empty set
};

}  // namespace wb::daemon::node
