#include "pipewright/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace pipewright {
namespace {

Parameter MakeParam(const std::string& name, const std::vector<float>& value,
                    const std::vector<float>& grad, bool weight_decay) {
  Parameter p;
  p.name = name;
  p.value = Tensor::FromVector({static_cast<int64_t>(value.size())}, value);
  p.grad = Tensor::FromVector({static_cast<int64_t>(grad.size())}, grad);
  p.weight_decay = weight_decay;
  return p;
}

void SetGrad(Parameter& p, const std::vector<float>& g) {
  for (size_t i = 0; i < g.size(); ++i) p.grad.data<float>()[i] = g[i];
}

// Reference AdamW (decoupled weight decay, bias-corrected moments) in double.
struct RefAdam {
  std::vector<double> p, m, v;
  int t = 0;
  void Step(const std::vector<float>& g, double lr, double b1, double b2, double eps, double wd) {
    ++t;
    for (size_t i = 0; i < p.size(); ++i) {
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
      p[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd * p[i]);
    }
  }
};

TEST(AdamWTest, FirstStepHandValues) {
  // At step 1 the bias-corrected update is g / |g| (sign), plus decoupled decay lr * wd * p.
  Parameter w = MakeParam("w", {1.0f, -2.0f, 0.5f}, {0.1f, -0.2f, 0.3f}, true);
  Parameter b = MakeParam("b", {1.0f, -2.0f, 0.5f}, {0.1f, -0.2f, 0.3f}, false);
  OptimizerConfig c;  // AdamW, beta 0.9/0.95, eps 1e-8, wd 0.1
  auto opt = Optimizer::Create(c, {&w, &b});
  ASSERT_TRUE(opt->Step(0.01f).ok());
  EXPECT_EQ(opt->step_count(), 1);
  std::vector<float> wv = w.value.ToVector(), bv = b.value.ToVector();
  EXPECT_NEAR(wv[0], 1.0 - 0.01 * (1 + 0.1 * 1.0), 1e-6);     // 0.989
  EXPECT_NEAR(wv[1], -2.0 - 0.01 * (-1 + 0.1 * -2.0), 1e-6);  // -1.988
  EXPECT_NEAR(wv[2], 0.5 - 0.01 * (1 + 0.1 * 0.5), 1e-6);     // 0.4895
  EXPECT_NEAR(bv[0], 0.99, 1e-6);                             // no weight decay on this one
  EXPECT_NEAR(bv[1], -1.99, 1e-6);
  EXPECT_NEAR(bv[2], 0.49, 1e-6);
  // Moments: m = 0.1 g, v = 0.05 g^2.
  auto state = opt->State();
  ASSERT_EQ(state.size(), 4u);
  std::map<std::string, Tensor> named(state.begin(), state.end());
  ASSERT_TRUE(named.count("exp_avg.w") && named.count("exp_avg_sq.w") && named.count("exp_avg.b") &&
              named.count("exp_avg_sq.b"));
  EXPECT_NEAR(named["exp_avg.w"].data<float>()[1], -0.02, 1e-7);
  EXPECT_NEAR(named["exp_avg_sq.w"].data<float>()[2], 0.05 * 0.09, 1e-8);
  // Grads are not zeroed by the step.
  EXPECT_EQ(w.grad.ToVector(), (std::vector<float>{0.1f, -0.2f, 0.3f}));
}

TEST(AdamWTest, SeveralStepsMatchReference) {
  Parameter w = MakeParam("w", {1.0f, -2.0f, 0.5f}, {0, 0, 0}, true);
  Parameter b = MakeParam("b", {0.3f, 0.0f, -0.7f}, {0, 0, 0}, false);
  OptimizerConfig c;
  c.beta1 = 0.8f;
  c.beta2 = 0.9f;
  c.weight_decay = 0.5f;
  auto opt = Optimizer::Create(c, {&w, &b});
  RefAdam rw{{1, -2, 0.5}, {0, 0, 0}, {0, 0, 0}};
  RefAdam rb{{0.3, 0, -0.7}, {0, 0, 0}, {0, 0, 0}};
  std::vector<std::vector<float>> grads = {
      {0.1f, -0.2f, 0.3f}, {-0.5f, 0.05f, 0.3f}, {0.2f, 0.2f, -1.0f}, {0.0f, 1.0f, 0.01f}};
  for (size_t s = 0; s < grads.size(); ++s) {
    SetGrad(w, grads[s]);
    SetGrad(b, grads[s]);
    float lr = 0.05f * (s + 1);
    ASSERT_TRUE(opt->Step(lr).ok());
    rw.Step(grads[s], lr, c.beta1, c.beta2, c.eps, c.weight_decay);
    rb.Step(grads[s], lr, c.beta1, c.beta2, c.eps, 0.0);
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(w.value.data<float>()[i], rw.p[i], 2e-6) << "step " << s << " w[" << i << "]";
      EXPECT_NEAR(b.value.data<float>()[i], rb.p[i], 2e-6) << "step " << s << " b[" << i << "]";
    }
  }
  EXPECT_EQ(opt->step_count(), 4);
}

