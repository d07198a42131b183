// A custom layer defined outside the library through the public headers only
// (tests/install/residual_linear.h: pipewright/layer.h, ops.h, init.h), checked as a user would
// check theirs: forward against a double-precision reference, backward against central finite
// differences of that reference, += weight gradients, mixed precision, and initialisation that
// does not depend on which stage range instantiates it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "pipewright/layer.h"
#include "pipewright/model.h"
#include "pipewright/tensor.h"
#include "tests/install/residual_linear.h"
#include "tests/runtime/layer_test_util.h"

namespace pipewright {
namespace {

using testing_util::ParamValues;
using testing_util::RandomTensor;

using residual_example::MakeResidualLinear;

constexpr int64_t kB = 2, kT = 4, kD = 8;
constexpr float kScale = 0.75f;

std::unique_ptr<Layer> Make(const std::string& name, uint64_t seed = 3, int index = 0) {
  auto r = MakeResidualLinear(kD, kScale)->Create(InitContext{seed, index, name, 1, nullptr});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

std::vector<double> ToDouble(const Tensor& t) {
  std::vector<float> v = t.ToVector();
  return {v.begin(), v.end()};
}

// The layer's math in double: y = x + scale x W^T + b, and the objective sum(y * probe).
struct Reference {
  std::vector<double> x, w, b, probe;

  std::vector<double> Forward() const {
    const int64_t rows = static_cast<int64_t>(x.size()) / kD;
    std::vector<double> y(x.size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < kD; ++o) {
        double dot = 0;
        for (int64_t i = 0; i < kD; ++i) dot += x[r * kD + i] * w[o * kD + i];
        y[r * kD + o] = x[r * kD + o] + kScale * dot + b[o];
      }
    }
    return y;
  }
  double Objective() const {
    std::vector<double> y = Forward();
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * probe[i];
    return s;
  }
  // Central difference of the objective with respect to (this->*input)[i].
  double Numeric(std::vector<double> Reference::*input, size_t i) const {
    Reference r = *this;
    const double h = 1e-4;
    (r.*input)[i] = (this->*input)[i] + h;
    const double plus = r.Objective();
    (r.*input)[i] = (this->*input)[i] - h;
    return (plus - r.Objective()) / (2 * h);
  }
};

// A layer with random parameters of a useful magnitude (the init has b = 0), its input and an
// output-gradient probe, and the same numbers in double.
struct Fixture {
  std::unique_ptr<Layer> layer = Make("res");
  Tensor x, probe;
  Reference ref;

  explicit Fixture(uint32_t seed) {
    std::mt19937 rng(seed);
    for (Parameter* p : layer->Parameters()) p->value = RandomTensor(p->value.shape(), rng);
    x = RandomTensor({kB, kT, kD}, rng);
    probe = RandomTensor({kB, kT, kD}, rng);
    ref = {ToDouble(x), ToDouble(layer->Parameters()[0]->value),
           ToDouble(layer->Parameters()[1]->value), ToDouble(probe)};
  }
};

void ExpectClose(const std::vector<double>& expected, const Tensor& actual, double tol,
                 const std::string& what) {
  std::vector<float> a = actual.ToVector();
  ASSERT_EQ(a.size(), expected.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], expected[i], tol * std::max(1.0, std::fabs(expected[i])))
        << what << "[" << i << "]";
  }
}

TEST(CustomLayerTest, ForwardMatchesDoubleReference) {
  Fixture f(1);
  Saved saved;
  auto y = f.layer->Forward(f.x, {}, &saved);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->shape(), f.x.shape());
  ExpectClose(f.ref.Forward(), *y, 1e-5, "y");
}

TEST(CustomLayerTest, BackwardMatchesFiniteDifferences) {
  Fixture f(2);
  Saved saved;
  ASSERT_TRUE(f.layer->Forward(f.x, {}, &saved).ok());
  auto dx = f.layer->BackwardInput(f.probe, {}, &saved);
  ASSERT_TRUE(dx.ok()) << dx.status();
  ASSERT_TRUE(f.layer->BackwardWeight({}, &saved).ok());
  EXPECT_TRUE(saved.empty()) << "BackwardWeight must free the saved record";

  // Every element of the input and of both parameters.
  const std::vector<std::pair<std::vector<double> Reference::*, const Tensor*>> checks = {
      {&Reference::x, &*dx},
      {&Reference::w, &f.layer->Parameters()[0]->grad},
      {&Reference::b, &f.layer->Parameters()[1]->grad}};
  for (const auto& [input, analytic] : checks) {
    std::vector<double> numeric((f.ref.*input).size());
    for (size_t i = 0; i < numeric.size(); ++i) numeric[i] = f.ref.Numeric(input, i);
    ExpectClose(numeric, *analytic, 1e-4, analytic == &*dx ? "dx" : "parameter gradient");
  }
}

TEST(CustomLayerTest, WeightGradientsAccumulateAndSplitEqualsBackward) {
  Fixture f(3), g(3);
  Saved s;
  ASSERT_TRUE(f.layer->Forward(f.x, {}, &s).ok());
  auto once = f.layer->Backward(f.probe, {}, &s);
  ASSERT_TRUE(once.ok()) << once.status();
  std::vector<std::vector<float>> first;
  for (Parameter* p : f.layer->Parameters()) first.push_back(p->grad.ToVector());
  ASSERT_TRUE(f.layer->Forward(f.x, {}, &s).ok());
  ASSERT_TRUE(f.layer->Backward(f.probe, {}, &s).ok());

  // The split passes give Backward's results; a second micro-batch adds to the gradients.
  Saved t;
  ASSERT_TRUE(g.layer->Forward(g.x, {}, &t).ok());
  auto dx = g.layer->BackwardInput(g.probe, {}, &t);
  ASSERT_TRUE(dx.ok() && g.layer->BackwardWeight({}, &t).ok());
  EXPECT_EQ(dx->ToVector(), once->ToVector());
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(g.layer->Parameters()[i]->grad.ToVector(), first[i]);
    std::vector<float> twice = f.layer->Parameters()[i]->grad.ToVector();
    for (size_t k = 0; k < twice.size(); ++k) {
      EXPECT_NEAR(twice[k], 2 * first[i][k], 1e-6f * std::max(1.0f, std::fabs(twice[k])));
    }
  }
}

