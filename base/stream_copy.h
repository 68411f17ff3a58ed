#pragma once
// Copies with stores that bypass the cache (non-temporal), for large copies whose destination is
// not read again soon by this thread: the sender's next cache copy of a delta box, a version copied
// into a worker's live memory. Why: a regular store to a line not in cache first reads it
// (read-for-ownership), so a copy moves each destination byte over the memory bus twice; and glibc
// uses non-temporal stores only above a threshold derived from the last-level cache size, which on
// VMs that report a huge L3 is never reached. About 30% less time per copied GB on the 2-core CI VM.
//
// Contract: same effect as memcpy (no overlap allowed). The stores are weakly ordered: call
// StreamFence() before another thread or process may read the destination (before the release
// that publishes it). Not x86-64: plain memcpy, and StreamFence() does nothing.

#include <cstddef>
#include <cstdint>

namespace wb {

// Copies n bytes; pieces shorter than kStreamCopyMin go through memcpy (no fence needed for them).
void StreamCopy(void* dst, const void* src, size_t n);
// Orders every earlier StreamCopy store before later stores (sfence).
void StreamFence();
// Below this, StreamCopy is memcpy: small copies are cheaper through the cache.
inline constexpr size_t kStreamCopyMin = 4096;

}  // namespace wb