TEST(SgdTest, MomentumTwoStepsHandValues) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.momentum = 0.9f;
  c.weight_decay = 0.1f;
  Parameter p = MakeParam("p", {1.0f, -2.0f}, {0.5f, 0.5f}, false);
  Parameter q = MakeParam("q", {2.0f}, {0.5f}, true);
  auto opt = Optimizer::Create(c, {&p, &q});
  ASSERT_TRUE(opt->Step(0.1f).ok());
  // p: buf = 0.5 -> 1 - 0.05, -2 - 0.05.  q: d = 0.5 + 0.1*2 = 0.7 -> 2 - 0.07.
  EXPECT_NEAR(p.value.data<float>()[0], 0.95, 1e-6);
  EXPECT_NEAR(p.value.data<float>()[1], -2.05, 1e-6);
  EXPECT_NEAR(q.value.data<float>()[0], 1.93, 1e-6);
  ASSERT_TRUE(opt->Step(0.1f).ok());
  // p: buf = 0.45 + 0.5 = 0.95 -> 0.95 - 0.095 = 0.855; -2.05 - 0.095 = -2.145.
  // q: d = 0.5 + 0.193 = 0.693, buf = 0.63 + 0.693 = 1.323 -> 1.93 - 0.1323 = 1.7977.
  EXPECT_NEAR(p.value.data<float>()[0], 0.855, 1e-6);
  EXPECT_NEAR(p.value.data<float>()[1], -2.145, 1e-6);
  EXPECT_NEAR(q.value.data<float>()[0], 1.7977, 1e-6);
  auto state = opt->State();
  ASSERT_EQ(state.size(), 2u);
  EXPECT_EQ(state[0].first, "momentum_buffer.p");
  EXPECT_EQ(state[1].first, "momentum_buffer.q");
  EXPECT_NEAR(state[0].second.data<float>()[0], 0.95, 1e-6);
  EXPECT_NEAR(state[1].second.data<float>()[0], 1.323, 1e-6);
}

TEST(OptimizerTest, ParseKinds) {
  EXPECT_EQ(*ParseOptimizerKind("adamw"), OptimizerKind::kAdamW);
  EXPECT_EQ(*ParseOptimizerKind("sgd"), OptimizerKind::kSgd);
  EXPECT_FALSE(ParseOptimizerKind("adam").ok());
  EXPECT_EQ(*ParseLrScaling("none"), LrScaling::kNone);
  EXPECT_EQ(*ParseLrScaling("linear"), LrScaling::kLinear);
  EXPECT_EQ(*ParseLrScaling("sqrt"), LrScaling::kSqrt);
  EXPECT_FALSE(ParseLrScaling("cubic").ok());
}

TEST(LrScheduleTest, LinearWarmup) {
  LrSchedule s{.peak = 1e-2f, .warmup_steps = 4, .total_steps = 20, .min_ratio = 0.1f};
  EXPECT_FLOAT_EQ(s.At(0), 1e-2f / 4);
  EXPECT_FLOAT_EQ(s.At(1), 2e-2f / 4);
  EXPECT_FLOAT_EQ(s.At(2), 3e-2f / 4);
  EXPECT_FLOAT_EQ(s.At(3), 1e-2f);
  // Equal increments.
  EXPECT_NEAR(s.At(2) - s.At(1), s.At(1) - s.At(0), 1e-9);
}

