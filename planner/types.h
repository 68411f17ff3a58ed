#pragma once
// Plain value types shared by the planner, the presets, the daemon and the benches.
// Pure: no I/O, no protobuf, no CUDA. Protos are converted to/from these in daemon/ and client/.
//
// Coordinates: a canonical tensor is an HF checkpoint tensor (name, shape, dtype). A Box is a
// half-open N-D range [begin, end) in that tensor's coordinates. A Piece says where a canonical
// box lives in one worker's local memory: element at canonical coordinate c (begin <= c < end) is
// at byte offset  offset_bytes + sum_i (c_i - begin_i) * strides[i] * element_size  of buffer
// `buffer`. Transposed placements permute strides; fused tensors (qkv_proj, gate_up_proj,
// Megatron's interleaved linear_qkv) are several pieces into one local buffer.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace wb::planner {

// kE8M0: OCP microscaling scale byte (value 2^(bits - 127), 0xff NaN); only as a scale dtype.
// kI4: signed 4-bit integer, two per byte; only as a quantised piece's element dtype.
// kF4E2M1: 4-bit float (sign, 2 exponent bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two
// per byte like kI4; only as a quantised piece's element dtype (NVFP4).
enum class DType : uint8_t { kBF16, kF16, kF32, kF8E4M3, kI64, kE8M0, kI4, kF4E2M1 };

// Packed two per byte along the last dim (kI4, kF4E2M1): planner/quantized.h StoredBytes.
inline bool IsPacked4(DType dtype) { return dtype == DType::kI4 || dtype == DType::kF4E2M1; }

// Bytes per element; 0 for kI4 (sub-byte: see DTypeBits and planner/quantized.h StoredBytes).
int DTypeSize(DType dtype);
int DTypeBits(DType dtype);
const char* DTypeName(DType dtype);  // "bfloat16", "float16", "float32", "float8_e4m3", "int64", "float8_e8m0", "int4"

struct TensorSpec {
  std::string name;            // HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // HF (PyTorch) shape, row-major
  DType dtype = DType::kBF16;
};

// The canonical tensors of one model, in a deterministic order (HF order by layer).
struct Inventory {
  std::string architecture;  // e.g. "Qwen2ForCausalLM"
  std::vector<TensorSpec> tensors;
};

struct Box {
  std::vector<int64_t> begin;
  std::vector<int64_t> end;  // exclusive
};

// A rollout piece held in a narrower dtype than the canonical tensor (user ask 5: quantized
// targets). Block quantisation: the box is cut into blocks of `block` elements (per canonical dim,
// on the tensor's global grid, so the box must start on a block boundary and end on one or at the
// tensor's end); each block gets one scale. Formats (numerics in daemon/quantize.h):
//   float8_e4m3 elements, kF32 scales  - DeepSeek-V3 / vLLM fp8 block-quant checkpoints
//                                        (scale_inv = amax / 448, q = x * (1 / scale_inv));
//   float8_e4m3 elements, kE8M0 scales - OCP microscaling (MXFP8): one power-of-two scale byte
//                                        (2^(e - 127)) per block, usually 1x32 along the last dim;
//   int4 elements, kBF16/kF16/kF32 scales - compressed-tensors "pack-quantized" W4A16, symmetric
//                                        (scale = amax / 7.5, q = rint(x / scale) with the
//                                        quotient in the model dtype as torch computes it),
//                                        groups of 1xG along the last dim.
//                                        Two elements per byte along the last dim, the even one in
//                                        the low nibble, each stored as q + 8; the piece's strides
//                                        count int4 elements, the last one must be 1 and the others
//                                        even, the box's last extent even (StoredBytes).
// The scales are a row-major array of ceil(extent_d / block_d) per dim at `scale_offset_bytes` of
// buffer `scale_buffer`.
// Bytes always travel in the canonical dtype; the receiving node quantises once the version has
// landed (docs/daemon.md, "Quantized targets").
// kF4E2M1 (NVFP4, ModelOpt's format as vLLM loads it): packed like int4 (codes sign << 3 | e2m1,
// no bias), blocks of 16 along the last dim, kF8E4M3 block scales, and a second-level float32
// scale at `global_scale_offset_bytes` of the scale buffer: one per group of pieces that name the
// same place (a preset's local tensor; e.g. vLLM's fused qkv_proj on one rank), computed from the
// group's largest magnitude (daemon/quantize.h). -1 (required for every other dtype): none.
struct Quantization {
  DType dtype = DType::kF8E4M3;  // kF8E4M3, kI4 or kF4E2M1
  std::vector<int64_t> block;    // elements per block, per canonical dim (>= 1)
  int32_t scale_buffer = 0;
  int64_t scale_offset_bytes = 0;
  DType scale_dtype = DType::kF32;  // e4m3: kF32 or kE8M0; int4: kBF16, kF16 or kF32; e2m1: kF8E4M3
  int64_t global_scale_offset_bytes = -1;  // e2m1 only: the float32 global scale (weight_scale_2)
};

