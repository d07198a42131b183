// Finite-difference gradient checks and behavioural tests for every built-in layer.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "pipewright/layer.h"
#include "pipewright/model.h"
#include "pipewright/ops.h"
#include "pipewright/tensor.h"
#include "tests/runtime/layer_test_util.h"

namespace pipewright {
namespace {

using testing_util::ParamValues;
using testing_util::RandomTensor;

constexpr int64_t kB = 2, kT = 4, kC = 8, kH = 2, kV = 11;

std::unique_ptr<Layer> Make(const LayerSpecPtr& spec, const std::string& name, uint64_t seed = 3,
                            int index = 0, int num_blocks = 2) {
  auto r = spec->Create(InitContext{seed, index, name, num_blocks, nullptr});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

Tensor RandomTokens(int64_t B, int64_t T, int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(vocab - 1));
  Tensor t = Tensor::Empty({B, T}, DType::kI32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = d(rng);
  return t;
}

// Replaces every parameter with random values of a useful magnitude, so that no gradient is
// tiny by construction (the default init has std 0.02 and LayerNorm starts at gamma=1, beta=0,
// which would let a wrong gradient pass the absolute tolerance).
void RandomizeParameters(Layer& layer, std::mt19937& rng, float std = 0.5f) {
  std::normal_distribution<float> d(0.0f, std);
  for (Parameter* p : layer.Parameters()) {
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] = d(rng);
  }
}

struct Case {
  Case(std::string l, LayerSpecPtr s, Tensor in, Tensor t = Tensor())
      : label(std::move(l)), spec(std::move(s)), x(std::move(in)), targets(std::move(t)) {}
  std::string label;
  LayerSpecPtr spec;
  Tensor x;        // f32 activations or i32 tokens
  Tensor targets;  // for the loss layer
  bool is_loss = false;
  bool input_grad = true;  // false for token inputs
};

// Scalar objective: sum(y * R) in double, or the loss itself.
double Objective(Layer& layer, const Case& c, const Tensor& probe) {
  LayerContext ctx;
  ctx.targets = c.targets.defined() ? &c.targets : nullptr;
  Saved saved;
  auto y = layer.Forward(c.x, ctx, &saved);
  EXPECT_TRUE(y.ok()) << y.status();
  if (!y.ok()) return 0;
  if (c.is_loss) return y->data<float>()[0];
  double s = 0;
  for (int64_t i = 0; i < y->numel(); ++i) {
    s += static_cast<double>(y->data<float>()[i]) * probe.data<float>()[i];
  }
  return s;
}

std::vector<int64_t> SampleIndices(int64_t n, std::mt19937& rng, int count = 20) {
  std::vector<int64_t> idx;
  if (n <= count) {
    for (int64_t i = 0; i < n; ++i) idx.push_back(i);
    return idx;
  }
  std::uniform_int_distribution<int64_t> d(0, n - 1);
  for (int i = 0; i < count; ++i) idx.push_back(d(rng));
  return idx;
}

// Central difference of the objective w.r.t. element i of `t` (perturbed in place).
double Numeric(Layer& layer, const Case& c, const Tensor& probe, Tensor& t, int64_t i) {
  float* v = t.data<float>() + i;
  const float orig = *v;
  const float h = 1e-2f * std::max(1.0f, std::fabs(orig));
  *v = orig + h;
  const float hp = *v - orig;  // the step actually taken in f32
  double lp = Objective(layer, c, probe);
  *v = orig - h;
  const float hm = orig - *v;
  double lm = Objective(layer, c, probe);
  *v = orig;
  return (lp - lm) / (static_cast<double>(hp) + hm);
}

bool Close(double a, double n) {
  return std::fabs(a - n) <= 2e-2 * std::max({1.0, std::fabs(a), std::fabs(n)});
}

void CheckGradients(Case c) {
  SCOPED_TRACE(c.label);
  std::mt19937 rng(1234);
  auto layer = Make(c.spec, "layer");
  ASSERT_NE(layer, nullptr);
  RandomizeParameters(*layer, rng);

  LayerContext ctx;
  ctx.targets = c.targets.defined() ? &c.targets : nullptr;
  Saved saved;
  auto y = layer->Forward(c.x, ctx, &saved);
  ASSERT_TRUE(y.ok()) << y.status();
  Tensor probe;
  if (c.is_loss) {
    ASSERT_EQ(y->numel(), 1);
    probe = Tensor::FromVector({1}, {1.0f});
  } else {
    probe = RandomTensor(y->shape(), rng);
  }
  for (Parameter* p : layer->Parameters()) {
    for (float g : p->grad.ToVector()) ASSERT_EQ(g, 0.0f) << p->name << ": grads must start at 0";
  }
  auto dx = layer->BackwardInput(probe, ctx, &saved);
  ASSERT_TRUE(dx.ok()) << dx.status();
  ASSERT_TRUE(layer->BackwardWeight(ctx, &saved).ok());
  EXPECT_TRUE(saved.empty()) << "BackwardWeight must free the saved activations";

  int checked = 0;
  double max_abs_numeric = 0;
  if (c.input_grad) {
    ASSERT_TRUE(dx->defined());
    ASSERT_EQ(dx->shape(), c.x.shape());
    Tensor dx_copy = dx->Clone();
    for (int64_t i : SampleIndices(c.x.numel(), rng)) {
      double a = dx_copy.data<float>()[i];
      double n = Numeric(*layer, c, probe, c.x, i);
      EXPECT_TRUE(Close(a, n)) << "input[" << i << "]: analytic " << a << " numeric " << n;
      max_abs_numeric = std::max(max_abs_numeric, std::fabs(n));
      ++checked;
    }
  } else {
    EXPECT_FALSE(dx->defined());
  }
  for (Parameter* p : layer->Parameters()) {
    ASSERT_EQ(p->grad.shape(), p->value.shape()) << p->name;
    Tensor g = p->grad.Clone();
    double max_param_numeric = 0;
    for (int64_t i : SampleIndices(p->value.numel(), rng)) {
      double a = g.data<float>()[i];
      double n = Numeric(*layer, c, probe, p->value, i);
      EXPECT_TRUE(Close(a, n)) << p->name << "[" << i << "]: analytic " << a << " numeric " << n;
      max_param_numeric = std::max(max_param_numeric, std::fabs(n));
      ++checked;
    }
    // The check is only meaningful when gradients are not negligible.
    EXPECT_GT(max_param_numeric, 1e-2) << p->name << " has a vanishing gradient";
  }
  if (c.input_grad) {
    EXPECT_GT(max_abs_numeric, 1e-2) << "input gradient vanishes";
  }
  EXPECT_GT(checked, 0);
}

Tensor Act(std::mt19937& rng, int64_t last = kC) { return RandomTensor({kB, kT, last}, rng); }

TEST(LayerGradTest, LinearWithBias) {
  std::mt19937 rng(1);
  CheckGradients({"linear", layers::Linear(kC, 6, true), Act(rng)});
}

TEST(LayerGradTest, LinearWithoutBias) {
  std::mt19937 rng(2);
  auto spec = layers::Linear(kC, 6, false);
  auto layer = Make(spec, "fc");
  ASSERT_EQ(layer->Parameters().size(), 1u);
  CheckGradients({"linear-nobias", spec, Act(rng)});
}

TEST(LayerGradTest, Gelu) {
  std::mt19937 rng(3);
  CheckGradients({"gelu", layers::Gelu(), Act(rng)});
}

TEST(LayerGradTest, LayerNorm) {
  std::mt19937 rng(4);
  CheckGradients({"layernorm", layers::LayerNorm(kC), Act(rng)});
}

TEST(LayerGradTest, Mlp) {
  std::mt19937 rng(5);
  CheckGradients({"mlp", layers::Mlp(kC, 16), Act(rng)});
}

TEST(LayerGradTest, CausalSelfAttention) {
  std::mt19937 rng(6);
  CheckGradients({"attention", layers::CausalSelfAttention(kC, kH), Act(rng)});
}

TEST(LayerGradTest, TransformerBlock) {
  std::mt19937 rng(7);
  CheckGradients({"block", layers::TransformerBlock(kC, kH), Act(rng)});
}

// The Llama family (Note [Llama layers] in runtime/ops/llama_ops.cc).
TEST(LayerGradTest, RmsNorm) {
  std::mt19937 rng(31);
  CheckGradients({"rmsnorm", layers::RmsNorm(kC), Act(rng)});
}

TEST(LayerGradTest, LlamaBlockGroupedQueryAttention) {
  std::mt19937 rng(32);
  // 4 query heads of dim 2 over 2 kv heads; then multi-query (1 kv head) and plain (4).
  CheckGradients({"llama gqa", layers::LlamaBlock(kC, 4, 2, 12, 10000.0), Act(rng)});
  CheckGradients({"llama mqa", layers::LlamaBlock(kC, 4, 1, 12, 500000.0), Act(rng)});
  CheckGradients({"llama mha", layers::LlamaBlock(kC, 2, 2, 12, 100.0), Act(rng)});
}

TEST(LayerGradTest, TokenEmbeddingWeightsOnly) {
  std::mt19937 rng(33);
  Case c{"token embedding", layers::TokenEmbedding(kV, kC), RandomTokens(kB, kT, kV, rng)};
  c.input_grad = false;
  CheckGradients(c);
}

// transformers' rotary convention: the pair (i, i + D/2) of a head at position t turns by
// t * theta^(-2i/D); position 0 is unchanged; the inverse turn undoes it.
TEST(LayerTest, RopeTurnsPairsByThePositionsAngle) {
  const int64_t T = 5, D = 8, heads = 2, ld = 2 * D + 3;
  std::mt19937 rng(34);
  Tensor x = RandomTensor({T, ld}, rng);
  const std::vector<float> before = x.ToVector();
  const double theta = 10000;
  ASSERT_TRUE(ops::Rope(ops::Exec{}, x, T, T, ld, 3, heads, D, theta, false).ok());
  const std::vector<float> after = x.ToVector();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(after[t * ld + c], before[t * ld + c]) << "untouched";
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < D / 2; ++i) {
        const int64_t at = t * ld + 3 + h * D + i;
        const double angle = t * std::pow(theta, -2.0 * i / D);
        const double a = before[at], b = before[at + D / 2];
        EXPECT_NEAR(after[at], a * std::cos(angle) - b * std::sin(angle), 1e-5);
        EXPECT_NEAR(after[at + D / 2], b * std::cos(angle) + a * std::sin(angle), 1e-5);
        if (t == 0) EXPECT_EQ(after[at], before[at]);
      }
    }
  }
  ASSERT_TRUE(ops::Rope(ops::Exec{}, x, T, T, ld, 3, heads, D, theta, true).ok());
  const std::vector<float> back = x.ToVector();
  for (size_t k = 0; k < back.size(); ++k) EXPECT_NEAR(back[k], before[k], 1e-5) << k;
  EXPECT_FALSE(ops::Rope(ops::Exec{}, x, T, T, ld, 3, heads, 7, theta, false).ok()) << "odd D";
  // Rows of later positions alone (`first`, as incremental decoding turns them): the bits of
  // those rows in the whole sequence's turn.
  const int64_t first = 3, n = T - first;
  Tensor later = Tensor::Empty({n, ld});
  std::copy(before.begin() + first * ld, before.end(), later.data<float>());
  ASSERT_TRUE(ops::Rope(ops::Exec{}, later, n, n, ld, 3, heads, D, theta, false, first).ok());
  EXPECT_EQ(later.ToVector(), std::vector<float>(after.begin() + first * ld, after.end()));
  EXPECT_FALSE(ops::Rope(ops::Exec{}, later, n, n, ld, 3, heads, D, theta, false, -1).ok());
}