TEST(LrScheduleTest, CosineDecayToMinimum) {
  LrSchedule s{.peak = 1.0f, .warmup_steps = 4, .total_steps = 20, .min_ratio = 0.1f};
  EXPECT_FLOAT_EQ(s.At(4), 1.0f);
  EXPECT_NEAR(s.At(12), 0.1 + 0.9 * 0.5, 1e-6);  // halfway through the decay: cos = 0
  EXPECT_NEAR(s.At(20), 0.1f, 1e-7);
  EXPECT_NEAR(s.At(1000), 0.1f, 1e-7);  // stays at the floor
  for (int64_t t = 4; t < 30; ++t) {
    EXPECT_LE(s.At(t + 1), s.At(t)) << t;
    EXPECT_GE(s.At(t), 0.1f - 1e-7f);
  }
  EXPECT_LT(s.At(19), s.At(5));
  LrSchedule no_warmup{.peak = 2.0f, .warmup_steps = 0, .total_steps = 10, .min_ratio = 0.0f};
  EXPECT_FLOAT_EQ(no_warmup.At(0), 2.0f);
  EXPECT_NEAR(no_warmup.At(10), 0.0f, 1e-7);
}

TEST(LrScalingTest, LinearRule) {
  EXPECT_FLOAT_EQ(ScaleLearningRate(1e-3f, 64, 32, LrScaling::kLinear), 2e-3f);
  EXPECT_FLOAT_EQ(ScaleLearningRate(1e-3f, 16, 32, LrScaling::kLinear), 5e-4f);
  EXPECT_FLOAT_EQ(ScaleLearningRate(1e-3f, 64, 32, LrScaling::kNone), 1e-3f);
  EXPECT_FLOAT_EQ(ScaleLearningRate(1e-3f, 32, 32, LrScaling::kLinear), 1e-3f);
}

TEST(LrScalingTest, SquareRootRule) {
  EXPECT_FLOAT_EQ(ScaleLearningRate(1e-3f, 128, 32, LrScaling::kSqrt), 2e-3f);
  EXPECT_FLOAT_EQ(ScaleLearningRate(1e-3f, 8, 32, LrScaling::kSqrt), 5e-4f);
  EXPECT_FLOAT_EQ(ScaleLearningRate(1e-3f, 64, 32, LrScaling::kSqrt), 1e-3f * std::sqrt(2.0f));
  EXPECT_FLOAT_EQ(ScaleLearningRate(1e-3f, 32, 32, LrScaling::kSqrt), 1e-3f);
}

TEST(ClipTest, ClipScaleAndGradHelpers) {
  EXPECT_FLOAT_EQ(ClipScale(0.5, 1.0f), 1.0f);
  EXPECT_FLOAT_EQ(ClipScale(1.0, 1.0f), 1.0f);
  EXPECT_NEAR(ClipScale(4.0, 1.0f), 0.25f, 1e-6);
  EXPECT_NEAR(ClipScale(10.0, 2.0f), 0.2f, 1e-6);
  EXPECT_FLOAT_EQ(ClipScale(100.0, 0.0f), 1.0f);  // disabled
  EXPECT_FLOAT_EQ(ClipScale(100.0, -1.0f), 1.0f);

  Parameter a = MakeParam("a", {0, 0}, {3.0f, 0.0f}, true);
  Parameter b = MakeParam("b", {0}, {4.0f}, true);
  std::vector<Parameter*> ps = {&a, &b};
  EXPECT_DOUBLE_EQ(*GradSquaredNorm(ps), 25.0);
  ASSERT_TRUE(ScaleGrads(ps, ClipScale(std::sqrt(*GradSquaredNorm(ps)), 1.0f)).ok());
  EXPECT_NEAR(std::sqrt(*GradSquaredNorm(ps)), 1.0, 1e-5);
  EXPECT_NEAR(a.grad.data<float>()[0], 0.6f, 1e-5);
  EXPECT_TRUE(GradsFinite(ps));
  b.grad.data<float>()[0] = std::nanf("");
  EXPECT_FALSE(GradsFinite(ps));
  b.grad.data<float>()[0] = INFINITY;
  EXPECT_FALSE(GradsFinite(ps));
  ZeroGrads(ps);
  EXPECT_EQ(*GradSquaredNorm(ps), 0.0);
  EXPECT_TRUE(GradsFinite(ps));
}

