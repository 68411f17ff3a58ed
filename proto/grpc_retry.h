#pragma once
// Calls a daemon's thread pool turned away. Each in-flight call of a gRPC sync server holds one
// of its threads, and the daemons cap them (grpc::ResourceQuota, daemon/front.cc: blocked calls
// plus headroom). A call that arrives while every allowed thread is busy (a burst: e.g. hundreds
// of WaitVersion calls refused at the blocked-call limit, each refusal briefly holding a thread)
// is answered RESOURCE_EXHAUSTED "Server Threadpool Exhausted" by gRPC itself: the service's
// handler never ran, so the same request can be sent again, whatever the method (nothing was
// done). The daemons' clients do so, bounded by the call's own deadline; every other answer
// (including the daemons' own RESOURCE_EXHAUSTED refusals, e.g. "limit 400" blocked calls) is
// returned as it is.

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/clock.h"

namespace wb {

// gRPC's message for a call its sync server had no thread for (src/cpp/server/server_cc.cc).
inline constexpr absl::string_view kServerThreadpoolExhausted = "Server Threadpool Exhausted";

// True for gRPC's own thread-pool refusal (after FromGrpcStatus: same code and message).
inline bool IsServerThreadpoolExhausted(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted && status.message() == kServerThreadpoolExhausted;
}

// Backoff between tries: 2 ms, doubling, at most 100 ms (a burst of refusals lasts milliseconds;
// the cap keeps a long overload from being polled hard).
inline constexpr absl::Duration kServerBusyFirstBackoff = absl::Milliseconds(2);
inline constexpr absl::Duration kServerBusyMaxBackoff = absl::Milliseconds(100);

// Runs `call()` (one unary call with a fresh grpc::ClientContext, converted with FromGrpcStatus)
// and again after a backoff on `clock` while it answers IsServerThreadpoolExhausted and the next
// try would start before `deadline`; returns the last answer. `tries` (optional) receives how
// many calls were made.
template <typename Fn>
absl::Status CallWhileServerBusy(Clock* clock, absl::Time deadline, Fn&& call, int* tries = nullptr) {
  absl::Duration backoff = kServerBusyFirstBackoff;
  for (int n = 1;; ++n) {
    absl::Status s = std::forward<Fn>(call)();
    if (tries != nullptr) *tries = n;
    if (!IsServerThreadpoolExhausted(s)) return s;
    const absl::Time next = clock->Now() + backoff;
    if (next >= deadline) return s;
    clock->SleepUntil(next);
    backoff = std::min(backoff * 2, kServerBusyMaxBackoff);
  }
}

}  // namespace wb
