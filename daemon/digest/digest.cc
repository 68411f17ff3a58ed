#include "daemon/digest/digest.h"

#include <xxhash.h>
#if defined(__x86_64__)
// XXH3 on the widest vector unit of this CPU (as transport/host_shm/host_shm.cc): same hashes, faster.
#include <xxh_x86dispatch.h>
#endif

#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "digests hash u64 values as little-endian bytes; so does this code");

namespace wb::digest {
namespace {

struct StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using HashState = std::unique_ptr<XXH3_state_t, StateDeleter>;

// A box reduced for iteration: dims of size 1 dropped and adjacent dims merged where the outer
// one steps exactly over the inner one (row-major contiguous), so a contiguous box is one row.
// The canonical (row-major) element order is unchanged by both.
struct Walk {
  const uint8_t* base = nullptr;
  std::vector<int64_t> shape, strides;  // at least one dim
  int64_t es = 1;
  int64_t elements = 0;
};

absl::StatusOr<Walk> Prepare(const StridedBox& box) {
  if (box.element_size <= 0) return absl::InvalidArgumentError(absl::StrCat("digest: element_size ", box.element_size, " must be > 0"));
  if (box.shape.size() != box.strides.size()) {
    return absl::InvalidArgumentError(absl::StrCat("digest: ", box.shape.size(), " dims but ", box.strides.size(), " strides"));
  }
  Walk w;
  w.base = box.base;
  w.es = box.element_size;
  w.elements = 1;
  for (size_t d = 0; d < box.shape.size(); ++d) {
    if (box.shape[d] < 0 || box.strides[d] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("digest: dim ", d, " has size ", box.shape[d], " and stride ", box.strides[d], " (both must be >= 0)"));
    }
    w.elements *= box.shape[d];
  }
  if (w.elements == 0) return w;
  if (box.base == nullptr) return absl::InvalidArgumentError("digest: null base of a non-empty box");
  for (size_t d = 0; d < box.shape.size(); ++d) {
    if (box.shape[d] == 1) continue;
    if (!w.shape.empty() && w.strides.back() == box.strides[d] * box.shape[d]) {
      w.shape.back() *= box.shape[d];
      w.strides.back() = box.strides[d];
      continue;
    }
    w.shape.push_back(box.shape[d]);
    w.strides.push_back(box.strides[d]);
  }
  if (w.shape.empty()) {  // a scalar, or every dim of size 1
    w.shape = {1};
    w.strides = {1};
  }
  return w;
}

// CPU time of the calling thread (a hashing thread preempted by the transports' threads is not
// charged for the wait).
int64_t ThreadCpuNanos() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

int64_t NumChunks(const Walk& w) { return (w.elements + kChunkElements - 1) / kChunkElements; }

// XXH3-64 (seed = chunk index) of elements [k * C, min((k + 1) * C, elements)) of the canonical
// stream. `state` and `gather` are the calling thread's scratch.
uint64_t HashChunk(const Walk& w, int64_t k, XXH3_state_t* state, std::vector<uint8_t>& gather) {
  const int64_t first = k * kChunkElements;
  const int64_t count = std::min(kChunkElements, w.elements - first);
  const size_t rank = w.shape.size();
  const int64_t inner = w.shape[rank - 1], inner_stride = w.strides[rank - 1];
  // Index vector of `first`, and the byte offset of the row it lies in.
  std::vector<int64_t> idx(rank, 0);
  int64_t rest = first;
  for (size_t d = rank; d > 0; --d) {
    idx[d - 1] = rest % w.shape[d - 1];
    rest /= w.shape[d - 1];
  }
  auto row_offset = [&] {
    int64_t off = 0;
    for (size_t d = 0; d + 1 < rank; ++d) off += idx[d] * w.strides[d];
    return off * w.es;
  };
  const uint64_t seed = static_cast<uint64_t>(k);
  if (idx[rank - 1] + count <= inner && (inner_stride == 1 || count == 1)) {
    // The whole chunk is one contiguous run (e.g. any chunk of a contiguous box).
    return XXH3_64bits_withSeed(w.base + row_offset() + idx[rank - 1] * w.es, static_cast<size_t>(count * w.es), seed);
  }
  XXH3_64bits_reset_withSeed(state, seed);
  int64_t left = count;
  while (left > 0) {
    const int64_t c0 = idx[rank - 1];
    const int64_t n = std::min(inner - c0, left);
    const uint8_t* row = w.base + row_offset();
    if (inner_stride == 1) {
      XXH3_64bits_update(state, row + c0 * w.es, static_cast<size_t>(n * w.es));
    } else {
      // A strided last dim (a transposed piece): gather elements in canonical order, in slices.
      const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(gather.size()) / w.es);
      for (int64_t done = 0; done < n;) {
        const int64_t m = std::min(per, n - done);
        uint8_t* out = gather.data();
        const uint8_t* in = row + (c0 + done) * inner_stride * w.es;
        for (int64_t e = 0; e < m; ++e, out += w.es, in += inner_stride * w.es) std::memcpy(out, in, static_cast<size_t>(w.es));
        XXH3_64bits_update(state, gather.data(), static_cast<size_t>(m * w.es));
        done += m;
      }
    }
    left -= n;
    // Next row: odometer over the outer dims.
    idx[rank - 1] = 0;
    for (size_t d = rank - 1; d > 0; --d) {
      if (++idx[d - 1] < w.shape[d - 1]) break;
      idx[d - 1] = 0;
    }
  }
  return XXH3_64bits_digest(state);
}

