// libFuzzer target: delta::Decode (daemon/delta/codec.h) on hostile streams. A delta stream crosses
// the network from a peer node, so every header field, chunk header, LEB128 gap, bitmap, width and
// exception list may be hostile or truncated. Contract under test: an absl::Status comes back (no
// crash, no UB, no read or write outside `stream`, `base` or `out`, no allocation sized by the
// stream), and an OK status means `out` has the target digest the stream named.
//
// Most inputs would stop at the header hash or the base check, so the harness repairs those on a
// copy (the fuzzer then mutates the chunks, where the parsing is): total_bytes is capped at 64 KiB,
// the base is a fixed pattern of that size, base version and digest are set to the base's and the
// header hash recomputed. Inputs whose size is a multiple of 7 go in unrepaired (the header checks).
// Seeds (corpus/fuzz_delta_decode) are real Encode outputs against that same base pattern.
#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "daemon/delta/codec.h"
#include "tests/fuzz/delta_base_pattern.h"

namespace {

constexpr uint64_t kMaxTotal = uint64_t{1} << 16;


uint64_t GetU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

void PutU64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using wb::delta::kHeaderBytes;
  std::vector<uint8_t> stream(data, data + size);
  uint64_t total = 0;
  if (size >= kHeaderBytes && size % 7 != 0) {
    uint8_t* h = stream.data();
    total = GetU64(h + 16) % (kMaxTotal + 1);
    PutU64(h + 16, total);
    PutU64(h + 24, 1);  // base_version
    const std::vector<uint8_t> base = wb::fuzz::DeltaBasePattern(total);
    const wb::delta::Digest d = wb::delta::DigestOf(base, h[6]);
    PutU64(h + 40, d.lo);
    PutU64(h + 48, d.hi);
    PutU64(h + kHeaderBytes - 8, XXH3_64bits(h, kHeaderBytes - 8));
  } else if (size >= kHeaderBytes) {
    total = GetU64(stream.data() + 16);
    if (total > kMaxTotal) total = 0;  // Decode must refuse the short `out` below, not write past it
  }
  const std::vector<uint8_t> base = wb::fuzz::DeltaBasePattern(total);
  std::vector<uint8_t> out(total);
  wb::delta::DecodeBase b;
  b.version = 1;
  b.bytes = base;
  const int es = size > 6 ? stream[6] : 1;  // the header's element size (DigestOf hashes others as bytes)
  if (size % 2 == 0) b.digest = wb::delta::DigestOf(base, es);  // both ways: recorded digest, or hashed by Decode
  absl::Status s = wb::delta::Decode(stream, b, absl::MakeSpan(out), "fuzz");
  if (s.ok()) {
    // OK promises the target digest the stream named.
    const wb::delta::Digest got = wb::delta::DigestOf(out, es);
    if (got.lo != GetU64(stream.data() + 56) || got.hi != GetU64(stream.data() + 64)) __builtin_trap();
  }
  // In place (the receiver's sync path): the same verdict, and when OK the same bytes; a refusal
  // before the first write leaves the base as it was.
  std::vector<uint8_t> in_place = base;
  absl::Status si = wb::delta::DecodeInPlace(stream, 1, b.digest, absl::MakeSpan(in_place), "fuzz");
  if (si.ok() != s.ok()) __builtin_trap();
  if (si.ok() && in_place != out) __builtin_trap();
  if (absl::IsFailedPrecondition(si) || absl::IsInvalidArgument(si)) {
    if (in_place != base) __builtin_trap();
  }
  return 0;
}
