#include "daemon/delta/update_model.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include "gtest/gtest.h"

namespace wb::delta {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(Bf16FromFloat(1.0f), 0x3F80);
  EXPECT_EQ(Bf16FromFloat(-2.0f), 0xC000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1.0).
  EXPECT_EQ(Bf16FromFloat(1.0f + 0x1.0p-8f), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(Bf16FromFloat(1.0f + 3 * 0x1.0p-8f), 0x3F82);
  EXPECT_EQ(Bf16FromFloat(1.0f + 0x1.0p-8f + 0x1.0p-20f), 0x3F81);  // just above half: up
  EXPECT_EQ(Bf16FromFloat(INFINITY), 0x7F80);
  const uint16_t nan = Bf16FromFloat(NAN);
  EXPECT_EQ(nan & 0x7F80, 0x7F80);
  EXPECT_NE(nan & 0x7F, 0);
  EXPECT_EQ(FloatFromBf16(0x3F80), 1.0f);
  EXPECT_EQ(Bf16Spacing(1.0f), 0x1.0p-7);
  EXPECT_EQ(Bf16Spacing(1.99f), 0x1.0p-7);
  EXPECT_EQ(Bf16Spacing(-0.02f), 0x1.0p-13);  // 0.02 in [2^-6, 2^-5)
}

TEST(UpdateModel, RejectsBadInput) {
  EXPECT_EQ(UpdateModel::Create({{"w", -1, 0, 0.02f}}, 1).status().code(), absl::StatusCode::kInvalidArgument);
  auto m = UpdateModel::Create({{"w", 100, 0, 0.02f}}, 1);
  ASSERT_TRUE(m.ok());
  std::vector<uint16_t> small(99);
  const absl::Status s = m->Step(1e-6, absl::MakeSpan(small));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("99"), std::string::npos) << s;
  std::vector<uint16_t> out(100);
  EXPECT_EQ(m->Step(-1.0, absl::MakeSpan(out)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Step(NAN, absl::MakeSpan(out)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(UpdateModel, InitialWeightsHaveTheRequestedDistribution) {
  auto m = UpdateModel::Create({InitForTensor("model.layers.0.mlp.up_proj.weight", 1 << 20),
                                InitForTensor("model.layers.0.input_layernorm.weight", 1 << 16)},
                               7);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->offset(1), 1 << 20);
  for (int t = 0; t < 2; ++t) {
    const auto w = m->masters().subspan(m->offset(t), m->tensor(t).elements);
    double sum = 0, sq = 0;
    for (float x : w) sum += x;
    const double mean = sum / w.size();
    for (float x : w) sq += (x - mean) * (x - mean);
    const double sd = std::sqrt(sq / w.size());
    EXPECT_NEAR(mean, m->tensor(t).mean, 0.002) << m->tensor(t).name;
    EXPECT_NEAR(sd, m->tensor(t).std, 0.02 * m->tensor(t).std) << m->tensor(t).name;
  }
  EXPECT_EQ(m->tensor(1).mean, 1.0f);
}

// Runs `steps` steps at `lr` on N(0, 0.02) weights; returns the mean share of identical bf16
// elements between consecutive versions, and checks it against the analysis (each element changes
// with probability min(1, lr / spacing)).
double MeasureIdentical(double lr, int steps) {
  auto m = UpdateModel::Create({InitForTensor("model.layers.0.self_attn.q_proj.weight", 1 << 21)}, 42);
  EXPECT_TRUE(m.ok());
  std::vector<uint16_t> prev(m->elements()), cur(m->elements());
  EXPECT_TRUE(m->Round(absl::MakeSpan(prev)).ok());
  double identical = 0;
  for (int s = 0; s < steps; ++s) {
    const double expected_changed = ExpectedChangedFraction(m->masters(), lr);
    EXPECT_TRUE(m->Step(lr, absl::MakeSpan(cur)).ok());
    // The one-pass rounding in Step agrees with Round.
    std::vector<uint16_t> again(m->elements());
    EXPECT_TRUE(m->Round(absl::MakeSpan(again)).ok());
    EXPECT_EQ(CountIdentical(cur, again), m->elements());
    const double same = static_cast<double>(CountIdentical(prev, cur)) / m->elements();
    EXPECT_NEAR(1.0 - same, expected_changed, 0.1 * expected_changed) << "lr " << lr << " step " << s;
    identical += same;
    prev.swap(cur);
  }
  return identical / steps;
}

TEST(UpdateModel, IdenticalShareAtRealisticLearningRates) {
  const double at_1e6 = MeasureIdentical(1e-6, 3);
  const double at_1e5 = MeasureIdentical(1e-5, 3);
  std::printf("identical bf16 elements per step, N(0, 0.02) weights: lr 1e-6 %.4f, lr 1e-5 %.4f\n", at_1e6, at_1e5);
  // lr 1e-6 on std-0.02 weights: the large majority stays identical (a step is ~1% of the bf16
  // spacing of a typical weight); lr 1e-5 changes many more, but still a minority.
  EXPECT_GT(at_1e6, 0.90);
  EXPECT_LT(at_1e6, 0.995);
  EXPECT_GT(at_1e5, 0.60);
  EXPECT_LT(at_1e5, at_1e6 - 0.05);
  EXPECT_DOUBLE_EQ(MeasureIdentical(0.0, 1), 1.0);
}

TEST(UpdateModel, SampleIdenticalFractionAgreesWithTheFullRun) {
  auto at_1e6 = SampleIdenticalFraction(1e-6);
  ASSERT_TRUE(at_1e6.ok()) << at_1e6.status();
  EXPECT_NEAR(*at_1e6, MeasureIdentical(1e-6, 2), 0.003);
  EXPECT_EQ(SampleIdenticalFraction(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SampleIdenticalFraction(1e-6, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(UpdateModel, NormWeightsNearOneBarelyChange) {
  auto m = UpdateModel::Create({InitForTensor("model.norm.weight", 1 << 18)}, 3);
  ASSERT_TRUE(m.ok());
  std::vector<uint16_t> prev(m->elements()), cur(m->elements());
  ASSERT_TRUE(m->Round(absl::MakeSpan(prev)).ok());
  ASSERT_TRUE(m->Step(1e-6, absl::MakeSpan(cur)).ok());
  const double same = static_cast<double>(CountIdentical(prev, cur)) / m->elements();
  EXPECT_GT(same, 0.999);  // spacing 2^-8..2^-7 near 1: a 1e-6 step crosses ~1 boundary in 4000
}

TEST(UpdateModel, DeterministicForASeed) {
  auto a = UpdateModel::Create({{"w", 1000, 0, 0.02f}}, 9);
  auto b = UpdateModel::Create({{"w", 1000, 0, 0.02f}}, 9);
  auto c = UpdateModel::Create({{"w", 1000, 0, 0.02f}}, 10);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::vector<uint16_t> x(1000), y(1000), z(1000);
  ASSERT_TRUE(a->Step(1e-5, absl::MakeSpan(x)).ok());
  ASSERT_TRUE(b->Step(1e-5, absl::MakeSpan(y)).ok());
  ASSERT_TRUE(c->Step(1e-5, absl::MakeSpan(z)).ok());
  EXPECT_EQ(x, y);
  EXPECT_NE(x, z);
}

}  // namespace
}  // namespace wb::delta
