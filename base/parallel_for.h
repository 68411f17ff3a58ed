#pragma once
// ParallelFor(n, max_threads, fn): fn(0) .. fn(n - 1), each index exactly once, on up to
// `max_threads` threads (the calling thread is one of them), returning when every call returned.
//
// Contract: indices are handed out in increasing order from a shared counter, so a few slow calls
// do not hold up the rest (dynamic balancing); fn must be safe to call concurrently for different
// indices and must not throw. max_threads <= 1 or n <= 1 runs everything on the calling thread, in
// order. No thread outlives the call. This replaces the hand-written "vector<std::thread> + atomic
// counter + join" fan-outs (per-node RPCs of a version, copies, quantising, benches).

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace wb {

template <typename Fn>
void ParallelFor(size_t n, size_t max_threads, Fn&& fn) {
  const size_t threads = std::min(n, std::max<size_t>(1, max_threads));
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

// Up to `cap` threads, never more than the machine has (at least 1).
inline size_t HardwareThreads(size_t cap) {
  return std::max<size_t>(1, std::min<size_t>(cap, std::thread::hardware_concurrency()));
}

}  // namespace wb
