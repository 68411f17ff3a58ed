// libFuzzer target: planner::ExtractPieces on index probes. A probe is whatever an engine's loader
// wrote into a local tensor, i.e. arbitrary int64s; its contract is "never crashes on arbitrary probe
// values" and, when it succeeds, "pieces covering exactly the mapped elements". Both are checked:
// a successful result must pass ValidateLayout and its boxes must hold exactly as many elements as
// the probe has mapped (>= 0) entries.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "planner/index_probe.h"
#include "planner/inventory.h"
#include "planner/types.h"
#include "planner/validate.h"

namespace {

using namespace wb::planner;

[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_index_probe: %s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider p(data, size);
  Inventory inventory;
  const int num_tensors = p.ConsumeIntegralInRange(1, 3);
  for (int t = 0; t < num_tensors; ++t) {
    TensorSpec spec;
    spec.name = "t" + std::to_string(t);
    const int rank = p.ConsumeIntegralInRange(1, 3);
    for (int d = 0; d < rank; ++d) spec.shape.push_back(p.ConsumeIntegralInRange<int64_t>(1, 8));
    spec.dtype = p.PickValueInArray({DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3});
    inventory.tensors.push_back(std::move(spec));
  }
  const std::vector<int64_t> bases = TensorBases(inventory);

  std::vector<int64_t> local_shape;
  std::vector<int64_t> probe;
  if (p.ConsumeBool()) {
    // Structured: a (possibly transposed, possibly offset) sub-box of one tensor, as an engine's
    // loader would produce, then a few corruptions.
    const int t = p.ConsumeIntegralInRange(0, num_tensors - 1);
    const TensorSpec& spec = inventory.tensors[t];
    const size_t rank = spec.shape.size();
    std::vector<int64_t> begin(rank), extent(rank), perm(rank);
    for (size_t d = 0; d < rank; ++d) {
      begin[d] = p.ConsumeIntegralInRange<int64_t>(0, spec.shape[d] - 1);
      extent[d] = p.ConsumeIntegralInRange<int64_t>(1, spec.shape[d] - begin[d]);
      perm[d] = static_cast<int64_t>(d);
    }
    if (rank >= 2 && p.ConsumeBool()) std::swap(perm[0], perm[1]);  // transposed placement
    for (size_t d = 0; d < rank; ++d) local_shape.push_back(extent[perm[d]]);
    int64_t n = 1;
    for (int64_t e : local_shape) n *= e;
    probe.resize(n);
    std::vector<int64_t> local(rank, 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t idx = 0;
      for (size_t d = 0; d < rank; ++d) {
        // local dim k holds canonical dim perm[k]
        int64_t c = 0;
        for (size_t k = 0; k < rank; ++k) {
          if (perm[k] == static_cast<int64_t>(d)) c = begin[d] + local[k];
        }
        idx = idx * spec.shape[d] + c;
      }
      probe[i] = bases[t] + idx;
      for (size_t k = rank; k-- > 0;) {
        if (++local[k] < local_shape[k]) break;
        local[k] = 0;
      }
    }
    const int corruptions = p.ConsumeIntegralInRange(0, 3);
    for (int c = 0; c < corruptions && n > 0; ++c) {
      probe[p.ConsumeIntegralInRange<int64_t>(0, n - 1)] =
          p.ConsumeBool() ? -1 : p.ConsumeIntegralInRange<int64_t>(-3, bases.back() + 3);
    }
  } else {
    // Raw: any shape up to 512 elements, any values (often near the valid range).
    const int rank = p.ConsumeIntegralInRange(0, 3);
    int64_t n = 1;
    for (int d = 0; d < rank; ++d) {
      local_shape.push_back(p.ConsumeIntegralInRange<int64_t>(p.ConsumeBool() ? -2 : 0, 8));
      n *= local_shape.back() > 0 ? local_shape.back() : 1;
    }
    if (p.ConsumeIntegralInRange(0, 7) == 0) n += p.ConsumeIntegralInRange<int64_t>(-1, 1);  // size mismatch
    for (int64_t i = 0; i < n && i < 512; ++i) {
      probe.push_back(p.ConsumeBool() ? p.ConsumeIntegralInRange<int64_t>(-1, bases.back() + 2)
                                      : p.ConsumeIntegral<int64_t>());
    }
  }
  const int64_t offset = p.ConsumeBool() ? p.ConsumeIntegralInRange<int64_t>(0, 64) * 4 : p.ConsumeIntegral<int64_t>();
  const int element_size = p.PickValueInArray({1, 2, 4, 8, 0, -2, 3});

  auto pieces = ExtractPieces(inventory, bases, probe, local_shape, offset, element_size, 0);
  if (!pieces.ok()) return 0;

  int64_t mapped = 0;
  for (int64_t v : probe) mapped += v >= 0 ? 1 : 0;
  int64_t covered = 0;
  for (const Piece& piece : *pieces) {
    int64_t volume = 1;
    for (size_t d = 0; d < piece.box.begin.size(); ++d) volume *= piece.box.end[d] - piece.box.begin[d];
    covered += volume;
  }
  if (covered != mapped) {
    Fail("pieces do not cover exactly the mapped elements",
         std::to_string(covered) + " covered, " + std::to_string(mapped) + " mapped");
  }
  WorkerLayout layout;
  layout.buffers.push_back(BufferInfo{offset + static_cast<int64_t>(probe.size()) * element_size});
  layout.pieces = *pieces;
  if (absl::Status s = ValidateLayout(inventory, layout, Role::kTrainer, "probe"); !s.ok()) {
    Fail("extracted pieces fail ValidateLayout", std::string(s.message()));
  }
  return 0;
}
