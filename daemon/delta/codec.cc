#include "daemon/delta/codec.h"

#include <xxhash.h>
#if defined(__x86_64__)
// XXH3 on the widest vector unit of this CPU (as transport/host_shm/host_shm.cc): same hashes, faster.
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/stream_copy.h"
#include "daemon/delta/codec_parts.h"
#include "daemon/delta/decode_parts.h"
#include "daemon/delta/encode_parts.h"
#include "daemon/delta/scan.h"
#include "daemon/digest/digest.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the delta format is little-endian; so is this code");

namespace wb::delta {
namespace {

constexpr uint32_t kMagic = 0x31444257;  // "WBD1"
// 2: digests are issue 17.4's chunked XXH3-64 (StreamDigest); 1 had XXH3-128 over the stream.
constexpr uint16_t kFormat = 2;
constexpr uint32_t kMaxChunkElems = 1u << 24;
using internal::GetVarint;

using internal::ChunkPrefetch;
using internal::DigestElemSize;
using internal::StreamDigest;

template <typename V>
void Put(uint8_t*& p, V v) {
  std::memcpy(p, &v, sizeof v);
  p += sizeof v;
}

template <typename V>
V Get(const uint8_t* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

using internal::Load;

std::string Label(std::string_view what) {
  return what.empty() ? std::string("delta stream") : "delta stream for " + std::string(what);
}

using internal::UnZigZag;
using internal::ZigZag;

uint64_t ChunkElems(uint64_t total_elems, uint32_t chunk_elems, uint64_t c) {
  const uint64_t begin = c * chunk_elems;
  return std::min<uint64_t>(chunk_elems, total_elems - begin);
}

// ---------------------------------------------------------------------------------------------
// Encoder

using internal::BestWidth;
using internal::ChunkScan;
using internal::EncodeScratch;
using internal::PutExceptions;
using internal::PutGapsAndValues;
using internal::PutValues;
using internal::ScanChunk;

template <typename T>
void EncodeChunk(const uint8_t* base, const uint8_t* target, uint64_t n, EncodeScratch* scratch, uint8_t*& p,
                 EncodeStats* stats, bool portable, ChunkPrefetch* pf) {
  constexpr int kEs = sizeof(T);
  uint8_t* head = p;
  uint8_t* payload = p + kChunkHeaderBytes;
  auto finish = [&](ChunkKind kind, int width, uint64_t changed, uint64_t excs, uint8_t* end) {
    uint8_t* h = head;
    Put<uint8_t>(h, static_cast<uint8_t>(kind));
    Put<uint8_t>(h, static_cast<uint8_t>(width));
    Put<uint16_t>(h, 0);
    Put<uint32_t>(h, static_cast<uint32_t>(changed));
    Put<uint32_t>(h, static_cast<uint32_t>(excs));
    Put<uint32_t>(h, static_cast<uint32_t>(end - payload));
    p = end;
    stats->chunks[static_cast<int>(kind)]++;
    stats->exceptions += excs;
  };
  if (std::memcmp(base, target, n * kEs) == 0) {
    finish(ChunkKind::kSame, 0, 0, 0, payload);
    return;
  }
  const uint8_t* a = base;
  const uint8_t* b = target;
  ChunkScan<T> scan;
  if (scratch->vals.size() < n * kEs + 64) scratch->vals.resize(n * kEs + 64);
  // 2-byte elements on AVX-512: one fused pass gives the scan, the index gaps (written in place,
  // within the chunk's raw bytes the output reserves: n >= 64) and the 1-byte values, which is
  // the width nearly every bf16 chunk takes; a chunk that wants 2-byte values walks again below.
  bool walked = false;
  uint64_t gap_bytes = 0;
  if constexpr (kEs == 2) {
    internal::Walk16 walk;
    scratch->excs.clear();
    if (!portable && n >= 64 &&
        internal::ScanAndWalk16(a, b, n, scratch->masks.data(), payload, scratch->vals.data(), &scratch->excs, &walk, pf)) {
      walked = true;
      scan.changed = walk.changed;
      scan.over[1] = walk.over1;
      gap_bytes = walk.gap_bytes;
    }
  }
  if (!walked) ScanChunk(a, b, n, scratch->masks.data(), &scan, portable);
  stats->changed_elements += scan.changed;

  const uint64_t raw = n * kEs;
  const auto [sparse_w, sparse_vals] = BestWidth(scan, scan.changed);
  const auto [dense_w, dense_vals] = BestWidth(scan, n);
  const uint64_t bitmap = (n + 7) / 8 + sparse_vals;
  // The index gaps take >= 1 byte each: only worth counting when they could beat the bitmap. Then
  // one walk over the changed elements writes the gaps in place and the values (shared by bitmap
  // and index) to scratch: the per-changed-element loops are most of the encoder's time at a few
  // percent of elements changed.
  const bool try_index = scan.changed < (n + 7) / 8;
  const uint64_t* masks = scratch->masks.data();
  if (walked && sparse_w != 1) walked = false;  // the fused pass wrote 1-byte values
  if (try_index && !walked) {
    gap_bytes = PutGapsAndValues<T>(a, b, n, masks, sparse_w, payload, scratch->vals.data(), scratch, pf);
  }
  const uint64_t index = try_index ? gap_bytes + sparse_vals : raw + 1;
  const uint64_t best = std::min({raw, bitmap, index, dense_vals});
  // The costs are upper bounds (exception gaps counted at 4 bytes), so a coded chunk never takes
  // more than the raw bytes the output buffer reserves for it.
  if (best == raw) {
    std::memcpy(payload, target, raw);
    finish(ChunkKind::kRaw, 0, 0, 0, payload + raw);
    return;
  }
  uint8_t* q = payload;
  if (best == dense_vals) {
    PutValues<T>(a, b, n, nullptr, /*dense=*/true, dense_w, q, scratch, pf);
    PutExceptions<T>(dense_w, *scratch, q);
    finish(ChunkKind::kDenseDiff, dense_w, n, scratch->excs.size(), q);
    return;
  }
  ChunkKind kind;
  if (best == bitmap) {
    kind = ChunkKind::kBitmap;
    std::memcpy(q, masks, (n + 7) / 8);  // little-endian words: bit j of byte k = element 8k + j
    q += (n + 7) / 8;
  } else {
    kind = ChunkKind::kIndex;
    q += gap_bytes;  // written above
  }
  if (try_index || walked) {
    const size_t value_bytes = scan.changed * sparse_w;
    std::memcpy(q, scratch->vals.data(), value_bytes);
    q += value_bytes;
  } else {
    PutValues<T>(a, b, n, masks, /*dense=*/false, sparse_w, q, scratch, pf);
  }
  PutExceptions<T>(sparse_w, *scratch, q);
  finish(kind, sparse_w, scan.changed, scratch->excs.size(), q);
}

absl::Status CheckElemSize(int elem_size, std::string_view what) {
  if (elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(Label(what), ": element size ", elem_size, " bytes (supported: 1, 2, 4, 8)"));
}

absl::Status CheckChunkElems(uint32_t chunk_elems, std::string_view what) {
  if (chunk_elems >= 64 && chunk_elems <= kMaxChunkElems && chunk_elems % 64 == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(Label(what), ": chunk_elems ", chunk_elems,
                                                 " (need a multiple of 64 in [64, ", kMaxChunkElems, "])"));
}

void PutHeader(uint8_t* out, const StreamHeader& h) {
  uint8_t* p = out;
  Put<uint32_t>(p, kMagic);
  Put<uint16_t>(p, kFormat);
  Put<uint8_t>(p, static_cast<uint8_t>(h.elem_size));
  Put<uint8_t>(p, 0);
  Put<uint32_t>(p, h.chunk_elems);
  Put<uint32_t>(p, 0);
  Put<uint64_t>(p, h.total_bytes);
  Put<uint64_t>(p, h.base_version);
  Put<uint64_t>(p, h.target_version);
  Put<uint64_t>(p, h.base_digest.lo);
  Put<uint64_t>(p, h.base_digest.hi);
  Put<uint64_t>(p, h.target_digest.lo);
  Put<uint64_t>(p, h.target_digest.hi);
  Put<uint64_t>(p, h.num_chunks);
  Put<uint64_t>(p, XXH3_64bits(out, kHeaderBytes - 8));
}

}  // namespace

namespace internal {
namespace {
thread_local bool portable_decode_for_test = false;
}  // namespace
void SetPortableDecodeForTest(bool portable) { portable_decode_for_test = portable; }
bool PortableDecodeForTest() { return portable_decode_for_test; }
}  // namespace internal

std::string Digest::ToString() const { return absl::StrFormat("%016x%016x", hi, lo); }

Digest DigestOf(absl::Span<const uint8_t> bytes, int elem_size) {
  StreamDigest d(DigestElemSize(elem_size, bytes.size()));
  d.Update(bytes.data(), bytes.size());
  return d.Finish();
}

const char* ChunkKindName(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kSame: return "same";
    case ChunkKind::kRaw: return "raw";
    case ChunkKind::kBitmap: return "bitmap";
    case ChunkKind::kIndex: return "index";
    case ChunkKind::kDenseDiff: return "dense_diff";
  }
  return "?";
}

void EncodeStats::Add(const EncodeStats& o) {
  for (int k = 0; k < 5; ++k) chunks[k] += o.chunks[k];
  changed_elements += o.changed_elements;
  exceptions += o.exceptions;
  encoded_bytes += o.encoded_bytes;
}

size_t MaxEncodedBytes(size_t total_bytes, int elem_size, uint32_t chunk_elems) {
  if (elem_size <= 0 || chunk_elems == 0) return 0;
  const uint64_t elems = total_bytes / static_cast<size_t>(elem_size);
  const uint64_t chunks = (elems + chunk_elems - 1) / chunk_elems;
  return kHeaderBytes + chunks * kChunkHeaderBytes + total_bytes + 8;
}

namespace {

// EncodeInto and EncodeFilling: `target` is read as is, or (with `fill`) produced chunk by chunk
// into `target_out` first. The target is hashed per chunk while in cache; the base only when
// options carry no recorded digest of it.
absl::StatusOr<size_t> EncodeImpl(const VersionBytes& base, uint64_t target_version, const uint8_t* target,
                                  const FillFn* fill, uint8_t* target_out, size_t total, const EncodeOptions& options,
                                  absl::Span<uint8_t> out, Digest* target_digest, EncodeStats* stats,
                                  uint8_t* copy_out = nullptr) {
  const int es = options.elem_size;
  if (absl::Status s = CheckElemSize(es, options.what); !s.ok()) return s;
  if (absl::Status s = CheckChunkElems(options.chunk_elems, options.what); !s.ok()) return s;
  if (base.bytes.size() != total) {
    return absl::InvalidArgumentError(absl::StrCat(Label(options.what), ": base (version ", base.version, ") has ",
                                                   base.bytes.size(), " bytes, target (version ", target_version,
                                                   ") ", total));
  }
  if (total % es != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Label(options.what), ": ", total, " bytes is not a whole number of ", es, "-byte elements"));
  }
  const size_t need = MaxEncodedBytes(total, es, options.chunk_elems);
  if (out.size() < need) {
    return absl::InvalidArgumentError(absl::StrCat(Label(options.what), ": output buffer of ", out.size(),
                                                   " bytes, need MaxEncodedBytes = ", need));
  }
  EncodeStats local;
  // One scratch per thread, kept: a fresh one per call (per op) made the allocator hand back and
  // fault in its pages again for every box, about a third of the sender's encode time in bench:e2e.
  thread_local EncodeScratch scratch;
  scratch.masks.resize(options.chunk_elems / 64);
  const bool hash_base = !options.base_digest.has_value();
  std::optional<StreamDigest> hb;
  if (hash_base) hb.emplace(es);
  StreamDigest ht(es);
  StreamHeader h;
  h.elem_size = es;
  h.chunk_elems = options.chunk_elems;
  h.total_bytes = total;
  h.base_version = base.version;
  h.target_version = target_version;
  const uint64_t elems = total / es;
  h.num_chunks = (elems + options.chunk_elems - 1) / options.chunk_elems;
  uint8_t* p = out.data() + kHeaderBytes;
  for (uint64_t c = 0; c < h.num_chunks; ++c) {
    const uint64_t n = ChunkElems(elems, options.chunk_elems, c);
    const size_t off = c * options.chunk_elems * es;
    const uint8_t* a = base.bytes.data() + off;
    const uint8_t* b = target + off;
    if (fill != nullptr) {
      (*fill)(off, absl::MakeSpan(target_out + off, n * es));
      b = target_out + off;
    }
    ChunkPrefetch pf;
    if (c + 1 < h.num_chunks) {
      pf.a = a + n * es;
      pf.b = fill == nullptr ? b + n * es : nullptr;  // a filled target is written, not read
      pf.bytes = ChunkElems(elems, options.chunk_elems, c + 1) * es;
    }
    switch (es) {
      case 1: EncodeChunk<uint8_t>(a, b, n, &scratch, p, &local, options.portable_scan, &pf); break;
      case 2: EncodeChunk<uint16_t>(a, b, n, &scratch, p, &local, options.portable_scan, &pf); break;
      case 4: EncodeChunk<uint32_t>(a, b, n, &scratch, p, &local, options.portable_scan, &pf); break;
      default: EncodeChunk<uint64_t>(a, b, n, &scratch, p, &local, options.portable_scan, &pf); break;
    }
    // Hashed while the chunk is still in cache: one read of base and target in all.
    if (hash_base) hb->Update(a, n * es);
    ht.Update(b, n * es);
    if (options.on_target) options.on_target(absl::MakeConstSpan(b, n * es));
    if (copy_out != nullptr) wb::StreamCopy(copy_out + off, b, n * es);
  }
  if (copy_out != nullptr) wb::StreamFence();
  h.base_digest = hash_base ? hb->Finish() : *options.base_digest;
  h.target_digest = ht.Finish(options.target_unit_hashes);
  PutHeader(out.data(), h);
  if (target_digest != nullptr) *target_digest = h.target_digest;
  const size_t used = static_cast<size_t>(p - out.data());
  local.encoded_bytes = used;
  if (stats != nullptr) stats->Add(local);
  return used;
}

}  // namespace

