#pragma once
// host_tcp's acceptor side: authenticated connections parked until a Connect of the same
// (dialer instance, connection round) takes them (docs/transport.md, "host_tcp channel setup:
// rounds"). Keyed by round so that a Connect whose caller gave up on its attempt (an aborted
// version, still waiting until its deadline) never takes the connections the dialer makes for the
// next attempt between the same two instances: before rounds it did, and the next attempt's own
// Connect then waited out its whole deadline.
//
// The bounds (docs/transport.md, "host_tcp: what an authenticated peer can hold"):
//   - max_connections over all keys, checked before the handshake (Admit reserves a place, so a
//     dialer that would find the park full is closed before proving itself and redials); a key a
//     Connect waits for is always admitted and never expires;
//   - max_rounds_per_instance: rounds of one instance parked without a Connect waiting for them;
//     parking a further round closes that instance's round whose last connection arrived first
//     (`superseded`): a dialer that opened a newer round has moved on from the older ones;
//   - timeout: a key no Connect waits for has its connections closed `timeout` after its last one
//     arrived (checked in Admit and Park);
//   - a parked connection its dialer closed is dropped when a Connect looks at its key (`hung_up`);
//   - a cancelled round (Transport::CancelRound) has its sets closed at once (`cancelled`).
//
// Not thread-safe: the transport guards it with its own mutex. Owns the parked fds (closes them
// when they are dropped, expired, superseded, or on destruction) until Take hands them out.

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace wb::transport {

class ParkingTable {
 public:
  struct Limits {
    int max_connections = 1024;
    int max_rounds_per_instance = 16;
    absl::Duration timeout = absl::Seconds(60);
  };
  struct Counters {
    int64_t parked = 0;      // now: fds held
    int64_t refused = 0;     // hellos Admit turned away (park full)
    int64_t expired = 0;     // fds closed past `timeout`
    int64_t hung_up = 0;     // fds a Connect found closed by their dialer
    int64_t superseded = 0;  // fds closed past max_rounds_per_instance
    int64_t cancelled = 0;   // fds closed because their round was cancelled (CloseRound, RefuseCancelled)
  };
  // (dialer instance, round)
  using Key = std::pair<std::string, std::string>;

  explicit ParkingTable(const Limits& limits) : limits_(limits) {}
  ~ParkingTable() { CloseAll(); }
  ParkingTable(const ParkingTable&) = delete;
  ParkingTable& operator=(const ParkingTable&) = delete;

  // Before the handshake of a hello claiming `key`: expires old sets, then admits it when a
  // Connect waits for `key` (no place reserved: *reserved = false) or when a place is free (one is
  // reserved until Park or Unreserve). False (counted in `refused`): the park is full.
  bool Admit(const Key& key, absl::Time now, bool* reserved);
  // Gives back a place Admit reserved (the handshake failed, or its connection was parked).
  void Unreserve();
  // An authenticated connection of stream `idx` of `total` for `key`. The same stream again (a
  // redial) replaces the older fd.
  void Park(const Key& key, uint32_t idx, int total, int fd, absl::Time now);

  // A Connect waiting for `key` (Await / Unawait pair; counts nest).
  void Await(const Key& key);
  void Unawait(const Key& key);
  bool Awaited(const Key& key) const { return awaited_.count(key) > 0; }
  // Connects waiting for `instance`, over all rounds.
  int AwaitedFor(const std::string& instance) const;
  // Connections parked for `key` now.
  int ParkedFor(const Key& key) const {
    auto it = sets_.find(key);
    return it == sets_.end() ? 0 : static_cast<int>(it->second.fds.size());
  }

  // Drops the key's parked fds their dialer closed, then true when its full set is parked.
  bool Ready(const Key& key);
  // The key's fds in stream order ([0] control), removed from the table (the caller owns them).
  std::vector<int> Take(const Key& key);

  // Transport::CancelRound: closes the sets of `round` of every instance (awaited or not).
  void CloseRound(const std::string& round);
  // A hello of a cancelled round, closed before the handshake: counted with the sets CloseRound closed.
  void RefuseCancelled() { ++counters_.cancelled; }

  // Closes the sets no Connect waits for whose last connection arrived more than `timeout` ago.
  void Expire(absl::Time now);
  void CloseAll();

  // Instances with something parked or awaited (their per-peer secrets must stay).
  void InstancesInUse(std::set<std::string>& out) const;
  // For a Connect's deadline message: rounds parked for `instance` other than `round`, and how many
  // connections each holds (at most `max` rounds listed; *more the rest).
  std::vector<std::pair<std::string, int>> OtherRounds(const std::string& instance, const std::string& round, size_t max,
                                                       size_t* more) const;

  const Counters& counters() const { return counters_; }
  // The instance of the last refused hello (for the deadline message), "" if none.
  const std::string& last_refused_instance() const { return last_refused_instance_; }
  int64_t reserved() const { return reserved_; }

 private:
  struct Set {
    std::map<uint32_t, int> fds;  // stream idx -> fd
    int total = 0;                // the stream count the hellos announced (the last one's)
    absl::Time last;              // when the last one was parked (timeout runs from here)
  };
  void CloseSet(std::map<Key, Set>::iterator it, int64_t* counter);
  // Past max_rounds_per_instance for `instance`: closes its oldest unawaited rounds other than
  // `keep` until it is within the bound.
  void Supersede(const std::string& instance, const Key& keep);

  const Limits limits_;
  std::map<Key, Set> sets_;
  std::map<Key, int> awaited_;  // key -> Connects waiting for it
  int64_t reserved_ = 0;        // places taken by handshakes in progress
  Counters counters_;
  std::string last_refused_instance_;
};

}  // namespace wb::transport