// ExpandKv and ReduceKv are each other's transpose: <Expand(x), y> = <x, Reduce(y)>.
TEST(LayerTest, ExpandAndReduceKvAreTransposes) {
  const int64_t rows = 3, heads = 6, kv = 2, D = 4, C = heads * D, K = kv * D;
  std::mt19937 rng(35);
  const Tensor x = RandomTensor({rows, C + 2 * K}, rng);
  const Tensor y = RandomTensor({rows, 3 * C}, rng);
  Tensor ex = Tensor::Empty({rows, 3 * C}), ry = Tensor::Empty({rows, C + 2 * K});
  ASSERT_TRUE(ops::ExpandKv(ops::Exec{}, x, ex, rows, heads, kv, D).ok());
  ASSERT_TRUE(ops::ReduceKv(ops::Exec{}, y, ry, rows, heads, kv, D).ok());
  double a = 0, b = 0;
  const std::vector<float> ev = ex.ToVector(), yv = y.ToVector(), xv = x.ToVector(),
                           rv = ry.ToVector();
  for (size_t k = 0; k < ev.size(); ++k) a += static_cast<double>(ev[k]) * yv[k];
  for (size_t k = 0; k < xv.size(); ++k) b += static_cast<double>(xv[k]) * rv[k];
  EXPECT_NEAR(a, b, 1e-4 * std::max(1.0, std::fabs(a)));
  // Query head 4 reads kv head 4 / (6 / 2) = 1.
  EXPECT_EQ(ev[C + 4 * D], xv[C + 1 * D]);
  EXPECT_FALSE(ops::ExpandKv(ops::Exec{}, x, ex, rows, heads, 4, D).ok()) << "6 % 4 != 0";
  EXPECT_FALSE(ops::ExpandKv(ops::Exec{}, x, ex, rows, heads, 0, D).ok()) << "no kv heads";
  EXPECT_FALSE(ops::ReduceKv(ops::Exec{}, y, ry, rows, heads, 0, D).ok()) << "no kv heads";
}

