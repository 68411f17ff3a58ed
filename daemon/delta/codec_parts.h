#pragma once
// Internal parts of the delta codec (codec.cc, scan.cc): the stream digest, the LEB128 reader, the
// digest element size and the encoder's prefetch of the next chunk. Not an API: codec.h is.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/delta/codec.h"
#include "daemon/digest/digest.h"

namespace wb::delta::internal {

// The digest of a stream (docs/daemon.md "Deltas", codec): issue 17.4's digest of the bytes as a
// one-dimensional box of `es`-byte elements - XXH3-64 per 2^20 elements, seed = chunk index,
// combined (digest::ChunkStreamHasher, digest::DigestFromChunks) - in `lo`, the stream's length in
// `hi`. The same hashes are the end-to-end digests' unit hashes, so a box is hashed once per side
// for both the stream's check and issue 17.4 (one read of a cached chunk instead of two).
// `es` must be 1, 2, 4 or 8 and divide what is fed (EncodeImpl and Decode check both first; the
// public helpers pass DigestElemSize).
class StreamDigest {
 public:
  explicit StreamDigest(int es) : es_(es), hasher_(es) {}
  void Update(const uint8_t* p, size_t n) { hasher_.Update(p, n); }
  // The digest of everything fed; `units` (optional) receives the chunk hashes.
  Digest Finish(std::vector<uint64_t>* units = nullptr) {
    const int64_t bytes = hasher_.bytes();
    std::vector<uint64_t> hashes = hasher_.Finish();
    // Cannot fail: the hashes were made from `bytes` in chunks of this element size.
    absl::StatusOr<digest::Digest> d = digest::DigestFromChunks(bytes, es_, hashes);
    if (units != nullptr) *units = std::move(hashes);
    return Digest{d.ok() ? *d : 0, static_cast<uint64_t>(bytes)};
  }

 private:
  int es_;
  digest::ChunkStreamHasher hasher_;
};

inline constexpr int kMaxVarint = 4;  // LEB128 gaps and ordinals are < 2^24 < 2^28

// Reads a LEB128 value of at most kMaxVarint bytes from [*p, end); false if truncated or longer.
inline bool GetVarint(const uint8_t*& p, const uint8_t* end, uint64_t* v) {
  uint64_t x = 0;
  for (int i = 0; i < kMaxVarint; ++i) {
    if (p >= end) return false;
    const uint8_t b = *p++;
    x |= uint64_t{b & 0x7Fu} << (7 * i);
    if ((b & 0x80) == 0) {
      *v = x;
      return true;
    }
  }
  return false;
}

// The element size `bytes` bytes are digested with (DigestOf's contract): `elem_size`, or 1 for a
// size other than 1, 2, 4, 8 or a length that is not a whole number of them.
inline int DigestElemSize(int elem_size, size_t bytes) {
  const bool valid = elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8;
  return valid && bytes % static_cast<size_t>(elem_size) == 0 ? elem_size : 1;
}

// Pulls the next chunk's base and target into cache a few lines at a time while the current
// chunk's in-cache work (the walk over changed elements, the hash) runs: without it the memory sits
// idle during that work and the next scan waits for every line (the hardware prefetcher only
// follows the loads it sees).
struct ChunkPrefetch {
  const uint8_t* a = nullptr;
  const uint8_t* b = nullptr;
  size_t bytes = 0;
  size_t next = 0;  // first byte not yet prefetched
  // Prefetches the lines of both ranges up to byte `upto`.
  void To(size_t upto) {
    upto = std::min(upto, bytes);
    for (; next < upto; next += 64) {
      __builtin_prefetch(a + next, 0, 2);
      if (b != nullptr) __builtin_prefetch(b + next, 0, 2);
    }
  }
};

}  // namespace wb::delta::internal
