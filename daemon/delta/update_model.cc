#include "daemon/delta/update_model.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace wb::delta {
namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

uint64_t Hash3(uint64_t a, uint64_t b, uint64_t c) {
  return Mix(Mix(a * 0x9E3779B97F4A7C15ull ^ b) * 0xD1B54A32D192ED03ull ^ c);
}

// Uniform in (0, 1]: never 0, so log() below is finite.
double Unit(uint64_t bits) { return (static_cast<double>(bits >> 11) + 1.0) * 0x1.0p-53; }

constexpr int64_t kMaxElements = int64_t{1} << 40;

}  // namespace

uint16_t Bf16FromFloat(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float FloatFromBf16(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double Bf16Spacing(float x) {
  const double a = std::fabs(static_cast<double>(x));
  // bf16 has fp32's exponent range and 7 stored mantissa bits.
  constexpr double kMinNormal = 0x1.0p-126;
  if (a < kMinNormal) return 0x1.0p-133;
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1): a in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 7);
}

TensorInit InitForTensor(std::string_view name, int64_t elements) {
  TensorInit init;
  init.name = std::string(name);
  init.elements = elements;
  if (name.find("norm") != std::string_view::npos) {  // input_layernorm, post_attention_layernorm, model.norm, q/k_norm
    init.mean = 1.0f;
    init.std = 0.05f;
  }
  return init;
}

absl::StatusOr<UpdateModel> UpdateModel::Create(std::vector<TensorInit> tensors, uint64_t seed) {
  UpdateModel m;
  int64_t total = 0;
  for (const TensorInit& t : tensors) {
    if (t.elements < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("update model: tensor '", t.name, "' has a negative element count ", t.elements));
    }
    if (!(t.std >= 0.0f) || !std::isfinite(t.mean) || !std::isfinite(t.std)) {
      return absl::InvalidArgumentError(absl::StrCat("update model: tensor '", t.name, "' has init mean ",
                                                     t.mean, " std ", t.std, " (need finite, std >= 0)"));
    }
    if (t.elements > kMaxElements - total) {
      return absl::InvalidArgumentError(absl::StrCat("update model: more than ", kMaxElements,
                                                     " elements in all (at tensor '", t.name, "')"));
    }
    m.offsets_.push_back(total);
    total += t.elements;
  }
  m.tensors_ = std::move(tensors);
  m.seed_ = seed;
  m.masters_.resize(static_cast<size_t>(total));
  for (size_t t = 0; t < m.tensors_.size(); ++t) {
    const TensorInit& init = m.tensors_[t];
    float* out = m.masters_.data() + m.offsets_[t];
    // Box-Muller on hashed uniforms: two normals per hash, index pairs (2k, 2k+1).
    for (int64_t i = 0; i < init.elements; i += 2) {
      const uint64_t h1 = Hash3(seed, t, static_cast<uint64_t>(i));
      const uint64_t h2 = Mix(h1 ^ 0xA24BAED4963EE407ull);
      const double r = std::sqrt(-2.0 * std::log(Unit(h1)));
      const double phi = 2.0 * M_PI * Unit(h2);
      out[i] = static_cast<float>(init.mean + init.std * r * std::cos(phi));
      if (i + 1 < init.elements) out[i + 1] = static_cast<float>(init.mean + init.std * r * std::sin(phi));
    }
  }
  return m;
}

absl::Status UpdateModel::Round(absl::Span<uint16_t> out) const {
  if (out.size() != masters_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("update model: Round into ", out.size(), " bf16 values, the model has ",
                                                   masters_.size(), " elements"));
  }
  for (size_t i = 0; i < masters_.size(); ++i) out[i] = Bf16FromFloat(masters_[i]);
  return absl::OkStatus();
}

absl::Status UpdateModel::Step(double lr, absl::Span<uint16_t> out) {
  if (out.size() != masters_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("update model: Step into ", out.size(), " bf16 values, the model has ",
                                                   masters_.size(), " elements"));
  }
  if (!(lr >= 0.0) || !std::isfinite(lr)) {
    return absl::InvalidArgumentError(absl::StrCat("update model: lr ", lr, " (need finite, >= 0)"));
  }
  ++steps_;
  const float up = static_cast<float>(lr);
  float* m = masters_.data();
  uint16_t* o = out.data();
  const int64_t n = elements();
  // One hash gives the signs of 64 consecutive elements; the 64-element inner loop vectorises.
  for (int64_t base = 0; base < n; base += 64) {
    const uint64_t signs = Hash3(seed_ ^ 0x5DEECE66Dull, static_cast<uint64_t>(steps_), static_cast<uint64_t>(base));
    const int64_t len = n - base < 64 ? n - base : 64;
    for (int64_t j = 0; j < len; ++j) {
      const float s = ((signs >> j) & 1u) ? up : -up;
      const float v = m[base + j] + s;
      m[base + j] = v;
      uint32_t u;
      std::memcpy(&u, &v, 4);
      // Masters stay finite here (|step| is tiny), so no NaN branch: RNE as Bf16FromFloat.
      o[base + j] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
  }
  return absl::OkStatus();
}

int64_t CountIdentical(absl::Span<const uint16_t> a, absl::Span<const uint16_t> b) {
  const size_t n = a.size() < b.size() ? a.size() : b.size();
  int64_t same = 0;
  for (size_t i = 0; i < n; ++i) same += a[i] == b[i];
  return same;
}

double ExpectedChangedFraction(absl::Span<const float> masters, double lr) {
  if (masters.empty()) return 0.0;
  double sum = 0.0;
  for (float x : masters) {
    const double p = lr / Bf16Spacing(x);
    sum += p < 1.0 ? p : 1.0;
  }
  return sum / static_cast<double>(masters.size());
}

absl::StatusOr<double> SampleIdenticalFraction(double lr, int64_t sample, int steps, uint64_t seed) {
  if (sample < 1 || steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat("update model: sample ", sample, " elements, ", steps,
                                                   " steps (need >= 1 each)"));
  }
  absl::StatusOr<UpdateModel> m = UpdateModel::Create({InitForTensor("sample.weight", sample)}, seed);
  if (!m.ok()) return m.status();
  std::vector<uint16_t> prev(static_cast<size_t>(sample)), cur(static_cast<size_t>(sample));
  if (absl::Status s = m->Round(absl::MakeSpan(prev)); !s.ok()) return s;
  int64_t same = 0;
  for (int i = 0; i < steps; ++i) {
    if (absl::Status s = m->Step(lr, absl::MakeSpan(cur)); !s.ok()) return s;
    same += CountIdentical(prev, cur);
    prev.swap(cur);
  }
  return static_cast<double>(same) / (static_cast<double>(sample) * steps);
}

}  // namespace wb::delta