TEST(LayerGradTest, EmbeddingWeightsOnly) {
  std::mt19937 rng(8);
  Case c{"embedding", layers::Embedding(kV, kT, kC), RandomTokens(kB, kT, kV, rng)};
  c.input_grad = false;
  CheckGradients(c);
}

TEST(LayerGradTest, LmHead) {
  std::mt19937 rng(9);
  CheckGradients({"lm_head", layers::LmHead(kC, kV), Act(rng)});
}

TEST(LayerGradTest, CrossEntropyLoss) {
  std::mt19937 rng(10);
  Case c{"loss", layers::CrossEntropyLoss(), RandomTensor({kB, kT, kV}, rng, 2.0f),
         RandomTokens(kB, kT, kV, rng)};
  c.is_loss = true;
  CheckGradients(c);
}

TEST(LayerTest, CrossEntropyValueMatchesReference) {
  // Two rows, vocab 3: mean of -log softmax at the target.
  Tensor logits = Tensor::FromVector({1, 2, 3}, {1, 2, 3, 0, 0, 0});
  Tensor targets = Tensor::FromVectorI32({1, 2}, {2, 0});
  auto layer = Make(layers::CrossEntropyLoss(), "loss");
  LayerContext ctx;
  ctx.targets = &targets;
  Saved saved;
  auto y = layer->Forward(logits, ctx, &saved);
  ASSERT_TRUE(y.ok()) << y.status();
  double l0 = -3 + std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  double l1 = std::log(3.0);
  EXPECT_NEAR(y->data<float>()[0], (l0 + l1) / 2, 1e-5);
  // dy scales the gradient (the engine passes 1 / micro-batches).
  auto dx = layer->BackwardInput(Tensor::FromVector({1}, {0.5f}), ctx, &saved);
  ASSERT_TRUE(dx.ok()) << dx.status();
  // d/dlogit[1][0] = 0.5 * (1/3 - 1) / 2 rows
  EXPECT_NEAR(dx->data<float>()[3], 0.5 * (1.0 / 3 - 1) / 2, 1e-6);
}

// Every layer with parameters, with a matching input.
struct Built {
  LayerSpecPtr spec;
  Tensor x;
  Tensor targets;
};

std::vector<Built> AllLayers(std::mt19937& rng) {
  std::vector<Built> out;
  out.push_back({layers::Linear(kC, 6, true), Act(rng), {}});
  out.push_back({layers::Linear(kC, 6, false), Act(rng), {}});
  out.push_back({layers::LayerNorm(kC), Act(rng), {}});
  out.push_back({layers::Mlp(kC, 16), Act(rng), {}});
  out.push_back({layers::CausalSelfAttention(kC, kH), Act(rng), {}});
  out.push_back({layers::TransformerBlock(kC, kH), Act(rng), {}});
  out.push_back({layers::Embedding(kV, kT, kC), RandomTokens(kB, kT, kV, rng), {}});
  out.push_back({layers::LmHead(kC, kV), Act(rng), {}});
  out.push_back({layers::RmsNorm(kC), Act(rng), {}});
  out.push_back({layers::LlamaBlock(kC, 4, 2, 12), Act(rng), {}});
  out.push_back({layers::TokenEmbedding(kV, kC), RandomTokens(kB, kT, kV, rng), {}});
  return out;
}

