#pragma once
// Egress pacing for host_tcp: caps the bytes one transport hands to its sockets per second, over
// all peers, streams and NICs together.
//
// Why: the weight transfer shares the NIC with the trainer's own collectives (gradient all-reduce,
// FSDP gathers) and with rollout traffic; an operator caps WeightBridge's share
// (`weightbridged --max_send_gbps`). The same cap lets one host emulate a NIC of a given speed
// over loopback (bench/e2e --link_gbps), where the kernel would otherwise copy at memory speed.
//
// Model: a single virtual link of `bytes_per_second`. Reserve(n) books the next n bytes of link
// time and returns when they may start: max(now, end of the previous booking). Idle time is not
// banked (no burst beyond the line rate: a NIC does not send faster after a pause). A writer sends
// its chunk after Acquire returns, so over any window the bytes sent exceed rate x window by at
// most one chunk per writer.
//
// Thread-safe. Waits go through the injected Clock (simulated time in tests). Every wait is
// bounded: a booking of n bytes waits at most (bytes booked ahead of it + n) / rate, and writers
// book one chunk at a time.

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/clock.h"

namespace wb::transport {

class SendPacer {
 public:
  // `bytes_per_second` > 0. `clock` outlives the pacer (Clock::Real() in the daemon).
  SendPacer(double bytes_per_second, Clock* clock);

  // Books `bytes` (>= 0) of link time; returns the time at which they may be sent.
  absl::Time Reserve(int64_t bytes);

  // Reserve, then sleep on the clock until that time. Returns the time waited. (host_tcp calls
  // Reserve and waits on its own mutex instead, so that a broken peer ends the wait.)
  absl::Duration Acquire(int64_t bytes);

  double bytes_per_second() const { return bytes_per_second_; }

 private:
  const double bytes_per_second_;
  Clock* const clock_;
  absl::Mutex mu_;
  absl::Time next_free_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace wb::transport