Digest Combine(const Walk& w, const std::vector<uint64_t>& chunks) {
  std::vector<uint64_t> words;
  words.reserve(chunks.size() + 1);
  words.push_back(static_cast<uint64_t>(w.elements * w.es));
  words.insert(words.end(), chunks.begin(), chunks.end());
  return XXH3_64bits_withSeed(words.data(), words.size() * sizeof(uint64_t), kDigestSeed);
}

}  // namespace

absl::StatusOr<Digest> BoxDigest(const StridedBox& box) {
  absl::StatusOr<std::vector<Digest>> d = DigestMany({box}, 1);
  if (!d.ok()) return d.status();
  return (*d)[0];
}

Digest QuantizedDigest(Digest elements, Digest scales) {
  const uint64_t pair[2] = {elements, scales};
  // A well-formed box of two elements: BoxDigest cannot fail on it.
  absl::StatusOr<Digest> d = BoxDigest({reinterpret_cast<const uint8_t*>(pair), {2}, {1}, 8});
  return d.ok() ? *d : 0;
}

absl::StatusOr<std::vector<Digest>> DigestMany(const std::vector<StridedBox>& boxes, int threads, absl::Time deadline) {
  DigestPool::Options o;
  o.threads = std::max(1, threads) - 1;  // the caller hashes too, in Finish
  o.deadline = deadline;
  DigestPool pool(o);
  for (size_t i = 0; i < boxes.size(); ++i) {
    absl::StatusOr<size_t> id = pool.Add(boxes[i]);
    if (!id.ok()) return absl::Status(id.status().code(), absl::StrCat("box ", i, ": ", id.status().message()));
  }
  return pool.Finish();
}

struct DigestPool::State {
  // One chunk to hash: pointers into the deques below (stable while elements are appended).
  struct Task {
    const Walk* walk = nullptr;
    int64_t k = 0;
    uint64_t* out = nullptr;
    int64_t* ns = nullptr;
  };
  Options o;
  absl::Mutex mu;
  std::deque<Walk> walks ABSL_GUARDED_BY(mu);                     // by id
  std::deque<std::vector<uint64_t>> chunk_hashes ABSL_GUARDED_BY(mu);  // by id; written by the task's thread
  std::deque<int64_t> hash_ns ABSL_GUARDED_BY(mu);                   // by id: thread-time spent hashing it
  std::deque<Task> queue ABSL_GUARDED_BY(mu);
  size_t pending ABSL_GUARDED_BY(mu) = 0;  // tasks queued or being hashed
  bool finishing ABSL_GUARDED_BY(mu) = false, finished ABSL_GUARDED_BY(mu) = false;
  bool stop ABSL_GUARDED_BY(mu) = false, late ABSL_GUARDED_BY(mu) = false;
  std::vector<std::thread> threads ABSL_GUARDED_BY(mu);

  // Hashes queued chunks until there are none (helper: until every chunk is done) or the pool
  // stops; background threads also wait for more work until Finish.
  void Work(bool helper) {
    if (!helper && o.nice > 0) {
#if defined(__linux__)
      // Linux nice is per thread: only this hashing thread yields to the transports' threads.
      (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), o.nice);
#endif
    }
    HashState state(XXH3_createState());
    std::vector<uint8_t> gather(64 << 10);
    absl::MutexLock l(&mu);
    while (true) {
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
        return stop || late || !queue.empty() || (helper ? pending == 0 : finishing);
      };
      if (!mu.AwaitWithDeadline(absl::Condition(&ready), o.deadline)) late = true;
      if (stop || late || queue.empty()) return;
      if (absl::Now() > o.deadline) {
        late = true;
        return;
      }
      const Task t = queue.front();
      queue.pop_front();
      mu.Unlock();
      const int64_t t0 = ThreadCpuNanos();
      const uint64_t h = HashChunk(*t.walk, t.k, state.get(), gather);
      const int64_t ns = ThreadCpuNanos() - t0;
      mu.Lock();
      *t.out = h;
      *t.ns += ns;
      --pending;
    }
  }
};

DigestPool::DigestPool(Options options) : s_(std::make_unique<State>()) { s_->o = options; }