TEST(LayerTest, SplitBackwardEqualsBackward) {
  std::mt19937 rng(20);
  for (Built& b : AllLayers(rng)) {
    SCOPED_TRACE(b.spec->kind());
    auto l1 = Make(b.spec, "n"), l2 = Make(b.spec, "n");
    std::mt19937 r1(5), r2(5);
    RandomizeParameters(*l1, r1);
    RandomizeParameters(*l2, r2);
    LayerContext ctx;
    Saved s1, s2;
    auto y1 = l1->Forward(b.x, ctx, &s1);
    auto y2 = l2->Forward(b.x, ctx, &s2);
    ASSERT_TRUE(y1.ok() && y2.ok());
    Tensor probe = RandomTensor(y1->shape(), rng);
    auto dx1 = l1->BackwardInput(probe, ctx, &s1);
    ASSERT_TRUE(dx1.ok()) << dx1.status();
    ASSERT_TRUE(l1->BackwardWeight(ctx, &s1).ok());
    auto dx2 = l2->Backward(probe, ctx, &s2);
    ASSERT_TRUE(dx2.ok()) << dx2.status();
    ASSERT_EQ(dx1->defined(), dx2->defined());
    if (dx1->defined()) {
      EXPECT_EQ(dx1->ToVector(), dx2->ToVector());
    }
    auto p1 = l1->Parameters(), p2 = l2->Parameters();
    ASSERT_EQ(p1.size(), p2.size());
    ASSERT_FALSE(p1.empty());
    for (size_t i = 0; i < p1.size(); ++i) {
      EXPECT_EQ(p1[i]->name, p2[i]->name);
      EXPECT_EQ(p1[i]->grad.ToVector(), p2[i]->grad.ToVector()) << p1[i]->name;
    }
  }
}

// Note [Gradient groups]: a layer's groups list its parameters in order, and a composite reports
// each group as its gradients are final — the values a reported gradient holds then are those it
// holds after the whole backward — last group first, under Backward and under the split passes.
class RecordingObserver final : public GradientObserver {
 public:
  absl::Status GradientsDone(const std::vector<Parameter*>& params) override {
    for (Parameter* p : params) {
      if (seen.count(p) == 0) {
        seen[p] = p->grad.ToVector();
        order.push_back(p);
      }
    }
    return absl::OkStatus();
  }
  std::map<Parameter*, std::vector<float>> seen;
  std::vector<Parameter*> order;
};

TEST(LayerTest, GradientGroupsAreReportedAsEachIsFinal) {
  std::mt19937 rng(24);
  for (Built& b : AllLayers(rng)) {
    SCOPED_TRACE(b.spec->kind());
    for (bool split : {false, true}) {
      auto layer = Make(b.spec, "n");
      const std::vector<std::vector<Parameter*>> groups = layer->ParameterGroups();
      std::vector<Parameter*> flat;
      for (const auto& g : groups) flat.insert(flat.end(), g.begin(), g.end());
      ASSERT_EQ(flat, layer->Parameters());
      RecordingObserver rec;
      LayerContext ctx;
      ctx.gradients = &rec;
      Saved s;
      auto y = layer->Forward(b.x, ctx, &s);
      ASSERT_TRUE(y.ok()) << y.status();
      const Tensor probe = RandomTensor(y->shape(), rng);
      if (split) {
        ASSERT_TRUE(layer->BackwardInput(probe, ctx, &s).ok());
        EXPECT_TRUE(rec.order.empty()) << "the input gradient adds no weight gradient";
        ASSERT_TRUE(layer->BackwardWeight(ctx, &s).ok());
      } else {
        ASSERT_TRUE(layer->Backward(probe, ctx, &s).ok());
      }
      if (groups.size() == 1) {
        EXPECT_TRUE(rec.order.empty()) << "a leaf is reported by whoever runs it";
        continue;
      }
      // Every parameter reported, with its final gradient, and the groups last first.
      ASSERT_EQ(rec.order.size(), flat.size());
      for (Parameter* p : flat) EXPECT_EQ(rec.seen.at(p), p->grad.ToVector()) << p->name;
      size_t k = 0;
      for (size_t g = groups.size(); g-- > 0;) {
        std::vector<Parameter*> got(rec.order.begin() + k,
                                    rec.order.begin() + k + groups[g].size());
        std::sort(got.begin(), got.end());
        std::vector<Parameter*> want = groups[g];
        std::sort(want.begin(), want.end());
        EXPECT_EQ(got, want) << "group " << g;
        k += groups[g].size();
      }
    }
  }
  // The block's groups: ln_1, qkv, attn.proj, ln_2, fc, mlp.proj; the largest the fc's.
  auto block = Make(layers::TransformerBlock(kC, kH), "b");
  EXPECT_EQ(block->ParameterGroups().size(), 6u);
  const Cost c = layers::TransformerBlock(kC, kH)->GetCost({2, 8}, 0);
  EXPECT_EQ(c.largest_group_params, 4 * kC * kC + 4 * kC);
  EXPECT_EQ(layers::LayerNorm(kC)->GetCost({2, 8}, 0).group_params(), 2 * kC);
}