absl::StatusOr<size_t> EncodeInto(const VersionBytes& base, const VersionBytes& target, const EncodeOptions& options,
                                  absl::Span<uint8_t> out, EncodeStats* stats, Digest* target_digest) {
  return EncodeImpl(base, target.version, target.bytes.data(), nullptr, nullptr, target.bytes.size(), options, out,
                    target_digest, stats);
}

absl::StatusOr<size_t> EncodeFilling(const VersionBytes& base, uint64_t target_version, const FillFn& fill,
                                     absl::Span<uint8_t> target_out, const EncodeOptions& options,
                                     absl::Span<uint8_t> out, Digest* target_digest, EncodeStats* stats) {
  return EncodeImpl(base, target_version, nullptr, &fill, target_out.data(), target_out.size(), options, out,
                    target_digest, stats);
}

absl::StatusOr<size_t> EncodeCopying(const VersionBytes& base, const VersionBytes& target, absl::Span<uint8_t> target_copy,
                                     const EncodeOptions& options, absl::Span<uint8_t> out, Digest* target_digest,
                                     EncodeStats* stats) {
  if (target_copy.size() != target.bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(Label(options.what), ": copy of ", target_copy.size(),
                                                   " bytes for a target of ", target.bytes.size()));
  }
  return EncodeImpl(base, target.version, target.bytes.data(), nullptr, nullptr, target.bytes.size(), options, out,
                    target_digest, stats, target_copy.data());
}