struct Piece {
  int32_t tensor = -1;           // index into Inventory::tensors
  Box box;                       // canonical box
  int32_t buffer = 0;            // index into WorkerLayout::buffers
  int64_t offset_bytes = 0;      // byte offset of canonical element `box.begin` in the buffer
  std::vector<int64_t> strides;  // local stride (in elements) per canonical dim
  // Set: the worker holds the box quantised (elements of DTypeSize(quant->dtype) bytes in the
  // formula above). Rollout pieces only.
  std::optional<Quantization> quant;
};

struct BufferInfo {
  int64_t size_bytes = 0;
};

// Everything one worker holds (trainer: source; rollout: destination).
struct WorkerLayout {
  std::vector<BufferInfo> buffers;
  std::vector<Piece> pieces;
};

enum class Role : uint8_t { kTrainer, kRollout };

// A worker in the planning problem. Workers are referred to by their index in Problem::workers.
struct Worker {
  std::string id;  // e.g. "trainer/3", "rollout/r1/2"
  Role role = Role::kTrainer;
  int32_t node = 0;  // node index
  int32_t gpu = 0;   // GPU (or host slot) index within the node
  WorkerLayout layout;
};

struct Topology {
  double intra_node_GBps = 370.0;   // GPU<->GPU copy inside a node, per direction, per GPU
  double nic_GBps_per_gpu = 50.0;   // network per GPU per direction
  bool colocated = false;           // rollout and trainer workers with the same (node, gpu) share memory space
  double same_gpu_GBps = 2000.0;    // device-local copy (colocated)
};

enum class Strategy : uint8_t {
  kWeightBridge,     // dedup per destination node + intra-node relays + cross-node relay trees
  kRank0Broadcast,   // gather everything on trainer 0, send every rollout worker its bytes from it
  kOwnerBroadcast,   // each tensor sent by one owner (its first source) to every destination
  kP2PNoDedup,       // each destination pulls its own pieces from a source, no intra-node sharing
};
const char* StrategyName(Strategy s);  // "weightbridge", "rank0_broadcast", "owner_broadcast", "p2p_no_dedup"

struct Problem {
  Inventory inventory;
  std::vector<Worker> workers;  // trainers and rollouts, any order
  Topology topology;
  int64_t staging_budget_bytes = int64_t{2} << 30;  // per GPU, per bucket
};

enum class Route : uint8_t { kSameGpu, kIntraNode, kInterNode };

// Copy one canonical box from a source worker's memory to a destination worker's memory.
// src_worker may be a rollout worker (a relay): it then reads what an earlier bucket delivered.
struct TransferOp {
  int32_t src_worker = -1;
  int32_t dst_worker = -1;
  int32_t src_piece = -1;  // index into the source worker's layout.pieces that holds `box`
  int32_t dst_piece = -1;  // index into the destination worker's layout.pieces that receives it
  // (Only the rank0_broadcast baseline uses -1: dst_piece = -1 writes the box into the trainer
  // destination's staging area (the gather), src_piece = -1 reads it back from there.)
  int32_t tensor = -1;
  Box box;                 // canonical box (inside both pieces' boxes)
  int64_t bytes = 0;       // canonical bytes of `box` (volume x the tensor's element size)
  Route route = Route::kInterNode;
  // Sender-side quantisation (planner/sender_quant.h; only with PlanOptions::sender_quantization):
  // the sending node quantises `box` into the destination piece's format (its Quantization) and
  // moves the quantised elements plus the scales of the box's blocks; a relay (src_worker a
  // rollout) copies the quantised elements and scales it received. Every op into that destination
  // piece is then sender-quantised, so the receiver does not quantise the piece. false: canonical
  // bytes into the receiver's shadow (receiver-side quantisation, docs/daemon.md).
  bool sender_quantized = false;
  int64_t wire_bytes = 0;  // bytes the op moves (quantised elements + scales, or `bytes`); 0: `bytes`
};

// Ops of one bucket may run concurrently. A bucket only reads relay data written by earlier buckets.
struct Bucket {
  std::vector<TransferOp> ops;
};

struct PlanStats {
  bool complete = false;
  int64_t redundant_bytes = 0;    // bytes crossing the network more than once into one node
  int64_t bytes_inter_node = 0;
  int64_t bytes_intra_node = 0;   // includes same-GPU copies
  // As moved (TransferOp::wire_bytes): equal to bytes_inter_node + bytes_intra_node without
  // sender-side quantisation.
  int64_t wire_bytes = 0;
  int64_t wire_bytes_inter_node = 0;
  int64_t sender_quantized_bytes = 0;  // canonical bytes of sender-quantised ops
  int64_t num_ops = 0;
  double lower_bound_s = 0;       // link-capacity lower bound
  double makespan_s = 0;          // predicted under the cost model
  double plan_ms = 0;             // time spent planning (filled by the caller that measured it)
};

struct Plan {
  Strategy strategy = Strategy::kWeightBridge;
  std::vector<Bucket> buckets;
  PlanStats stats;
  std::string fingerprint;  // hex; equal inputs give equal fingerprints
};

}  // namespace wb::planner