TEST(LayerTest, WeightGradsAccumulate) {
  std::mt19937 rng(21);
  for (Built& b : AllLayers(rng)) {
    SCOPED_TRACE(b.spec->kind());
    auto layer = Make(b.spec, "n");
    LayerContext ctx;
    Tensor probe;
    std::vector<std::vector<float>> once;
    for (int pass = 0; pass < 2; ++pass) {
      Saved s;
      auto y = layer->Forward(b.x, ctx, &s);
      ASSERT_TRUE(y.ok()) << y.status();
      if (pass == 0) probe = RandomTensor(y->shape(), rng);
      ASSERT_TRUE(layer->Backward(probe, ctx, &s).ok());
      if (pass == 0) {
        for (Parameter* p : layer->Parameters()) once.push_back(p->grad.ToVector());
      }
    }
    auto params = layer->Parameters();
    ASSERT_EQ(params.size(), once.size());
    for (size_t i = 0; i < params.size(); ++i) {
      std::vector<float> twice = params[i]->grad.ToVector();
      bool nonzero = false;
      for (size_t k = 0; k < twice.size(); ++k) {
        EXPECT_NEAR(twice[k], 2.0f * once[i][k], 1e-5f * std::max(1.0f, std::fabs(twice[k])))
            << params[i]->name << "[" << k << "]";
        nonzero |= once[i][k] != 0.0f;
      }
      EXPECT_TRUE(nonzero) << params[i]->name;
    }
  }
}

TEST(LayerTest, SeveralMicroBatchesInFlight) {
  // 1F1B keeps several micro-batches' activations: F(x1) F(x2) B(x2) B(x1) must give the same
  // gradients as F(x1) B(x1) F(x2) B(x2).
  std::mt19937 rng(22);
  auto spec = layers::TransformerBlock(kC, kH);
  Tensor x1 = Act(rng), x2 = Act(rng), r1 = Act(rng), r2 = Act(rng);
  auto a = Make(spec, "blk"), b = Make(spec, "blk");
  LayerContext ctx;
  Saved sa1, sa2;
  ASSERT_TRUE(a->Forward(x1, ctx, &sa1).ok());
  ASSERT_TRUE(a->Forward(x2, ctx, &sa2).ok());
  auto da2 = a->Backward(r2, ctx, &sa2);
  auto da1 = a->Backward(r1, ctx, &sa1);
  ASSERT_TRUE(da1.ok() && da2.ok());
  Saved sb;
  ASSERT_TRUE(b->Forward(x1, ctx, &sb).ok());
  auto db1 = b->Backward(r1, ctx, &sb);
  ASSERT_TRUE(b->Forward(x2, ctx, &sb).ok());
  auto db2 = b->Backward(r2, ctx, &sb);
  ASSERT_TRUE(db1.ok() && db2.ok());
  EXPECT_EQ(da1->ToVector(), db1->ToVector());
  EXPECT_EQ(da2->ToVector(), db2->ToVector());
  auto pa = a->Parameters(), pb = b->Parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    std::vector<float> ga = pa[i]->grad.ToVector(), gb = pb[i]->grad.ToVector();
    for (size_t k = 0; k < ga.size(); ++k) {
      EXPECT_NEAR(ga[k], gb[k], 1e-6f * std::max(1.0f, std::fabs(ga[k]))) << pa[i]->name;
    }
  }
}

absl::StatusOr<LayerGraph> SmallGpt() {
  return GptModel("small", {.layers = 3, .hidden = kC, .heads = kH, .seq = kT, .vocab = kV}, kB);
}

TEST(LayerInitTest, GlobalIndexInitIndependentOfStage) {
  auto graph = SmallGpt();
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto all = testing_util::ExpectSameParamsOnEveryStageRange(*graph, 42);
  EXPECT_TRUE(all.count("blocks.1.attn.qkv.weight") && all.count("embed.wte.weight"));
}

TEST(LayerInitTest, SeedsAndNamesChangeWeights) {
  auto graph = SmallGpt();
  ASSERT_TRUE(graph.ok());
  auto a = graph->Instantiate(0, graph->num_layers(), 1);
  auto b = graph->Instantiate(0, graph->num_layers(), 2);
  auto a2 = graph->Instantiate(0, graph->num_layers(), 1);
  ASSERT_TRUE(a.ok() && b.ok() && a2.ok());
  auto va = ParamValues(**a), vb = ParamValues(**b), va2 = ParamValues(**a2);
  EXPECT_EQ(va, va2);
  EXPECT_NE(va["embed.wte.weight"], vb["embed.wte.weight"]);
  EXPECT_NE(va["blocks.1.attn.qkv.weight"], vb["blocks.1.attn.qkv.weight"]);
  // Different blocks get different weights from the same seed.
  EXPECT_NE(va["blocks.0.attn.qkv.weight"], va["blocks.1.attn.qkv.weight"]);
  // Same (seed, name) through the spec factory directly gives the same values.
  auto l1 = Make(layers::Linear(kC, kC), "x", 9, 0);
  auto l2 = Make(layers::Linear(kC, kC), "x", 9, 5);
  auto l3 = Make(layers::Linear(kC, kC), "y", 9, 0);
  EXPECT_EQ(l1->Parameters()[0]->value.ToVector(), l2->Parameters()[0]->value.ToVector());
  EXPECT_NE(l1->Parameters()[0]->value.ToVector(), l3->Parameters()[0]->value.ToVector());
  // The default init is small and nonzero.
  std::vector<float> w = l1->Parameters()[0]->value.ToVector();
  double ss = 0;
  for (float v : w) ss += v * v;
  double std = std::sqrt(ss / w.size());
  EXPECT_GT(std, 0.01);
  EXPECT_LT(std, 0.04);
  EXPECT_EQ(l1->Parameters()[1]->value.ToVector(), std::vector<float>(kC, 0.0f));  // bias
}

