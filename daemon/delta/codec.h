#pragma once
// Lossless delta codec between two versions of the same bytes (issue 17.2; docs/daemon.md
// "Deltas (design and status)"). Pure: no I/O, no protobuf, no threads; one call encodes or
// decodes one contiguous byte range (the executor's unit will be one op's box in canonical order).
//
// Encode(base, target) cuts the elements into chunks of `chunk_elems` and picks per chunk, by the
// bytes each would take (measured on that chunk, not guessed):
//   same       the chunk did not change: no payload;
//   bitmap     one bit per element + one value per changed element;
//   index      the changed elements' positions as LEB128 gaps + their values (few changes);
//   dense_diff one value per element (nearly every element changed by a small amount: fp32);
//   raw        the target bytes (random-looking changes).
// A value is the element's difference target - base as an integer of the element's width
// (wrapping), zigzag-coded, stored in its low `width` bytes; the few values that need more bytes
// ("exceptions", e.g. a bf16 sign flip near 0) carry their high bytes in a list after the values.
// For bf16 a +-1..127 ulp change is one byte, wherever the carry goes.
//
// The stream names the base it was made against: base version and digest of the base bytes (DigestOf:
// issue 17.4's chunked XXH3-64 digest of the box and its length), plus the digest of the target. Decode checks version and digest against the destination's
// base BEFORE it writes a byte (FAILED_PRECONDITION naming both: the sender must send the full
// version), and the target digest over what it wrote (DATA_LOSS): a wrong byte never passes.
// Every length, count, index and kind read from the stream is checked against the stream's size
// and the chunk's element count (DATA_LOSS naming the chunk and its element range), so hostile or
// truncated input gives an error, never a crash or an out-of-bounds access.
//
// Wire format (version 2, little-endian; format 1 had XXH3-128 digests and is refused):
//   header, 88 bytes: "WBD1" magic (u32 0x31444257), format u16 = 2, elem_size u8 (1, 2, 4, 8),
//     flags u8 = 0, chunk_elems u32 (multiple of 64, 64..2^24), reserved u32 = 0, total_bytes u64,
//     base_version u64, target_version u64, base digest (lo u64, hi u64), target digest (lo, hi),
//     num_chunks u64 (= ceil(total_bytes / elem_size / chunk_elems)), XXH3-64 of the 80 bytes before.
//   num_chunks chunks, each: kind u8, width u8, reserved u16 = 0, changed u32, exceptions u32,
//     payload_bytes u32, then the payload:
//     same:       nothing (width, changed, exceptions 0);
//     raw:        n * elem_size target bytes (width, changed, exceptions 0);
//     bitmap:     ceil(n / 8) bytes (bit j of byte k = element 8k + j changed; bits past n zero),
//                 then `changed` values of `width` bytes, then the exceptions;
//     index:      `changed` LEB128 gaps (first = element index, then index - previous - 1), then
//                 the values and exceptions as for bitmap;
//     dense_diff: n values of `width` bytes (changed == n; unchanged elements are 0), exceptions.
//     exceptions: `exceptions` entries of a LEB128 gap over value ordinals (as the index gaps)
//                 followed by the value's bytes [width, elem_size).
//   n = chunk_elems, or the rest for the last chunk. 1 <= width <= elem_size for coded kinds, no
//   exceptions when width == elem_size. Nothing may follow the last chunk.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace wb::delta {

// A digest of some bytes (DigestOf): lo = issue 17.4's digest of them, hi = their length.
struct Digest {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const Digest& a, const Digest& b) { return a.lo == b.lo && a.hi == b.hi; }
  friend bool operator!=(const Digest& a, const Digest& b) { return !(a == b); }
  std::string ToString() const;  // 32 hex digits, hi first
};

// The codec's digest of `bytes` as a stream of `elem_size`-byte elements: `lo` is issue 17.4's
// digest of that one-dimensional box (digest::BoxDigest: XXH3-64 per 2^20 elements, seed = chunk
// index, combined), `hi` the length in bytes. Encode and decode compute it from the same chunk hashes
// the end-to-end digests use (EncodeOptions::target_unit_hashes, Decode's out_unit_hashes), so a
// box is hashed once per side. An elem_size other than 1, 2, 4, 8, or a length that is not a whole
// number of them, is hashed as 1-byte elements.
Digest DigestOf(absl::Span<const uint8_t> bytes, int elem_size);

inline constexpr uint32_t kDefaultChunkElems = 32768;  // 64 KiB of bf16
inline constexpr size_t kHeaderBytes = 88;
inline constexpr size_t kChunkHeaderBytes = 16;

