#pragma once
// A realistic model of what one RL training step does to the bf16 weights a rollout receives, so
// delta benchmarks measure the bytes a real update would leave to send (issue 17.2).
//
// Trainers (Megatron, FSDP2, verl, ...) keep fp32 master weights and publish their bf16 rounding
// (round to nearest even, as torch's `.to(torch.bfloat16)`). Adam's step is lr * m_hat /
// (sqrt(v_hat) + eps): its normalised part is about +-1 per element (exactly +-1 on the first
// step; smaller when gradients are noisy), so every master element moves by about lr with a sign
// that looks random from one element to the next. The model takes the conservative end: every
// element moves by exactly +lr or -lr each step, the sign a hash of (seed, step, tensor, index).
// A bf16 element changes when its master crosses a rounding boundary, so small weights (fine bf16
// spacing) change often and large ones (norm weights ~1.0) rarely: for N(0, 0.02) weights at lr
// 1e-6 a few percent of elements change per step, at 1e-5 about a quarter (update_model_test,
// bench:delta print the measured shares).
//
// Pure: no I/O. Deterministic for a given seed (masters from a hashed Box-Muller normal).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace wb::delta {

// bf16 bits of `f` rounded to nearest even (torch's float -> bfloat16); NaN stays a quiet NaN.
uint16_t Bf16FromFloat(float f);
float FloatFromBf16(uint16_t bits);

// Distance between adjacent bf16 values around |x| (the rounding interval a master weight must
// cross to change its bf16 rounding): 2^(e - 7) for |x| in [2^e, 2^(e+1)), subnormal spacing below.
double Bf16Spacing(float x);

// How one tensor's fp32 masters start: N(mean, std).
struct TensorInit {
  std::string name;
  int64_t elements = 0;
  float mean = 0.0f;
  float std = 0.02f;
};

// Typical trained-LLM magnitudes by HF tensor name: norm weights ("norm" / "layernorm" in the
// name) N(1, 0.05); everything else - embeddings, lm_head, projections, experts, biases -
// N(0, 0.02) (HF `initializer_range`, the scale of Qwen / Llama weights).
TensorInit InitForTensor(std::string_view name, int64_t elements);

class UpdateModel {
 public:
  // Allocates the fp32 masters (4 bytes per element) and draws them. INVALID_ARGUMENT naming the
  // tensor for a negative element count or a std < 0; the total must stay under 2^40 elements.
  static absl::StatusOr<UpdateModel> Create(std::vector<TensorInit> tensors, uint64_t seed);

  int64_t elements() const { return static_cast<int64_t>(masters_.size()); }
  int num_tensors() const { return static_cast<int>(tensors_.size()); }
  const TensorInit& tensor(int t) const { return tensors_[t]; }
  // First element of tensor t in the concatenated element order (tensors in the given order).
  int64_t offset(int t) const { return offsets_[t]; }
  int64_t steps() const { return steps_; }
  absl::Span<const float> masters() const { return masters_; }

  // Writes the bf16 rounding of the current masters, all tensors concatenated; `out` must hold
  // exactly elements() values (INVALID_ARGUMENT otherwise, nothing written).
  absl::Status Round(absl::Span<uint16_t> out) const;

  // One Adam-like step: every master moves by +lr or -lr; then writes the new bf16 rounding to
  // `out` as Round does (one pass). lr must be finite and >= 0.
  absl::Status Step(double lr, absl::Span<uint16_t> out);

 private:
  UpdateModel() = default;

  std::vector<TensorInit> tensors_;
  std::vector<int64_t> offsets_;
  std::vector<float> masters_;
  uint64_t seed_ = 0;
  int64_t steps_ = 0;
};

// Number of positions where a and b hold the same bits (min of the two sizes compared; the
// caller passes equal sizes).
int64_t CountIdentical(absl::Span<const uint16_t> a, absl::Span<const uint16_t> b);

// The share of bf16 elements a step of `lr` is expected to change, from the masters alone: each
// element changes with probability min(1, lr / Bf16Spacing(master)) (its position inside its
// rounding interval is uniform). Used by the test to check the simulation against the analysis.
double ExpectedChangedFraction(absl::Span<const float> masters, double lr);

// The mean share of bf16 elements identical between consecutive versions under the model, measured
// on `sample` N(0, 0.02) elements over `steps` steps of `lr`: the change fraction (1 - this) to give
// the synthetic versions of tests/common/weight_gen.h (DeltaElementBits) so that an end-to-end run
// (bench:e2e --delta --lr=...) moves versions as sparse as real ones. INVALID_ARGUMENT for a bad lr,
// sample < 1 or steps < 1.
absl::StatusOr<double> SampleIdenticalFraction(double lr, int64_t sample = int64_t{1} << 20, int steps = 2,
                                               uint64_t seed = 1);

}  // namespace wb::delta