TEST(LayerErrorTest, LinearWrongLastDim) {
  auto layer = Make(layers::Linear(kC, 4), "fc");
  std::mt19937 rng(30);
  Saved s;
  auto y = layer->Forward(RandomTensor({kB, kT, kC + 1}, rng), {}, &s);
  EXPECT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(layer->Forward(Tensor(), {}, &s).ok());
  EXPECT_FALSE(layer->Forward(Tensor::Zeros({kB, kC}, DType::kI32), {}, &s).ok());
}

TEST(LayerErrorTest, EmbeddingBadTokens) {
  auto layer = Make(layers::Embedding(kV, kT, kC), "embed");
  Saved s;
  EXPECT_FALSE(
      layer->Forward(Tensor::FromVectorI32({1, 2}, {0, static_cast<int32_t>(kV)}), {}, &s).ok());
  EXPECT_FALSE(layer->Forward(Tensor::FromVectorI32({1, 2}, {-1, 0}), {}, &s).ok());
  // Longer than max_seq.
  auto longer = layer->Forward(Tensor::Zeros({1, kT + 1}, DType::kI32), {}, &s);
  EXPECT_FALSE(longer.ok());
  EXPECT_EQ(longer.status().code(), absl::StatusCode::kInvalidArgument);
  // f32 instead of tokens, wrong rank.
  EXPECT_FALSE(layer->Forward(Tensor::Zeros({1, 2}), {}, &s).ok());
  EXPECT_FALSE(layer->Forward(Tensor::Zeros({2}, DType::kI32), {}, &s).ok());
  // A valid call still works afterwards.
  auto ok =
      layer->Forward(Tensor::FromVectorI32({1, 2}, {0, static_cast<int32_t>(kV - 1)}), {}, &s);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->shape(), (std::vector<int64_t>{1, 2, kC}));
}

TEST(LayerErrorTest, LossWithoutOrWithBadTargets) {
  auto layer = Make(layers::CrossEntropyLoss(), "loss");
  std::mt19937 rng(31);
  Tensor logits = RandomTensor({kB, kT, kV}, rng);
  Saved s;
  auto none = layer->Forward(logits, {}, &s);
  EXPECT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  Tensor wrong_count = Tensor::Zeros({kB, kT + 1}, DType::kI32);
  LayerContext ctx;
  ctx.targets = &wrong_count;
  EXPECT_FALSE(layer->Forward(logits, ctx, &s).ok());
  Tensor out_of_vocab = Tensor::Zeros({kB, kT}, DType::kI32);
  out_of_vocab.data<int32_t>()[3] = kV;
  ctx.targets = &out_of_vocab;
  EXPECT_FALSE(layer->Forward(logits, ctx, &s).ok());
}

TEST(LayerErrorTest, BackwardBeforeForward) {
  std::mt19937 rng(32);
  std::vector<LayerSpecPtr> specs = {layers::Linear(kC, kC),
                                     layers::Linear(kC, kC, false),
                                     layers::Gelu(),
                                     layers::LayerNorm(kC),
                                     layers::Mlp(kC, 16),
                                     layers::CausalSelfAttention(kC, kH),
                                     layers::TransformerBlock(kC, kH),
                                     layers::Embedding(kV, kT, kC),
                                     layers::LmHead(kC, kC),
                                     layers::CrossEntropyLoss()};
  for (const LayerSpecPtr& spec : specs) {
    SCOPED_TRACE(spec->kind());
    auto layer = Make(spec, "n");
    Saved s;
    Tensor dy = spec->kind() == "cross_entropy" ? Tensor::FromVector({1}, {1.0f}) : Act(rng);
    auto dx = layer->BackwardInput(dy, {}, &s);
    EXPECT_FALSE(dx.ok());
    EXPECT_FALSE(layer->Backward(dy, {}, &s).ok());
    if (!layer->Parameters().empty()) {
      absl::Status w = layer->BackwardWeight({}, &s);
      EXPECT_FALSE(w.ok());
    }
  }
}

TEST(LayerErrorTest, BackwardWeightBeforeBackwardInput) {
  std::mt19937 rng(33);
  for (const LayerSpecPtr& spec : {layers::Linear(kC, kC), layers::LayerNorm(kC),
                                   layers::Mlp(kC, 16), layers::TransformerBlock(kC, kH)}) {
    SCOPED_TRACE(spec->kind());
    auto layer = Make(spec, "n");
    Saved s;
    ASSERT_TRUE(layer->Forward(Act(rng), {}, &s).ok());
    EXPECT_FALSE(layer->BackwardWeight({}, &s).ok());
    for (Parameter* p : layer->Parameters()) {
      for (float g : p->grad.ToVector()) ASSERT_EQ(g, 0.0f) << p->name;
    }
  }
}

TEST(LayerErrorTest, BackwardWithMismatchedGradientShape) {
  // A dy that does not match the forward's output must be an error, not an out-of-bounds read.
  std::mt19937 rng(34);
  for (const LayerSpecPtr& spec : {layers::Linear(kC, kC), layers::LayerNorm(kC), layers::Gelu(),
                                   layers::CausalSelfAttention(kC, kH), layers::Mlp(kC, 16),
                                   layers::TransformerBlock(kC, kH)}) {
    SCOPED_TRACE(spec->kind());
    auto layer = Make(spec, "n");
    Saved s;
    ASSERT_TRUE(layer->Forward(Act(rng), {}, &s).ok());
    EXPECT_FALSE(layer->BackwardInput(RandomTensor({1, kT, kC}, rng), {}, &s).ok());
  }
  auto emb = Make(layers::Embedding(kV, kT, kC), "e");
  Saved s;
  ASSERT_TRUE(emb->Forward(RandomTokens(kB, kT, kV, rng), {}, &s).ok());
  EXPECT_FALSE(emb->BackwardInput(RandomTensor({1, kT, kC}, rng), {}, &s).ok());

  auto loss = Make(layers::CrossEntropyLoss(), "loss");
  Tensor targets = RandomTokens(kB, kT, kV, rng);
  LayerContext ctx;
  ctx.targets = &targets;
  Saved ls;
  ASSERT_TRUE(loss->Forward(RandomTensor({kB, kT, kV}, rng), ctx, &ls).ok());
  EXPECT_FALSE(loss->BackwardInput(Tensor::Zeros({0}), ctx, &ls).ok());
  EXPECT_TRUE(loss->BackwardInput(Tensor::FromVector({1}, {1.0f}), ctx, &ls).ok());
}