Digest CopyAndDigest(absl::Span<const uint8_t> src, absl::Span<uint8_t> target_out, int elem_size, size_t chunk_bytes,
                     const ChunkObserver& on_chunk, std::vector<uint64_t>* unit_hashes) {
  const size_t n = std::min(src.size(), target_out.size());
  StreamDigest ht(DigestElemSize(elem_size, n));
  chunk_bytes = std::max<size_t>(chunk_bytes, 1);
  for (size_t off = 0; off < n; off += chunk_bytes) {
    const size_t len = std::min(chunk_bytes, n - off);
    ht.Update(src.data() + off, len);
    if (on_chunk) on_chunk(src.subspan(off, len));
    wb::StreamCopy(target_out.data() + off, src.data() + off, len);
  }
  wb::StreamFence();
  return ht.Finish(unit_hashes);
}

Digest FillAndDigest(const FillFn& fill, absl::Span<uint8_t> target_out, int elem_size, size_t chunk_bytes,
                     const ChunkObserver& on_chunk, std::vector<uint64_t>* unit_hashes) {
  StreamDigest ht(DigestElemSize(elem_size, target_out.size()));
  chunk_bytes = std::max<size_t>(chunk_bytes, 1);
  for (size_t off = 0; off < target_out.size(); off += chunk_bytes) {
    const size_t len = std::min(chunk_bytes, target_out.size() - off);
    fill(off, target_out.subspan(off, len));
    ht.Update(target_out.data() + off, len);
    if (on_chunk) on_chunk(absl::MakeConstSpan(target_out.data() + off, len));
  }
  return ht.Finish(unit_hashes);
}