DigestPool::~DigestPool() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock l(&s_->mu);
    s_->stop = true;
    threads = std::move(s_->threads);
  }
  for (std::thread& t : threads) t.join();
}

absl::StatusOr<size_t> DigestPool::Add(const StridedBox& box) {
  absl::StatusOr<Walk> w = Prepare(box);
  if (!w.ok()) return w.status();
  State& s = *s_;
  absl::MutexLock l(&s.mu);
  if (s.finishing) return absl::FailedPreconditionError("digest pool: Add after Finish");
  const size_t id = s.walks.size();
  s.walks.push_back(std::move(*w));
  const int64_t n = NumChunks(s.walks.back());
  s.chunk_hashes.emplace_back(static_cast<size_t>(n));
  s.hash_ns.push_back(0);
  for (int64_t k = 0; k < n; ++k) s.queue.push_back({&s.walks.back(), k, &s.chunk_hashes.back()[static_cast<size_t>(k)], &s.hash_ns.back()});
  s.pending += static_cast<size_t>(n);
  while (s.threads.size() < static_cast<size_t>(std::max(0, s.o.threads)) && s.threads.size() < s.pending) {
    s.threads.emplace_back([&s] { s.Work(false); });
  }
  return id;
}

absl::StatusOr<std::vector<Digest>> DigestPool::Finish() {
  State& s = *s_;
  {
    absl::MutexLock l(&s.mu);
    if (s.finished) return absl::FailedPreconditionError("digest pool: Finish called twice");
    s.finishing = s.finished = true;
  }
  s.Work(true);
  std::vector<std::thread> threads;
  {
    absl::MutexLock l(&s.mu);
    if (s.late) s.stop = true;
    threads = std::move(s.threads);
  }
  for (std::thread& t : threads) t.join();
  absl::MutexLock l(&s.mu);
  if (s.late || s.pending > 0) {
    return absl::DeadlineExceededError(absl::StrCat("digests of ", s.walks.size(), " boxes did not finish before the deadline"));
  }
  std::vector<Digest> out(s.walks.size());
  for (size_t i = 0; i < s.walks.size(); ++i) out[i] = Combine(s.walks[i], s.chunk_hashes[i]);
  return out;
}

absl::StatusOr<Digest> DigestFromChunks(int64_t stream_bytes, int32_t element_size, const std::vector<uint64_t>& chunk_hashes) {
  if (element_size <= 0 || stream_bytes < 0 || stream_bytes % element_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("digest: a stream of ", stream_bytes, " bytes of ", element_size, "-byte elements"));
  }
  Walk w;
  w.es = element_size;
  w.elements = stream_bytes / element_size;
  if (static_cast<int64_t>(chunk_hashes.size()) != NumChunks(w)) {
    return absl::InvalidArgumentError(absl::StrCat("digest: ", chunk_hashes.size(), " chunk hashes for a stream of ", NumChunks(w), " chunks"));
  }
  return Combine(w, chunk_hashes);
}

struct ChunkStreamHasher::State {
  HashState st{XXH3_createState()};
};

ChunkStreamHasher::ChunkStreamHasher(int32_t element_size)
    : s_(std::make_unique<State>()), chunk_bytes_(ChunkBytes(std::max<int32_t>(1, element_size))) {}

ChunkStreamHasher::~ChunkStreamHasher() = default;

void ChunkStreamHasher::Update(const uint8_t* p, size_t n) {
  while (n > 0) {
    const int64_t within = bytes_ % chunk_bytes_;
    if (within == 0) XXH3_64bits_reset_withSeed(s_->st.get(), static_cast<uint64_t>(bytes_ / chunk_bytes_));
    const size_t take = static_cast<size_t>(std::min<int64_t>(chunk_bytes_ - within, static_cast<int64_t>(n)));
    XXH3_64bits_update(s_->st.get(), p, take);
    bytes_ += static_cast<int64_t>(take);
    p += take;
    n -= take;
    if (bytes_ % chunk_bytes_ == 0) hashes_.push_back(XXH3_64bits_digest(s_->st.get()));
  }
}

std::vector<uint64_t> ChunkStreamHasher::Finish() {
  if (bytes_ % chunk_bytes_ != 0) hashes_.push_back(XXH3_64bits_digest(s_->st.get()));  // the short last chunk
  std::vector<uint64_t> out = std::move(hashes_);
  hashes_.clear();
  bytes_ = 0;
  return out;
}

double DigestPool::HashSeconds(size_t id) const {
  absl::MutexLock l(&s_->mu);
  return id < s_->hash_ns.size() ? static_cast<double>(s_->hash_ns[id]) * 1e-9 : 0;
}

std::string DigestHex(Digest d) { return absl::StrFormat("%016x", d); }

}  // namespace wb::digest