TEST(LayerSpecTest, KindsConfigsAndCosts) {
  MicroBatchShape shape{kB, kT};
  EXPECT_EQ(layers::Linear(kC, 6)->kind(), "linear");
  EXPECT_NE(layers::Linear(kC, 6)->Config(), layers::Linear(kC, 7)->Config());
  EXPECT_NE(layers::Linear(kC, 6, true)->Config(), layers::Linear(kC, 6, false)->Config());
  EXPECT_EQ(layers::Linear(kC, 6)->GetCost(shape, 0).params, kC * 6 + 6);
  EXPECT_EQ(layers::Linear(kC, 6, false)->GetCost(shape, 0).params, kC * 6);
  EXPECT_EQ(layers::LayerNorm(kC)->GetCost(shape, 0).params, 2 * kC);
  EXPECT_EQ(layers::Embedding(kV, kT, kC)->GetCost(shape, 0).params, (kV + kT) * kC);
  EXPECT_EQ(layers::TransformerBlock(kC, kH)->GetCost(shape, 0).params, 12 * kC * kC + 13 * kC);
  EXPECT_EQ(layers::CrossEntropyLoss()->GetCost(shape, 1000).output_bytes, 4);
  // Parameter counts from the cost equal the instantiated parameters.
  for (const LayerSpecPtr& spec :
       {layers::Linear(kC, 6), layers::LayerNorm(kC), layers::Mlp(kC, 16),
        layers::CausalSelfAttention(kC, kH), layers::TransformerBlock(kC, kH),
        layers::Embedding(kV, kT, kC), layers::LmHead(kC, kV)}) {
    auto layer = Make(spec, "n");
    int64_t n = 0;
    for (Parameter* p : layer->Parameters()) n += p->value.numel();
    EXPECT_EQ(n, spec->GetCost(shape, 0).params) << spec->kind();
  }
}

TEST(LayerSpecTest, OutputShapes) {
  using Shape = std::vector<int64_t>;
  const Shape act{kB, kT, kC};
  EXPECT_EQ(layers::Linear(kC, 6)->OutputShape(act), (Shape{kB, kT, 6}));
  EXPECT_EQ(layers::Linear(kC, 6, false)->OutputShape(act), (Shape{kB, kT, 6}));
  EXPECT_EQ(layers::Linear(kC, 6)->OutputShape({5, kC}), (Shape{5, 6}));
  EXPECT_EQ(layers::Gelu()->OutputShape(act), act);
  EXPECT_EQ(layers::LayerNorm(kC)->OutputShape(act), act);
  EXPECT_EQ(layers::Mlp(kC, 16)->OutputShape(act), act);
  EXPECT_EQ(layers::CausalSelfAttention(kC, kH)->OutputShape(act), act);
  EXPECT_EQ(layers::TransformerBlock(kC, kH)->OutputShape(act), act);
  EXPECT_EQ(layers::Embedding(kV, kT, kC)->OutputShape({kB, kT}), act);
  EXPECT_EQ(layers::LmHead(kC, kV)->OutputShape(act), (Shape{kB, kT, kV}));
  EXPECT_EQ(layers::CrossEntropyLoss()->OutputShape({kB, kT, kV}), (Shape{1}));
  EXPECT_EQ(layers::Delay(kC, 0, 0, 0)->OutputShape(act), act);
}

TEST(LayerSpecTest, OutputShapeMatchesForward) {
  std::mt19937 rng(40);
  Tensor targets = RandomTokens(kB, kT, kV, rng);
  struct ShapeCase {
    LayerSpecPtr spec;
    Tensor x;
  };
  std::vector<ShapeCase> cases = {
      {layers::Linear(kC, 6), Act(rng)},
      {layers::Linear(kC, 6, false), Act(rng)},
      {layers::Gelu(), Act(rng)},
      {layers::LayerNorm(kC), Act(rng)},
      {layers::Mlp(kC, 16), Act(rng)},
      {layers::CausalSelfAttention(kC, kH), Act(rng)},
      {layers::TransformerBlock(kC, kH), Act(rng)},
      {layers::Embedding(kV, kT, kC), RandomTokens(kB, kT, kV, rng)},
      {layers::LmHead(kC, kV), Act(rng)},
      {layers::CrossEntropyLoss(), Act(rng, kV)},
      {layers::Delay(kC, 0, 0, 0), Act(rng)},
  };
  for (const ShapeCase& c : cases) {
    SCOPED_TRACE(c.spec->kind());
    auto layer = Make(c.spec, "n");
    ASSERT_NE(layer, nullptr);
    LayerContext ctx;
    ctx.targets = &targets;
    Saved s;
    auto y = layer->Forward(c.x, ctx, &s);
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ(y->shape(), c.spec->OutputShape(c.x.shape()));
  }
}

// Chains OutputShape through every node of a graph from its [B, T] token input, checking each
// node's shape against its cost's output_bytes (all outputs are f32). Returns every shape.
std::vector<std::vector<int64_t>> ChainShapes(const LayerGraph& g) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> shape = {g.shape().batch, g.shape().seq_len};
  for (const LayerNode& n : g.nodes()) {
    shape = n.spec->OutputShape(shape);
    EXPECT_EQ(NumElements(shape) * 4, n.cost.output_bytes) << n.name;
    out.push_back(shape);
  }
  return out;
}

