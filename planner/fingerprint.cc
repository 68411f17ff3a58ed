#include "planner/fingerprint.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <xxhash.h>

namespace wb::planner {
namespace {

// Streams fixed-width little-endian-in-memory values; strings and vectors are length-prefixed so
// that different field splits can never produce the same byte stream.
class Hasher {
 public:
  Hasher() : state_(XXH3_createState()) { XXH3_128bits_reset(state_); }
  ~Hasher() { XXH3_freeState(state_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;

  void Bytes(const void* p, size_t n) {
    if (used_ + n > kFlush) Flush();
    if (n > kFlush) {
      XXH3_128bits_update(state_, p, n);
      return;
    }
    std::memcpy(buf_.data() + used_, p, n);
    used_ += n;
  }
  void I64(int64_t v) { Bytes(&v, sizeof v); }
  void F64(double v) { Bytes(&v, sizeof v); }
  void Str(const std::string& s) {
    I64(static_cast<int64_t>(s.size()));
    Bytes(s.data(), s.size());
  }
  void Vec(const std::vector<int64_t>& v) {
    I64(static_cast<int64_t>(v.size()));
    Bytes(v.data(), v.size() * sizeof(int64_t));
  }
  void BoxV(const Box& b) {
    Vec(b.begin);
    Vec(b.end);
  }
  std::string Hex() {
    Flush();
    const XXH128_hash_t h = XXH3_128bits_digest(state_);
    char out[33];
    std::snprintf(out, sizeof out, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                  static_cast<unsigned long long>(h.low64));
    return out;
  }

 private:
  static constexpr size_t kFlush = 1 << 16;
  void Flush() {
    if (used_ > 0) XXH3_128bits_update(state_, buf_.data(), used_);
    used_ = 0;
  }
  XXH3_state_t* state_;
  std::vector<unsigned char> buf_ = std::vector<unsigned char>(kFlush);
  size_t used_ = 0;
};

void HashProblem(Hasher& h, const Problem& p) {
  h.Str(p.inventory.architecture);
  h.I64(static_cast<int64_t>(p.inventory.tensors.size()));
  for (const TensorSpec& t : p.inventory.tensors) {
    h.Str(t.name);
    h.Vec(t.shape);
    h.I64(static_cast<int64_t>(t.dtype));
  }
  h.I64(static_cast<int64_t>(p.workers.size()));
  for (const Worker& w : p.workers) {
    h.Str(w.id);
    h.I64(static_cast<int64_t>(w.role));
    h.I64(w.node);
    h.I64(w.gpu);
    h.I64(static_cast<int64_t>(w.layout.buffers.size()));
    for (const BufferInfo& b : w.layout.buffers) h.I64(b.size_bytes);
    h.I64(static_cast<int64_t>(w.layout.pieces.size()));
    for (const Piece& pc : w.layout.pieces) {
      h.I64(pc.tensor);
      h.BoxV(pc.box);
      h.I64(pc.buffer);
      h.I64(pc.offset_bytes);
      h.Vec(pc.strides);
      h.I64(pc.quant.has_value() ? 1 : 0);
      if (pc.quant.has_value()) {
        h.I64(static_cast<int64_t>(pc.quant->dtype));
        h.I64(static_cast<int64_t>(pc.quant->scale_dtype));
        h.Vec(pc.quant->block);
        h.I64(pc.quant->scale_buffer);
        h.I64(pc.quant->scale_offset_bytes);
      }
    }
  }
  h.F64(p.topology.intra_node_GBps);
  h.F64(p.topology.nic_GBps_per_gpu);
  h.I64(p.topology.colocated ? 1 : 0);
  h.F64(p.topology.same_gpu_GBps);
  h.I64(p.staging_budget_bytes);
}

}  // namespace

std::string ProblemFingerprint(const Problem& problem) {
  Hasher h;
  HashProblem(h, problem);
  return h.Hex();
}

std::string Fingerprint(const Problem& problem, const Plan& plan) {
  Hasher h;
  HashProblem(h, problem);
  h.I64(static_cast<int64_t>(plan.strategy));
  h.I64(static_cast<int64_t>(plan.buckets.size()));
  for (const Bucket& b : plan.buckets) {
    h.I64(static_cast<int64_t>(b.ops.size()));
    for (const TransferOp& op : b.ops) {
      h.I64(op.src_worker);
      h.I64(op.dst_worker);
      h.I64(op.src_piece);
      h.I64(op.dst_piece);
      h.I64(op.tensor);
      h.BoxV(op.box);
      h.I64(op.bytes);
      h.I64(static_cast<int64_t>(op.route));
      // Only when set, so plans without sender-side quantisation keep their fingerprints.
      if (op.sender_quantized) {
        h.I64(-1);
        h.I64(op.wire_bytes);
      }
    }
  }
  return h.Hex();
}

}  // namespace wb::planner