std::map<std::string, Tensor> CloneState(const Optimizer& opt) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : opt.State()) out[name] = t.Clone();
  return out;
}

void ExpectStateEq(const std::map<std::string, Tensor>& a, const std::map<std::string, Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_EQ(t.ToVector(), b.at(name).ToVector()) << name;
  }
}

TEST(OptimizerStateTest, RoundTripResumesIdentically) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
    SCOPED_TRACE(static_cast<int>(kind));
    OptimizerConfig c;
    c.kind = kind;
    Parameter w1 = MakeParam("w", {1, 2, 3}, {0.1f, -0.3f, 0.2f}, true);
    Parameter w2 = MakeParam("w", {1, 2, 3}, {0.1f, -0.3f, 0.2f}, true);
    auto a = Optimizer::Create(c, {&w1});
    ASSERT_TRUE(a->Step(0.1f).ok());
    ASSERT_TRUE(a->Step(0.1f).ok());
    // Restore into a fresh optimizer over a copy of the weights.
    for (int i = 0; i < 3; ++i) w2.value.data<float>()[i] = w1.value.data<float>()[i];
    auto b = Optimizer::Create(c, {&w2});
    ASSERT_TRUE(b->LoadState(CloneState(*a), a->step_count()).ok());
    EXPECT_EQ(b->step_count(), 2);
    ExpectStateEq(CloneState(*a), CloneState(*b));
    ASSERT_TRUE(a->Step(0.05f).ok());
    ASSERT_TRUE(b->Step(0.05f).ok());
    EXPECT_EQ(w1.value.ToVector(), w2.value.ToVector());
  }
}

TEST(OptimizerStateTest, LoadStateErrorsLeaveStateUnchanged) {
  OptimizerConfig c;
  Parameter w = MakeParam("w", {1, 2, 3}, {0.1f, -0.3f, 0.2f}, true);
  Parameter b = MakeParam("b", {1}, {0.5f}, false);
  auto opt = Optimizer::Create(c, {&w, &b});
  ASSERT_TRUE(opt->Step(0.1f).ok());
  const auto before = CloneState(*opt);

  // A complete state with different values, then broken in two ways.
  std::map<std::string, Tensor> good;
  for (auto& [name, t] : before) {
    Tensor u = t.Clone();
    u.Fill(9.0f);
    good[name] = u;
  }
  auto missing = good;
  missing.erase("exp_avg_sq.b");  // the last one checked: earlier ones must not be applied
  absl::Status s1 = opt->LoadState(missing, 7);
  EXPECT_EQ(s1.code(), absl::StatusCode::kNotFound) << s1;
  EXPECT_EQ(opt->step_count(), 1);
  ExpectStateEq(before, CloneState(*opt));

  auto misshapen = good;
  misshapen["exp_avg_sq.b"] = Tensor::Zeros({2});
  absl::Status s2 = opt->LoadState(misshapen, 7);
  EXPECT_EQ(s2.code(), absl::StatusCode::kInvalidArgument) << s2;
  EXPECT_EQ(opt->step_count(), 1);
  ExpectStateEq(before, CloneState(*opt));

  auto wrong_dtype = good;
  wrong_dtype["exp_avg.w"] = Tensor::Zeros({3}, DType::kI32);
  EXPECT_FALSE(opt->LoadState(wrong_dtype, 7).ok());
  ExpectStateEq(before, CloneState(*opt));

  ASSERT_TRUE(opt->LoadState(good, 7).ok());
  EXPECT_EQ(opt->step_count(), 7);
  for (auto& [name, t] : CloneState(*opt)) {
    for (float v : t.ToVector()) EXPECT_EQ(v, 9.0f) << name;
  }
}

}  // namespace
}  // namespace pipewright