enum class ChunkKind : uint8_t { kSame = 0, kRaw = 1, kBitmap = 2, kIndex = 3, kDenseDiff = 4 };
const char* ChunkKindName(ChunkKind kind);

// Sees consecutive pieces of a byte stream, in order (the target or the decoded output, a codec
// chunk at a time while it is in cache: issue 17.4's end-to-end digests take their unit hashes
// there instead of reading the box again).
using ChunkObserver = std::function<void(absl::Span<const uint8_t> piece)>;

struct VersionBytes {
  uint64_t version = 0;
  absl::Span<const uint8_t> bytes;
};

struct EncodeOptions {
  int elem_size = 2;  // 1 (fp8, int8, int4 pairs), 2 (bf16, fp16), 4 (fp32), 8
  uint32_t chunk_elems = kDefaultChunkElems;
  std::string_view what;  // names the bytes in errors, e.g. "tensor 'x' box [0:4096, 0:896]"
  // The digest of `base` when the caller recorded it (the target digest of the encode that made
  // that version): the encoder then does not hash the base. Taken as given: a wrong one makes the
  // receiver refuse the stream (never a wrong byte).
  std::optional<Digest> base_digest;
  // TEST ONLY: the portable scan even where a vector one exists (both must give the same stream).
  bool portable_scan = false;
  // Optional: called with each chunk of the target, in order, right after it was encoded (the
  // packed chunk EncodeFilling's `fill` wrote, or the caller's target bytes).
  ChunkObserver on_target;
  // Optional: receives the target's chunk hashes in issue 17.4's format (digest::ChunkStreamHasher),
  // of which the target digest is made, when the encode succeeds.
  std::vector<uint64_t>* target_unit_hashes = nullptr;
};

struct EncodeStats {
  uint64_t chunks[5] = {0, 0, 0, 0, 0};  // by ChunkKind
  uint64_t changed_elements = 0;         // elements whose bits differ
  uint64_t exceptions = 0;
  uint64_t encoded_bytes = 0;
  void Add(const EncodeStats& o);
};

// An upper bound of the encoded size (the buffer EncodeInto needs): header, one chunk header per
// chunk, the raw bytes, 8 bytes of slack.
size_t MaxEncodedBytes(size_t total_bytes, int elem_size, uint32_t chunk_elems = kDefaultChunkElems);

// Encodes `target` against `base` into `out` (at least MaxEncodedBytes long); returns the bytes
// used. INVALID_ARGUMENT (naming options.what and the values) for an elem_size other than 1, 2,
// 4, 8, a bad chunk_elems, base and target of different sizes or not a multiple of elem_size, or
// a short `out`. Reads base and target once (the digests are computed in the same pass).
// `target_digest` (optional) receives the target's digest (the next encode's base digest).
absl::StatusOr<size_t> EncodeInto(const VersionBytes& base, const VersionBytes& target, const EncodeOptions& options,
                                  absl::Span<uint8_t> out, EncodeStats* stats = nullptr, Digest* target_digest = nullptr);

// Writes the target's bytes [offset, offset + dst.size()) into `dst` (e.g. packs part of a box).
using FillFn = std::function<void(size_t offset, absl::Span<uint8_t> dst)>;

// The sender's fused pass (pack + encode): per chunk, `fill` writes the target's chunk into
// `target_out`, which is then hashed and encoded against `base` while it is in cache - one pass
// over the bytes instead of a pack, then an encode. On return `target_out` holds the whole target
// (the sender's copy for the next version) and `*target_digest` its digest. The same stream as
// EncodeInto over that target; errors as EncodeInto (base and target_out of one size).
absl::StatusOr<size_t> EncodeFilling(const VersionBytes& base, uint64_t target_version, const FillFn& fill,
                                     absl::Span<uint8_t> target_out, const EncodeOptions& options,
                                     absl::Span<uint8_t> out, Digest* target_digest, EncodeStats* stats = nullptr);

// EncodeInto, and the target copied into `target_copy` (its size) on the way, each chunk right after
// it was scanned, hashed and shown to `on_target`, with stores that bypass the cache: the sender's
// fast path for a contiguous source box (one read of base and source, one write of the copy;
// EncodeFilling packs into the copy first and reads it back). The same stream and digest as
// EncodeInto; INVALID_ARGUMENT for a copy of another size, else as EncodeInto. `target_copy` must
// not overlap the target, the base or `out`.
absl::StatusOr<size_t> EncodeCopying(const VersionBytes& base, const VersionBytes& target, absl::Span<uint8_t> target_copy,
                                     const EncodeOptions& options, absl::Span<uint8_t> out, Digest* target_digest,
                                     EncodeStats* stats = nullptr);