TEST(LayerSpecTest, OutputShapeThroughGptTiny) {
  auto g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok()) << g.status();
  const int64_t B = 2, T = g->shape().seq_len;
  ASSERT_EQ(g->shape().batch, B);
  auto shapes = ChainShapes(*g);
  ASSERT_EQ(shapes.size(), static_cast<size_t>(g->num_layers()));
  ASSERT_GE(shapes.size(), 3u);
  // Every node before the head (embedding, blocks, ln_f) outputs [B, T, 64].
  for (size_t i = 0; i + 2 < shapes.size(); ++i) {
    EXPECT_EQ(shapes[i], (std::vector<int64_t>{B, T, 64})) << g->node(i).name;
  }
  EXPECT_EQ(shapes[shapes.size() - 2], (std::vector<int64_t>{B, T, 256}));  // lm_head logits
  EXPECT_EQ(shapes.back(), (std::vector<int64_t>{1}));
}

TEST(LayerSpecTest, OutputShapeThroughMlpPreset) {
  auto g = PresetModel("mlp", 3);
  ASSERT_TRUE(g.ok()) << g.status();
  const int64_t B = 3, T = g->shape().seq_len;
  auto shapes = ChainShapes(*g);
  ASSERT_EQ(shapes.size(), static_cast<size_t>(g->num_layers()));
  EXPECT_EQ(shapes.front(), (std::vector<int64_t>{B, T, 64}));  // embed
  for (size_t i = 1; i + 1 < shapes.size(); ++i) {
    EXPECT_EQ(shapes[i], (std::vector<int64_t>{B, T, 256})) << g->node(i).name;
  }
  EXPECT_EQ(shapes.back(), (std::vector<int64_t>{1}));
}

TEST(DelayLayerTest, SpecKindConfigAndCost) {
  auto spec = layers::Delay(kC, 0.001, 0.002, 0.003);
  EXPECT_EQ(spec->kind(), "delay");
  EXPECT_EQ(spec->Config(), "dim=8,f=0.001,b=0.002,w=0.003");
  EXPECT_NE(spec->Config(), layers::Delay(kC, 0.001, 0.002, 0.004)->Config());
  Cost c = spec->GetCost({kB, kT}, 12345);
  EXPECT_EQ(c.params, 0);
  EXPECT_EQ(c.forward_flops, 0);
  EXPECT_EQ(c.backward_flops, 0);
  EXPECT_EQ(c.activation_bytes, 0);
  EXPECT_EQ(c.output_bytes, kB * kT * kC * 4);
  auto layer = Make(spec, "d");
  ASSERT_NE(layer, nullptr);
  EXPECT_EQ(layer->kind(), "delay");
  EXPECT_TRUE(layer->Parameters().empty());
}

TEST(DelayLayerTest, IdentityThatSleeps) {
  constexpr double kF = 0.02, kBi = 0.015, kBw = 0.01;
  auto layer = Make(layers::Delay(kC, kF, kBi, kBw), "d");
  ASSERT_NE(layer, nullptr);
  std::mt19937 rng(41);
  Tensor x = Act(rng), dy = Act(rng);
  CpuAllocator alloc;
  LayerContext ctx;
  ctx.allocator = &alloc;
  Saved s;
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };

  auto t0 = Clock::now();
  auto y = layer->Forward(x, ctx, &s);
  double forward_s = seconds_since(t0);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_GE(forward_s, kF);
  EXPECT_EQ(y->shape(), x.shape());
  EXPECT_EQ(y->ToVector(), x.ToVector());
  // A copy from ctx.allocator, like a real layer's output.
  EXPECT_NE(y->data<float>(), x.data<float>());
  EXPECT_EQ(alloc.current_bytes(), static_cast<int64_t>(y->nbytes()));

  t0 = Clock::now();
  auto dx = layer->BackwardInput(dy, ctx, &s);
  double backward_input_s = seconds_since(t0);
  ASSERT_TRUE(dx.ok()) << dx.status();
  EXPECT_GE(backward_input_s, kBi);
  EXPECT_EQ(dx->shape(), dy.shape());
  EXPECT_EQ(dx->ToVector(), dy.ToVector());

  t0 = Clock::now();
  EXPECT_TRUE(layer->BackwardWeight(ctx, &s).ok());
  EXPECT_GE(seconds_since(t0), kBw);
  EXPECT_TRUE(s.empty());

  // Backward() = BackwardInput then BackwardWeight.
  ASSERT_TRUE(layer->Forward(x, ctx, &s).ok());
  t0 = Clock::now();
  auto dx2 = layer->Backward(dy, ctx, &s);
  ASSERT_TRUE(dx2.ok()) << dx2.status();
  EXPECT_GE(seconds_since(t0), kBi + kBw);
  EXPECT_EQ(dx2->ToVector(), dy.ToVector());
}

TEST(DelayLayerTest, RejectsWrongWidth) {
  auto layer = Make(layers::Delay(kC, 0, 0, 0), "d");
  ASSERT_NE(layer, nullptr);
  std::mt19937 rng(42);
  Saved s;
  EXPECT_FALSE(layer->Forward(RandomTensor({kB, kT, kC + 1}, rng), {}, &s).ok());
  EXPECT_FALSE(layer->Forward(Tensor(), {}, &s).ok());
  EXPECT_FALSE(layer->BackwardInput(RandomTensor({kB, kT, kC + 1}, rng), {}, &s).ok());
}

}  // namespace
}  // namespace pipewright
