// libFuzzer target: planner::ValidateLayout / ValidateCoverage on arbitrary inventories and layouts.
// Layouts come from workers over gRPC, so every field may be hostile: negative or huge shapes, boxes,
// strides, offsets, buffer indices, out-of-range tensor ids and dtypes. Contract under test: an
// absl::Status comes back (no crash, no UB, no allocation sized by the input).
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <vector>

#include "planner/quantized.h"
#include "planner/types.h"
#include "planner/validate.h"

namespace {

using namespace wb::planner;

// Mostly small values (so checks past the first one are reached), sometimes anything.
int64_t Value(FuzzedDataProvider& p) {
  switch (p.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
    case 1:
      return p.ConsumeIntegralInRange<int64_t>(0, 16);
    case 2:
      return p.ConsumeIntegralInRange<int64_t>(-2, 1 << 20);
    default:
      return p.ConsumeIntegral<int64_t>();
  }
}

WorkerLayout MakeLayout(FuzzedDataProvider& p, int num_tensors) {
  WorkerLayout layout;
  const int buffers = p.ConsumeIntegralInRange(0, 3);
  for (int i = 0; i < buffers; ++i) layout.buffers.push_back(BufferInfo{Value(p)});
  const int pieces = p.ConsumeIntegralInRange(0, 6);
  for (int i = 0; i < pieces; ++i) {
    Piece piece;
    piece.tensor = p.ConsumeIntegralInRange<int32_t>(-1, num_tensors);
    const int rank = p.ConsumeIntegralInRange(0, 4);
    for (int d = 0; d < rank; ++d) {
      piece.box.begin.push_back(Value(p));
      piece.box.end.push_back(Value(p));
    }
    // Occasionally ragged ranks: the validator must say so, not index past the end.
    if (p.ConsumeIntegralInRange(0, 15) == 0) piece.box.end.push_back(Value(p));
    piece.buffer = p.ConsumeIntegralInRange<int32_t>(-1, buffers);
    piece.offset_bytes = Value(p);
    const int srank = p.ConsumeIntegralInRange(0, 15) == 0 ? p.ConsumeIntegralInRange(0, 5) : rank;
    for (int d = 0; d < srank; ++d) piece.strides.push_back(Value(p));
    // Quantised pieces (fp8 / MX / int4 / NVFP4 with any scale dtype, hostile blocks, scale
    // regions and global scales).
    if (p.ConsumeIntegralInRange(0, 3) == 0) {
      Quantization q;
      q.dtype = static_cast<DType>(p.ConsumeIntegralInRange<uint8_t>(0, 8));  // 8: invalid
      q.scale_dtype = static_cast<DType>(p.ConsumeIntegralInRange<uint8_t>(0, 8));
      if (p.ConsumeBool()) q.global_scale_offset_bytes = Value(p);
      const int brank = p.ConsumeIntegralInRange(0, 15) == 0 ? p.ConsumeIntegralInRange(0, 5) : rank;
      for (int d = 0; d < brank; ++d) q.block.push_back(Value(p));
      q.scale_buffer = p.ConsumeIntegralInRange<int32_t>(-1, buffers);
      q.scale_offset_bytes = Value(p);
      piece.quant = q;
    }
    layout.pieces.push_back(std::move(piece));
  }
  return layout;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider p(data, size);
  Inventory inventory;
  const int num_tensors = p.ConsumeIntegralInRange(1, 3);
  for (int t = 0; t < num_tensors; ++t) {
    TensorSpec spec;
    spec.name = "t" + std::to_string(t);
    const int rank = p.ConsumeIntegralInRange(0, 4);
    for (int d = 0; d < rank; ++d) spec.shape.push_back(Value(p));
    spec.dtype = static_cast<DType>(p.ConsumeIntegralInRange<uint8_t>(0, 7));  // 6 (int4, sub-byte), 7: invalid
    inventory.tensors.push_back(std::move(spec));
  }
  Worker source{"trainer/0", Role::kTrainer, 0, 0, MakeLayout(p, num_tensors)};
  Worker dest{"rollout/0", Role::kRollout, 0, 0, MakeLayout(p, num_tensors)};
  const bool source_ok = ValidateLayout(inventory, source.layout, Role::kTrainer, source.id).ok();
  const bool dest_ok = ValidateLayout(inventory, dest.layout, Role::kRollout, dest.id).ok();
  // Coverage assumes valid layouts (its contract); only call it then.
  if (source_ok && dest_ok) (void)ValidateCoverage(inventory, {&source}, {&dest});
  // A valid rollout layout's staging (shadows of quantised pieces) and byte views must be
  // computable, and the grown buffers must hold every shadow.
  if (dest_ok) {
    const WorkerLayout staging = StagingLayout(inventory, dest.layout);
    for (size_t k = 0; k < staging.pieces.size(); ++k) {
      const ByteView v = StoredBytes(inventory, dest.layout.pieces[k]);
      if (v.element_size <= 0) __builtin_trap();
      if (staging.pieces[k].buffer >= 0 && staging.buffers[staging.pieces[k].buffer].size_bytes < staging.pieces[k].offset_bytes) __builtin_trap();
    }
  }
  return 0;
}