// FillAndDigest for a contiguous source: hashes `src` `chunk_bytes` at a time (each piece shown to
// `on_chunk`) and copies it into `target_out` (the same size) with cache-bypassing stores; returns
// DigestOf(src).
Digest CopyAndDigest(absl::Span<const uint8_t> src, absl::Span<uint8_t> target_out, int elem_size,
                     size_t chunk_bytes = 64 * 1024, const ChunkObserver& on_chunk = {},
                     std::vector<uint64_t>* unit_hashes = nullptr);

// Fills `target_out` through `fill`, `chunk_bytes` at a time, hashing each piece while in cache:
// returns DigestOf(target_out) (a box the sender keeps without a base to encode against).
// `on_chunk` (optional) sees each piece after it was filled.
Digest FillAndDigest(const FillFn& fill, absl::Span<uint8_t> target_out, int elem_size, size_t chunk_bytes = 64 * 1024,
                     const ChunkObserver& on_chunk = {}, std::vector<uint64_t>* unit_hashes = nullptr);
// The same into a new vector (sized to the result).
absl::StatusOr<std::vector<uint8_t>> Encode(const VersionBytes& base, const VersionBytes& target,
                                            const EncodeOptions& options, EncodeStats* stats = nullptr);

struct StreamHeader {
  int elem_size = 0;
  uint32_t chunk_elems = 0;
  uint64_t total_bytes = 0;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  Digest base_digest;
  Digest target_digest;
  uint64_t num_chunks = 0;
};

// Parses and checks the header alone (magic, format, its hash, field ranges, chunk count):
// DATA_LOSS naming the field otherwise. Lets a receiver check the base before it takes the rest.
absl::StatusOr<StreamHeader> ReadHeader(absl::Span<const uint8_t> stream, std::string_view what = "");

// FAILED_PRECONDITION unless the stream was made against (version, digest): "delta for W (version
// T) was made against version B digest X, but the destination holds version V digest Y".
absl::Status CheckBase(const StreamHeader& header, uint64_t version, const Digest& digest, std::string_view what = "");

struct DecodeBase {
  uint64_t version = 0;
  absl::Span<const uint8_t> bytes;
  // The digest of `bytes` if the destination recorded it when that version landed (the digests of
  // issue 17.4); otherwise Decode hashes `bytes` first (one more read of the base).
  std::optional<Digest> digest;
};

// Decodes `stream` against `base` into `out` (exactly header.total_bytes, not overlapping base).
// Before writing: the header and every chunk header are checked against the stream's size
// (DATA_LOSS), sizes (INVALID_ARGUMENT), then the base (CheckBase: FAILED_PRECONDITION). While
// writing: each chunk's payload is checked (DATA_LOSS naming chunk and element range), and at the
// end the digest of `out` against the target digest (DATA_LOSS). On any error `out` holds
// unspecified bytes (decode into staging the caller can discard, never into live weights).
// `on_out` (optional) sees each chunk of `out` right after it was decoded, in order, before the
// target digest is checked: what it saw counts only when Decode returns OK (a failed attempt may
// have shown it some chunks).
// `out_unit_hashes` (optional) receives, when Decode returns OK, the chunk hashes (issue 17.4's
// format) of `out` the target digest was checked with.
absl::Status Decode(absl::Span<const uint8_t> stream, const DecodeBase& base, absl::Span<uint8_t> out,
                    std::string_view what = "", const ChunkObserver& on_out = {},
                    std::vector<uint64_t>* out_unit_hashes = nullptr);

// Decode in place: `data` holds the base (version `base_version`; `base_digest` as
// DecodeBase::digest) and receives the target. The same checks, in the same order, as Decode: an
// error before the first write (header, chunk headers, sizes, base version and digest) leaves
// `data` untouched; an error after it (a chunk's payload, the target digest) leaves `data` holding
// unspecified bytes - neither base nor target - so the caller must treat its base as gone (decode
// in place only into staging it can refill, never into live weights). Reads each element of the
// base once and writes only the elements that changed (plus raw chunks), then hashes each chunk
// while it is in cache: no copy of the base.
absl::Status DecodeInPlace(absl::Span<const uint8_t> stream, uint64_t base_version, std::optional<Digest> base_digest,
                           absl::Span<uint8_t> data, std::string_view what = "", const ChunkObserver& on_out = {},
                           std::vector<uint64_t>* out_unit_hashes = nullptr);

namespace internal {
// TEST ONLY, for the calling thread: Decode and DecodeInPlace take their portable loops even where
// a faster path exists (codec_test checks both give the same bytes and the same errors).
void SetPortableDecodeForTest(bool portable);
bool PortableDecodeForTest();
}  // namespace internal

}  // namespace wb::delta
