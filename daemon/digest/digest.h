#pragma once
// End-to-end digests of boxes of weights (issue 17.4; docs/daemon.md "End-to-end digests"). PURE:
// no I/O, no protobuf, no transports; plain memory in, 64-bit digests out.
//
// A version is proven op by op: the sending node digests what the op reads (its source box on the
// trainer's snapshot, live buffer or a relay's staging), every receiving node digests what landed
// (its destination box in staging), and the coordinator compares the two before it commits.
// The two sides keep their elements in different layouts (a trainer's FSDP row chunk, a rollout's
// fused / transposed / strided piece), so the digest must not depend on the layout:
//
//   canonical stream  = the box's elements in row-major order of `shape` (the last dim fastest),
//                       each element's bytes verbatim (no dtype knowledge: bit-exact);
//   chunk k           = bytes [k * C, (k + 1) * C) of the stream, C = kChunkElements elements
//                       (the last chunk may be shorter), hashed XXH3-64 with seed k;
//   digest            = XXH3-64 over (stream bytes as u64 LE, then every chunk hash as u64 LE),
//                       seed kDigestSeed.
//
// Chunking makes one box hashable by several threads; the chunk size is a constant of the format
// (in elements), so the digest depends only on the element bytes, the shape and the element size
// (never on strides, offsets, the thread count or how the work was split). An empty box (a zero
// dim) has the digest of the empty stream.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wb::digest {

using Digest = uint64_t;

// Elements per chunk of the canonical stream (1 Mi elements: 2 MiB of bf16, big enough that the
// per-chunk overhead vanishes, small enough to spread one big tensor over many threads).
inline constexpr int64_t kChunkElements = int64_t{1} << 20;
inline constexpr uint64_t kDigestSeed = 0x5742444947455354ull;  // "WBDIGEST"

// A box of elements in memory: element at index vector i (0 <= i[d] < shape[d]) is at
//   base + sum_d i[d] * strides[d] * element_size
// (strides in ELEMENTS, >= 0, one per dim; an empty shape is one element) - the same form as a
// transport::CopyOp side. `base` may be null only for an empty box.
struct StridedBox {
  const uint8_t* base = nullptr;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  int32_t element_size = 1;
};

// Digest of one box on the calling thread. INVALID_ARGUMENT for a malformed box (rank mismatch,
// negative dim or stride, element_size <= 0, null base of a non-empty box).
absl::StatusOr<Digest> BoxDigest(const StridedBox& box);

// The digest of a quantised box (a sender-quantised op's side, a certified quantised source): the
// digest of its two digests, elements then scales, as one box of two 8-byte elements. One function
// so that every node combines them alike.
Digest QuantizedDigest(Digest elements, Digest scales);

// Digests of many boxes, spread over up to `threads` threads (chunks of all boxes are shared out
// together, so a few big tensors and many small ones both keep the threads busy). out[i] is
// BoxDigest(boxes[i]). DEADLINE_EXCEEDED when `deadline` passes first (checked between chunks).
absl::StatusOr<std::vector<Digest>> DigestMany(const std::vector<StridedBox>& boxes, int threads,
                                               absl::Time deadline = absl::InfiniteFuture());

// Digests of boxes added over time (issue 17.4's cost: a version's boxes are hashed as they become
// final - a trainer's snapshot at once, what landed as its batch completes - while the transport is
// still moving other bytes, instead of all of them after the last bucket). Chunks of every added box
// are shared out over up to `threads` background threads, started on the first Add; Finish() hashes
// on the calling thread too until every chunk is done. The bytes of an added box must not change
// until Finish returns or the pool is destroyed (the destructor stops and joins the threads: after
// a failed version the caller may destroy it at once).
class DigestPool {
 public:
  struct Options {
    int threads = 8;
    absl::Time deadline = absl::InfiniteFuture();
    // Linux nice of the background threads (0: as the caller). Hashing ahead is work the version
    // needs only at its end: while buckets run, the transports' threads go first on a busy host.
    int nice = 0;
  };
  explicit DigestPool(Options options);
  ~DigestPool();
  DigestPool(const DigestPool&) = delete;
  DigestPool& operator=(const DigestPool&) = delete;

  // Queues `box`; returns its id (0, 1, ...: ids index Finish's answer). INVALID_ARGUMENT for a
  // malformed box (as BoxDigest); FAILED_PRECONDITION after Finish.
  absl::StatusOr<size_t> Add(const StridedBox& box);
  // Waits until every added box is hashed (helping on this thread) and returns the digests by id.
  // DEADLINE_EXCEEDED when the deadline passes first. Call once.
  absl::StatusOr<std::vector<Digest>> Finish();
  // CPU seconds spent hashing box `id` so far (all its chunks, every thread; for the cost
  // figures). 0 for an unknown id.
  double HashSeconds(size_t id) const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// Chunk hashes computed elsewhere (issue 17.4's cost: host_tcp hashes an op's bytes as they cross,
// transport::UnitHashes): the digest of a stream of `stream_bytes` bytes whose chunk k (bytes
// [k * chunk_bytes, ...), chunk_bytes = kChunkElements * element size) hashed XXH3-64 with seed k
// to chunk_hashes[k] - the same value BoxDigest gives for a box with that canonical stream.
// INVALID_ARGUMENT when the number of chunk hashes does not fit the stream.
absl::StatusOr<Digest> DigestFromChunks(int64_t stream_bytes, int32_t element_size, const std::vector<uint64_t>& chunk_hashes);
// Bytes of one chunk of the canonical stream for elements of `element_size` bytes.
inline int64_t ChunkBytes(int32_t element_size) { return kChunkElements * element_size; }

// The chunk hashes of a canonical stream fed in order, piece by piece, wherever its bytes are
// (issue 17.4's cost: the delta codec hashes the box it packs or decodes chunk by chunk while the
// chunk is in cache; a strided box's runs as they are written): chunk k hashed XXH3-64 with seed k,
// the same values BoxDigest computes, for DigestFromChunks. Pieces may have any length and cut
// chunks anywhere. Not thread-safe; one stream per hasher.
class ChunkStreamHasher {
 public:
  explicit ChunkStreamHasher(int32_t element_size);
  ~ChunkStreamHasher();
  ChunkStreamHasher(const ChunkStreamHasher&) = delete;
  ChunkStreamHasher& operator=(const ChunkStreamHasher&) = delete;
  // The next `n` bytes of the stream.
  void Update(const uint8_t* p, size_t n);
  int64_t bytes() const { return bytes_; }
  // The chunk hashes of everything fed (DigestFromChunks(bytes(), element_size, ...)); the hasher
  // starts a new, empty stream afterwards.
  std::vector<uint64_t> Finish();

 private:
  struct State;
  std::unique_ptr<State> s_;
  int64_t chunk_bytes_ = 0;
  int64_t bytes_ = 0;
  std::vector<uint64_t> hashes_;
};

// The digest as it appears in messages: 16 lowercase hex digits.
std::string DigestHex(Digest d);

}  // namespace wb::digest