absl::StatusOr<std::vector<uint8_t>> Encode(const VersionBytes& base, const VersionBytes& target,
                                            const EncodeOptions& options, EncodeStats* stats) {
  if (absl::Status s = CheckElemSize(options.elem_size, options.what); !s.ok()) return s;
  std::vector<uint8_t> out(MaxEncodedBytes(target.bytes.size(), options.elem_size, options.chunk_elems));
  absl::StatusOr<size_t> used = EncodeInto(base, target, options, absl::MakeSpan(out), stats);
  if (!used.ok()) return used.status();
  out.resize(*used);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decoder

namespace {

struct ChunkHead {
  uint8_t kind = 0;
  int width = 0;
  uint16_t reserved = 0;
  uint64_t changed = 0;
  uint64_t excs = 0;
  uint64_t payload = 0;
};

ChunkHead ReadChunkHead(const uint8_t* p) {
  ChunkHead h;
  h.kind = p[0];
  h.width = p[1];
  h.reserved = Get<uint16_t>(p + 2);
  h.changed = Get<uint32_t>(p + 4);
  h.excs = Get<uint32_t>(p + 8);
  h.payload = Get<uint32_t>(p + 12);
  return h;
}

// "delta stream for W: chunk c (elements [a, b))"
std::string ChunkWhere(std::string_view what, uint64_t c, uint64_t chunk_elems, uint64_t n) {
  return absl::StrCat(Label(what), ": chunk ", c, " (elements [", c * chunk_elems, ", ", c * chunk_elems + n, "))");
}

// The chunk header's fields against each other, the chunk's n elements and the element size
// (payload contents are checked while decoding). Returns "" or what is wrong.
std::string ChunkHeadProblem(const ChunkHead& h, uint64_t n, int es) {
  if (h.kind > static_cast<uint8_t>(ChunkKind::kDenseDiff)) return absl::StrCat("unknown chunk kind ", int{h.kind});
  const ChunkKind kind = static_cast<ChunkKind>(h.kind);
  const std::string name = ChunkKindName(kind);
  if (h.reserved != 0) return absl::StrCat("reserved field ", h.reserved, " (must be 0)");
  if (kind == ChunkKind::kSame || kind == ChunkKind::kRaw) {
    const uint64_t want = kind == ChunkKind::kSame ? 0 : n * es;
    if (h.width != 0 || h.changed != 0 || h.excs != 0 || h.payload != want) {
      return absl::StrCat(name, " chunk with width ", h.width, ", changed ", h.changed, ", exceptions ", h.excs,
                          ", payload ", h.payload, " bytes (want 0, 0, 0, ", want, ")");
    }
    return "";
  }
  if (h.width < 1 || h.width > es) return absl::StrCat(name, " chunk with value width ", h.width, " (1..", es, ")");
  if (h.width == es && h.excs != 0) return absl::StrCat(name, " chunk with full-width values and ", h.excs, " exceptions");
  if (kind == ChunkKind::kDenseDiff && h.changed != n) {
    return absl::StrCat("dense_diff chunk with ", h.changed, " values for ", n, " elements");
  }
  if (kind != ChunkKind::kDenseDiff && (h.changed == 0 || h.changed > n)) {
    return absl::StrCat(name, " chunk with ", h.changed, " changed elements (1..", n, ")");
  }
  if (h.excs > h.changed) return absl::StrCat(h.excs, " exceptions for ", h.changed, " values");
  const uint64_t positions = kind == ChunkKind::kBitmap ? (n + 7) / 8 : kind == ChunkKind::kIndex ? h.changed : 0;
  const uint64_t least = positions + h.changed * h.width + h.excs * (1 + es - h.width);
  if (h.payload < least) {
    return absl::StrCat(name, " chunk of ", h.payload, " payload bytes, its counts need at least ", least);
  }
  return "";
}

// Walks the exceptions list of a chunk: the ordinal of the next value that has high bytes.
struct ExceptionCursor {
  const uint8_t* p;
  const uint8_t* end;
  uint64_t left;
  int high_bytes;
  uint64_t next = ~uint64_t{0};
  int64_t prev = -1;
  const uint8_t* high = nullptr;

  // Reads the next entry (or marks the end); false if the list is truncated or malformed.
  bool Advance() {
    if (left == 0) {
      next = ~uint64_t{0};
      return true;
    }
    uint64_t gap = 0;
    if (!GetVarint(p, end, &gap) || end - p < high_bytes) return false;
    next = static_cast<uint64_t>(prev + 1) + gap;
    prev = static_cast<int64_t>(next);
    high = p;
    p += high_bytes;
    --left;
    return true;
  }
};

template <typename T>
absl::Status DecodeChunk(const ChunkHead& h, const uint8_t* payload, const uint8_t* stream_end, const uint8_t* base,
                         uint8_t* out, uint64_t n, const std::function<std::string()>& where, ChunkPrefetch* pf) {
  constexpr int kEs = sizeof(T);
  const ChunkKind kind = static_cast<ChunkKind>(h.kind);
  const uint8_t* end = payload + h.payload;
  if (kind == ChunkKind::kSame) {
    if (out != base) std::memcpy(out, base, n * kEs);
    return absl::OkStatus();
  }
  if (kind == ChunkKind::kRaw) {
    std::memcpy(out, payload, n * kEs);
    return absl::OkStatus();
  }
  auto bad = [&](const std::string& why) { return absl::DataLossError(absl::StrCat(where(), ": ", why)); };
  const int width = h.width;
  const uint64_t values = h.changed;
  const bool portable = internal::PortableDecodeForTest();
  // Index chunks (few changes): checked first, then only the changed elements visited
  // (decode_parts.h); anything off leaves it to the loops below, which name it.
  if (kind == ChunkKind::kIndex && !portable &&
      internal::DecodeIndexChunk<T>(payload, end, stream_end, values, h.excs, width, base, out, n, pf)) {
    return absl::OkStatus();
  }
  // Bitmap chunks of 2-byte elements with 1-byte values (bf16 at lr 1e-5) on AVX-512: checked
  // first, then applied 32 elements per step; anything off leaves it to the loops below.
  if constexpr (kEs == 2) {
    if (width == 1 && kind == ChunkKind::kBitmap && !portable &&
        internal::DecodeSparse16(payload, end, values, h.excs, base, out, n)) {
      return absl::OkStatus();
    }
  }
  const uint8_t* positions = payload;
  const uint8_t* vals = payload;
  if (kind == ChunkKind::kBitmap) vals = payload + (n + 7) / 8;
  if (kind == ChunkKind::kIndex) {
    const uint8_t* q = payload;
    uint64_t gap;
    for (uint64_t k = 0; k < values; ++k) {
      if (!GetVarint(q, end, &gap)) return bad(absl::StrCat("index gap ", k, " truncated or longer than 4 bytes"));
    }
    vals = q;
  }
  if (static_cast<uint64_t>(end - vals) < values * width) {
    return bad(absl::StrCat(values, " values of ", width, " bytes overrun the ", h.payload, "-byte payload"));
  }
  ExceptionCursor exc{vals + values * width, end, h.excs, kEs - width};
  if (!exc.Advance()) return bad("exception list truncated");
  const T low_mask = width >= kEs ? static_cast<T>(~T{0}) : static_cast<T>((uint64_t{1} << (8 * width)) - 1);
  bool zero_value = false;
  auto apply = [&](uint64_t ordinal, uint64_t idx) {
    const uint8_t* v = vals + ordinal * width;
    T z = 0;
    if (stream_end - v >= kEs) {
      z = static_cast<T>(Get<T>(v) & low_mask);
    } else {
      std::memcpy(&z, v, width);
    }
    if (ordinal == exc.next) {
      T hi = 0;
      std::memcpy(reinterpret_cast<uint8_t*>(&hi) + width, exc.high, kEs - width);
      z = static_cast<T>(z | hi);
      if (!exc.Advance()) return false;
    }
    zero_value |= z == 0;
    const T value = static_cast<T>(Load<T>(base, idx) + UnZigZag(z));
    std::memcpy(out + idx * kEs, &value, kEs);
    return true;
  };
  if (kind == ChunkKind::kDenseDiff) {
    for (uint64_t i = 0; i < n; ++i) {
      if (!apply(i, i)) return bad("exception list truncated");
    }
    zero_value = false;  // unchanged elements are 0 here
  } else {
    if (out != base) std::memcpy(out, base, n * kEs);  // in place (DecodeInPlace): the base is there
    uint64_t ordinal = 0;
    if (kind == ChunkKind::kBitmap) {
      const uint64_t bitmap_bytes = (n + 7) / 8;
      for (uint64_t w = 0; w * 64 < n; ++w) {
        uint64_t m = 0;
        std::memcpy(&m, positions + 8 * w, std::min<uint64_t>(8, bitmap_bytes - 8 * w));
        if (n - w * 64 < 64 && (m >> (n - w * 64)) != 0) return bad("bitmap bits set past the chunk's elements");
        for (; m != 0; m &= m - 1) {
          if (ordinal >= values) return bad(absl::StrCat("bitmap has more set bits than the ", values, " changed elements"));
          if (!apply(ordinal++, w * 64 + std::countr_zero(m))) return bad("exception list truncated");
        }
      }
      if (ordinal != values) return bad(absl::StrCat("bitmap has ", ordinal, " set bits, header says ", values));
    } else {
      const uint8_t* g = positions;
      int64_t prev = -1;
      for (; ordinal < values; ++ordinal) {
        uint64_t gap = 0;
        GetVarint(g, vals, &gap);  // checked above
        const uint64_t idx = static_cast<uint64_t>(prev + 1) + gap;
        if (idx >= n) return bad(absl::StrCat("index ", idx, " past the chunk's ", n, " elements"));
        if (!apply(ordinal, idx)) return bad("exception list truncated");
        prev = static_cast<int64_t>(idx);
      }
    }
  }
  if (zero_value) return bad("a changed element with a zero difference");
  if (exc.next != ~uint64_t{0}) return bad(absl::StrCat("exception for value ", exc.next, " of ", values));
  if (exc.p != end) return bad(absl::StrCat(end - exc.p, " unread bytes after the exceptions"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StreamHeader> ReadHeader(absl::Span<const uint8_t> stream, std::string_view what) {
  auto bad = [&](const std::string& why) { return absl::DataLossError(absl::StrCat(Label(what), ": ", why)); };
  if (stream.size() < kHeaderBytes) {
    return bad(absl::StrCat(stream.size(), " bytes, shorter than the ", kHeaderBytes, "-byte header"));
  }
  const uint8_t* p = stream.data();
  if (Get<uint32_t>(p) != kMagic) return bad(absl::StrFormat("magic 0x%08x (want 0x%08x, \"WBD1\")", Get<uint32_t>(p), kMagic));
  if (Get<uint16_t>(p + 4) != kFormat) return bad(absl::StrCat("format ", Get<uint16_t>(p + 4), " (this build reads ", kFormat, ")"));
  if (Get<uint64_t>(p + kHeaderBytes - 8) != XXH3_64bits(p, kHeaderBytes - 8)) return bad("header hash mismatch (corrupted header)");
  StreamHeader h;
  h.elem_size = p[6];
  h.chunk_elems = Get<uint32_t>(p + 8);
  h.total_bytes = Get<uint64_t>(p + 16);
  h.base_version = Get<uint64_t>(p + 24);
  h.target_version = Get<uint64_t>(p + 32);
  h.base_digest = {Get<uint64_t>(p + 40), Get<uint64_t>(p + 48)};
  h.target_digest = {Get<uint64_t>(p + 56), Get<uint64_t>(p + 64)};
  h.num_chunks = Get<uint64_t>(p + 72);
  if (p[7] != 0 || Get<uint32_t>(p + 12) != 0) return bad("nonzero flags or reserved header field");
  if (!CheckElemSize(h.elem_size, what).ok()) return bad(absl::StrCat("element size ", h.elem_size, " (1, 2, 4 or 8)"));
  if (!CheckChunkElems(h.chunk_elems, what).ok()) return bad(absl::StrCat("chunk_elems ", h.chunk_elems));
  if (h.total_bytes % h.elem_size != 0) {
    return bad(absl::StrCat("total ", h.total_bytes, " bytes is not a whole number of ", h.elem_size, "-byte elements"));
  }
  const uint64_t elems = h.total_bytes / h.elem_size;
  const uint64_t chunks = elems / h.chunk_elems + (elems % h.chunk_elems != 0);
  if (h.num_chunks != chunks) return bad(absl::StrCat(h.num_chunks, " chunks for ", elems, " elements (want ", chunks, ")"));
  return h;
}

absl::Status CheckBase(const StreamHeader& header, uint64_t version, const Digest& digest, std::string_view what) {
  if (header.base_version == version && header.base_digest == digest) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      Label(what), " (version ", header.target_version, ") was made against version ", header.base_version,
      " digest ", header.base_digest.ToString(), ", but the destination holds version ", version, " digest ",
      digest.ToString(), ": nothing applied (send the full version)"));
}

namespace {

// Decode and DecodeInPlace (`out` is the base when in_place).
absl::Status DecodeImpl(absl::Span<const uint8_t> stream, const DecodeBase& base, absl::Span<uint8_t> out, bool in_place,
                        std::string_view what, const ChunkObserver& on_out, std::vector<uint64_t>* out_unit_hashes) {
  absl::StatusOr<StreamHeader> header = ReadHeader(stream, what);
  if (!header.ok()) return header.status();
  const StreamHeader& h = *header;
  if (base.bytes.size() != h.total_bytes || out.size() != h.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(Label(what), ": the delta is for ", h.total_bytes, " bytes; base has ",
                                                   base.bytes.size(), ", destination ", out.size()));
  }
  const uintptr_t b0 = reinterpret_cast<uintptr_t>(base.bytes.data()), o0 = reinterpret_cast<uintptr_t>(out.data());
  if (!in_place && h.total_bytes > 0 && b0 < o0 + h.total_bytes && o0 < b0 + h.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(Label(what), ": destination overlaps the base (decode out of place)"));
  }
  const int es = h.elem_size;
  const uint64_t elems = h.total_bytes / es;
  // 1. Every chunk header against the stream's size, before anything is written.
  const uint8_t* const stream_end = stream.data() + stream.size();
  const uint8_t* p = stream.data() + kHeaderBytes;
  for (uint64_t c = 0; c < h.num_chunks; ++c) {
    const uint64_t n = ChunkElems(elems, h.chunk_elems, c);
    if (static_cast<size_t>(stream_end - p) < kChunkHeaderBytes) {
      return absl::DataLossError(absl::StrCat(ChunkWhere(what, c, h.chunk_elems, n), ": stream truncated at byte ",
                                              p - stream.data(), " of ", stream.size(), " (chunk header missing)"));
    }
    const ChunkHead head = ReadChunkHead(p);
    if (std::string why = ChunkHeadProblem(head, n, es); !why.empty()) {
      return absl::DataLossError(absl::StrCat(ChunkWhere(what, c, h.chunk_elems, n), ": ", why));
    }
    p += kChunkHeaderBytes;
    if (static_cast<uint64_t>(stream_end - p) < head.payload) {
      return absl::DataLossError(absl::StrCat(ChunkWhere(what, c, h.chunk_elems, n), ": payload of ", head.payload,
                                              " bytes but the stream ends ", stream_end - p, " bytes later"));
    }
    p += head.payload;
  }
  if (p != stream_end) {
    return absl::DataLossError(absl::StrCat(Label(what), ": ", stream_end - p, " bytes after the last chunk"));
  }
  // 2. The base: version and digest, still before anything is written.
  const Digest base_digest = base.digest.has_value() ? *base.digest : DigestOf(base.bytes, es);
  if (absl::Status s = CheckBase(h, base.version, base_digest, what); !s.ok()) return s;
  // 3. Decode, hashing each chunk of the output while it is in cache.
  StreamDigest ht(es);
  p = stream.data() + kHeaderBytes;
  for (uint64_t c = 0; c < h.num_chunks; ++c) {
    const uint64_t n = ChunkElems(elems, h.chunk_elems, c);
    const ChunkHead head = ReadChunkHead(p);
    const uint8_t* payload = p + kChunkHeaderBytes;
    const size_t off = c * h.chunk_elems * es;
    const std::function<std::string()> where = [&] { return ChunkWhere(what, c, h.chunk_elems, n); };
    // The next chunk's base is pulled into cache while this one is decoded and hashed: the
    // decoder's first touch of the base is a wait on memory otherwise (as the encoder's scan,
    // ChunkPrefetch).
    ChunkPrefetch pf;
    if (c + 1 < h.num_chunks) {
      pf.a = base.bytes.data() + off + n * es;
      pf.bytes = ChunkElems(elems, h.chunk_elems, c + 1) * es;
    }
    absl::Status s;
    switch (es) {
      case 1: s = DecodeChunk<uint8_t>(head, payload, stream_end, base.bytes.data() + off, out.data() + off, n, where, &pf); break;
      case 2: s = DecodeChunk<uint16_t>(head, payload, stream_end, base.bytes.data() + off, out.data() + off, n, where, &pf); break;
      case 4: s = DecodeChunk<uint32_t>(head, payload, stream_end, base.bytes.data() + off, out.data() + off, n, where, &pf); break;
      default: s = DecodeChunk<uint64_t>(head, payload, stream_end, base.bytes.data() + off, out.data() + off, n, where, &pf); break;
    }
    if (!s.ok()) return s;
    pf.To(pf.bytes);  // chunks decoded without it (same, raw, bitmap, dense_diff)
    ht.Update(out.data() + off, n * es);
    if (on_out) on_out(absl::MakeConstSpan(out.data() + off, n * es));
    p = payload + head.payload;
  }
  std::vector<uint64_t> units;
  const Digest got = ht.Finish(&units);
  if (got != h.target_digest) {
    return absl::DataLossError(absl::StrCat(Label(what), ": decoded version ", h.target_version, " has digest ",
                                            got.ToString(), ", the sender's has ", h.target_digest.ToString(),
                                            " (corrupted stream or base)"));
  }
  if (out_unit_hashes != nullptr) *out_unit_hashes = std::move(units);
  return absl::OkStatus();
}

}  // namespace

absl::Status Decode(absl::Span<const uint8_t> stream, const DecodeBase& base, absl::Span<uint8_t> out,
                    std::string_view what, const ChunkObserver& on_out, std::vector<uint64_t>* out_unit_hashes) {
  return DecodeImpl(stream, base, out, /*in_place=*/false, what, on_out, out_unit_hashes);
}

absl::Status DecodeInPlace(absl::Span<const uint8_t> stream, uint64_t base_version, std::optional<Digest> base_digest,
                           absl::Span<uint8_t> data, std::string_view what, const ChunkObserver& on_out,
                           std::vector<uint64_t>* out_unit_hashes) {
  return DecodeImpl(stream, DecodeBase{base_version, data, base_digest}, data, /*in_place=*/true, what, on_out,
                    out_unit_hashes);
}

}  // namespace wb::delta