TEST(CustomLayerTest, MixedPrecisionRoundsTheProducts) {
  Fixture f(4);
  LayerContext bf16;
  bf16.compute_dtype = DType::kBF16;
  Saved s;
  auto y = f.layer->Forward(f.x, bf16, &s);
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_EQ(s.tensors.size(), 1u);
  EXPECT_EQ(s.tensors[0].dtype(), DType::kBF16) << "the 16-bit input is what is saved";
  EXPECT_EQ(y->dtype(), DType::kF32);
  ExpectClose(f.ref.Forward(), *y, 3e-2, "bf16 y");
  auto dx = f.layer->Backward(f.probe, bf16, &s);
  ASSERT_TRUE(dx.ok()) << dx.status();
  std::vector<double> numeric(f.ref.x.size());
  for (size_t i = 0; i < numeric.size(); ++i) numeric[i] = f.ref.Numeric(&Reference::x, i);
  ExpectClose(numeric, *dx, 3e-2, "bf16 dx");
}

TEST(CustomLayerTest, RejectsBadInputsAndOrder) {
  auto layer = Make("res");
  Saved s;
  auto wrong = layer->Forward(Tensor::Zeros({kB, kD + 1}), {}, &s);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(layer->BackwardInput(Tensor::Zeros({kB, kD}), {}, &s).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(layer->Forward(Tensor::Zeros({kB, kD}), {}, &s).ok());
  EXPECT_EQ(layer->BackwardWeight({}, &s).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(layer->BackwardInput(Tensor::Zeros({kB + 1, kD}), {}, &s).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- initialisation ----

absl::StatusOr<LayerGraph> CustomModel() {
  ModelBuilder b("custom", {.batch = kB, .seq_len = kT});
  b.Add("in", layers::Linear(kD, kD));
  b.Add("res.0", MakeResidualLinear(kD, kScale));
  b.Add("act", layers::Gelu());
  b.Add("res.1", MakeResidualLinear(kD, kScale));
  b.Add("norm", layers::LayerNorm(kD));
  b.Add("res.2", MakeResidualLinear(kD, kScale));
  return b.Build();
}

TEST(CustomLayerInitTest, IdenticalWhicheverStageRangeInstantiatesIt) {
  auto graph = CustomModel();
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto all = testing_util::ExpectSameParamsOnEveryStageRange(*graph, 42);
  ASSERT_TRUE(all.count("res.1.weight") && all.count("res.1.bias"));
  // Different nodes and different seeds get different weights.
  EXPECT_NE(all["res.0.weight"], all["res.1.weight"]);
  auto other = graph->Instantiate(0, graph->num_layers(), 43);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(ParamValues(**other)["res.1.weight"], all["res.1.weight"]);
}

TEST(CustomLayerInitTest, KeyedBySeedAndNameNotIndex) {
  // The same (seed, name) at another global index gives the same weights.
  auto a = Make("res.1", 9, 3), b = Make("res.1", 9, 17), c = Make("res.2", 9, 3);
  const std::vector<float> w = a->Parameters()[0]->value.ToVector();
  EXPECT_EQ(w, b->Parameters()[0]->value.ToVector());
  EXPECT_NE(w, c->Parameters()[0]->value.ToVector());
  EXPECT_EQ(a->Parameters()[0]->name, "res.1.weight");
  EXPECT_EQ(a->Parameters()[1]->name, "res.1.bias");
  // W ~ U(-1/sqrt(d), 1/sqrt(d)): inside the bound, spread like a uniform; b = 0.
  const double bound = 1.0 / std::sqrt(static_cast<double>(kD));
  double ss = 0;
  for (float v : w) {
    EXPECT_LE(std::fabs(v), bound);
    ss += static_cast<double>(v) * v;
  }
  EXPECT_NEAR(std::sqrt(ss / w.size()), bound / std::sqrt(3.0), 0.3 * bound);
  EXPECT_EQ(a->Parameters()[1]->value.ToVector(), std::vector<float>(kD, 0.0f));
}

TEST(CustomLayerInitTest, SplitStagesMatchTheWholeModel) {
  auto graph = CustomModel();
  ASSERT_TRUE(graph.ok()) << graph.status();
  const int n = graph->num_layers();
  std::mt19937 rng(5);
  Tensor x = RandomTensor({kB, kT, kD}, rng);
  auto whole = graph->Instantiate(0, n, 7);
  ASSERT_TRUE(whole.ok());
  std::vector<Saved> saved;
  auto expected = (*whole)->Forward(x, {}, &saved);
  ASSERT_TRUE(expected.ok()) << expected.status();
  for (int cut = 1; cut < n; ++cut) {
    auto first = graph->Instantiate(0, cut, 7), second = graph->Instantiate(cut, n, 7);
    ASSERT_TRUE(first.ok() && second.ok());
    std::vector<Saved> s1, s2;
    auto h = (*first)->Forward(x, {}, &s1);
    ASSERT_TRUE(h.ok()) << h.status();
    auto y = (*second)->Forward(*h, {}, &s2);
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ(y->ToVector(), expected->ToVector()) << "cut at " << cut;
  }
}

}  // namespace
}  // namespace pipewright
