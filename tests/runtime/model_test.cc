#include "pipewright/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "pipewright/data.h"
#include "pipewright/layer.h"

namespace pipewright {
namespace {

TEST(ModelBuilderTest, Errors) {
  EXPECT_FALSE(ModelBuilder("empty", {2, 4}).Build().ok());

  ModelBuilder dup("dup", {2, 4});
  dup.Add("a", layers::Gelu()).Add("b", layers::Gelu()).Add("a", layers::Gelu());
  auto d = dup.Build();
  EXPECT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("duplicate"), std::string::npos) << d.status();

  ModelBuilder unnamed("unnamed", {2, 4});
  unnamed.Add("a", layers::Gelu()).Add("", layers::Gelu());
  EXPECT_FALSE(unnamed.Build().ok());

  ModelBuilder null_spec("null", {2, 4});
  null_spec.Add("a", nullptr);
  EXPECT_FALSE(null_spec.Build().ok());

  ModelBuilder bad_shape("shape", {0, 4});
  bad_shape.Add("a", layers::Gelu());
  EXPECT_FALSE(bad_shape.Build().ok());

  ModelBuilder ok("ok", {2, 4});
  ok.Add("a", layers::Linear(4, 4)).Add("b", layers::Gelu());
  auto g = ok.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->num_layers(), 2);
  EXPECT_EQ(g->name(), "ok");
  EXPECT_EQ(g->node(1).name, "b");
  EXPECT_EQ(g->num_blocks(), 1);
}

TEST(PresetTest, KnownAndUnknown) {
  std::vector<std::string> names = PresetNames();
  const std::set<std::string> have(names.begin(), names.end());
  // The runnable presets, and the analytic ones for the partitioner (costed, never allocated).
  for (const char* want : {"mlp", "gpt-tiny", "gpt-small", "gpt3-175b", "megatron-1t", "llama-tiny",
                           "smollm2-135m", "llama3-405b"}) {
    EXPECT_TRUE(have.count(want)) << want;
  }
  for (const std::string& name : names) {
    auto g = PresetModel(name, 0);
    ASSERT_TRUE(g.ok()) << name << ": " << g.status();
    EXPECT_EQ(g->name(), name);
    EXPECT_GT(g->TotalCost().params, 0);
    EXPECT_EQ(g->node(g->num_layers() - 1).spec->kind(), "cross_entropy") << name;
    const std::string first = g->node(0).spec->kind();
    EXPECT_TRUE(first == "embedding" || first == "token_embedding") << name << ": " << first;
  }
  auto small = PresetModel("gpt-small", 0);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->num_layers(), 6 + 4);
  EXPECT_EQ(small->num_blocks(), 6);
  EXPECT_EQ(small->shape().seq_len, 128);
  // GPT-2 small: the LM head tied to the embedding, the familiar 124,475,904 parameters
  // (nanoGPT's count at vocabulary 50304); the graph's costs still count the head's copy.
  auto gpt2 = PresetModel("gpt2-124m", 0);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  EXPECT_EQ(gpt2->TotalCost().params, 163109376);
  EXPECT_EQ(ToModelCosts(*gpt2).UniqueParams(), 124475904);
  EXPECT_EQ(gpt2->node(gpt2->num_layers() - 2).spec->tied_to(), "embed");
  EXPECT_EQ(gpt2->shape().seq_len, 1024);

  auto unknown = PresetModel("gpt-huge", 0);
  EXPECT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(PresetModel("gpt-tiny", -1).ok());

  auto mbs = PresetModel("gpt-tiny", 3);
  ASSERT_TRUE(mbs.ok());
  EXPECT_EQ(mbs->shape().batch, 3);
  EXPECT_EQ(PresetModel("gpt-tiny", 0)->shape().batch, 8);
}

TEST(PresetTest, GptTinyStructureAndParameterCount) {
  auto g = PresetModel("gpt-tiny", 0);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(g->num_layers(), 8);
  std::vector<std::string> expected = {"embed",    "blocks.0", "blocks.1", "blocks.2",
                                       "blocks.3", "ln_f",     "lm_head",  "loss"};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(g->node(i).name, expected[i]);
  EXPECT_EQ(g->num_blocks(), 4);
  EXPECT_EQ(g->shape().seq_len, 32);
  const int64_t V = 256, T = 32, C = 64, L = 4;
  const int64_t analytic = (V + T) * C + L * (12 * C * C + 13 * C) + 2 * C + C * V;
  EXPECT_EQ(g->TotalCost().params, analytic);
  int64_t sum = 0;
  for (const LayerNode& n : g->nodes()) sum += n.cost.params;
  EXPECT_EQ(sum, analytic);
  EXPECT_EQ(g->node(7).cost.params, 0);
  EXPECT_EQ(g->node(7).cost.output_bytes, 4);

  auto stage = g->Instantiate(0, g->num_layers(), 1);
  ASSERT_TRUE(stage.ok()) << stage.status();
  int64_t numel = 0;
  for (Parameter* p : (*stage)->Parameters()) numel += p->value.numel();
  EXPECT_EQ(numel, analytic);
  // Per layer, too.
  for (int i = 0; i < g->num_layers(); ++i) {
    int64_t n = 0;
    for (Parameter* p : (*stage)->layer(i).Parameters()) n += p->value.numel();
    EXPECT_EQ(n, g->node(i).cost.params) << g->node(i).name;
  }
}

TEST(PresetTest, MlpPresetParamsMatchCost) {
  auto g = PresetModel("mlp", 2);
  ASSERT_TRUE(g.ok());
  auto stage = g->Instantiate(0, g->num_layers(), 1);
  ASSERT_TRUE(stage.ok());
  int64_t numel = 0;
  for (Parameter* p : (*stage)->Parameters()) numel += p->value.numel();
  EXPECT_EQ(numel, g->TotalCost().params);
}

TEST(LayerGraphTest, InstantiateBadRanges) {
  auto g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok());
  const int n = g->num_layers();
  for (auto [b, e] :
       std::vector<std::pair<int, int>>{{-1, 2}, {3, 3}, {5, 3}, {0, n + 1}, {n, n + 1}}) {
    auto s = g->Instantiate(b, e, 1);
    EXPECT_FALSE(s.ok()) << "[" << b << ", " << e << ")";
    if (!s.ok()) {
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  auto last = g->Instantiate(n - 1, n, 1);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ((*last)->begin(), n - 1);
  EXPECT_EQ((*last)->end(), n);
  EXPECT_EQ((*last)->size(), 1);
  EXPECT_EQ((*last)->name(0), "loss");
}

Tensor Tokens(int64_t B, int64_t T, int offset) {
  std::vector<int32_t> v(B * T);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>((i * 37 + offset) % 256);
  return Tensor::FromVectorI32({B, T}, v);
}

struct RunResult {
  float loss = 0;
  std::map<std::string, std::vector<float>> grads;
};

// Forward then backward through consecutive stages covering the whole model.
RunResult RunStages(const LayerGraph& g, const std::vector<int>& cuts, const Tensor& tokens,
                    const Tensor& targets) {
  RunResult r;
  std::vector<std::unique_ptr<Stage>> stages;
  std::vector<int> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(g.num_layers());
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    auto s = g.Instantiate(bounds[i], bounds[i + 1], 7);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return r;
    stages.push_back(*std::move(s));
  }
  LayerContext ctx;
  ctx.targets = &targets;
  std::vector<std::vector<Saved>> saved(stages.size());
  Tensor h = tokens;
  for (size_t i = 0; i < stages.size(); ++i) {
    auto y = stages[i]->Forward(h, ctx, &saved[i]);
    EXPECT_TRUE(y.ok()) << y.status();
    if (!y.ok()) return r;
    h = *y;
  }
  EXPECT_EQ(h.numel(), 1);
  r.loss = h.data<float>()[0];
  Tensor g_out = Tensor::FromVector({1}, {1.0f});
  for (size_t i = stages.size(); i-- > 0;) {
    auto dx = stages[i]->BackwardInput(g_out, ctx, &saved[i]);
    EXPECT_TRUE(dx.ok()) << dx.status();
    if (!dx.ok()) return r;
    EXPECT_TRUE(stages[i]->BackwardWeight(ctx, &saved[i]).ok());
    g_out = *dx;
  }
  EXPECT_FALSE(g_out.defined());  // token inputs have no gradient
  for (auto& s : stages) {
    for (Parameter* p : s->Parameters()) {
      EXPECT_FALSE(r.grads.count(p->name)) << p->name;
      r.grads[p->name] = p->grad.ToVector();
    }
  }
  return r;
}

TEST(StageTest, SplitStagesMatchWholeModelBitwise) {
  auto g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok());
  Tensor tokens = Tokens(2, 32, 0), targets = Tokens(2, 32, 37);
  RunResult whole = RunStages(*g, {}, tokens, targets);
  ASSERT_GT(whole.loss, 0.0f);
  ASSERT_EQ(whole.grads.size(), 2 + 4 * 12 + 2 + 1);  // wte, wpe; 12 per block; ln_f 2; head
  for (int k : {1, 3, 6}) {
    SCOPED_TRACE(k);
    RunResult split = RunStages(*g, {k}, tokens, targets);
    EXPECT_EQ(split.loss, whole.loss);
    ASSERT_EQ(split.grads.size(), whole.grads.size());
    for (auto& [name, grad] : whole.grads) {
      EXPECT_EQ(split.grads[name], grad) << name;
    }
  }
  RunResult three = RunStages(*g, {2, 5}, tokens, targets);
  EXPECT_EQ(three.loss, whole.loss);
  EXPECT_EQ(three.grads, whole.grads);
}

TEST(StageTest, ForwardErrorNamesTheLayer) {
  auto g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok());
  auto s = g->Instantiate(0, g->num_layers(), 1);
  ASSERT_TRUE(s.ok());
  std::vector<Saved> saved;
  Tensor bad = Tensor::FromVectorI32({1, 2}, {0, 999});
  Tensor targets = Tensor::FromVectorI32({1, 2}, {0, 1});
  LayerContext ctx;
  ctx.targets = &targets;
  auto y = (*s)->Forward(bad, ctx, &saved);
  ASSERT_FALSE(y.ok());
  EXPECT_NE(y.status().message().find("embed"), std::string::npos) << y.status();
  // Backward without a saved forward.
  std::vector<Saved> none;
  EXPECT_FALSE((*s)->BackwardInput(Tensor::FromVector({1}, {1.0f}), ctx, &none).ok());
  EXPECT_FALSE((*s)->BackwardWeight(ctx, &none).ok());
}

TEST(LayerGraphTest, Fingerprint) {
  auto a = PresetModel("gpt-tiny", 4);
  auto b = PresetModel("gpt-tiny", 4);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->Fingerprint(), b->Fingerprint());
  EXPECT_FALSE(a->Fingerprint().empty());
  EXPECT_NE(a->Fingerprint(), PresetModel("gpt-small", 4)->Fingerprint());
  // Plans and checkpoints match the same model at another micro-batch size.
  EXPECT_EQ(a->Fingerprint(), PresetModel("gpt-tiny", 2)->Fingerprint());

  auto build = [](int64_t hidden2, float eps, const std::string& name2) {
    ModelBuilder m("m", {2, 4});
    m.Add("fc", layers::Linear(4, hidden2)).Add(name2, layers::LayerNorm(hidden2, eps));
    return m.Build()->Fingerprint();
  };
  std::string base = build(8, 1e-5f, "ln");
  EXPECT_EQ(base, build(8, 1e-5f, "ln"));
  EXPECT_NE(base, build(16, 1e-5f, "ln"));   // layer config changes
  EXPECT_NE(base, build(8, 1e-3f, "ln"));    // eps changes
  EXPECT_NE(base, build(8, 1e-5f, "norm"));  // node name changes

  ModelBuilder kind("m", {2, 4});
  kind.Add("fc", layers::Linear(4, 8)).Add("ln", layers::Gelu());
  EXPECT_NE(base, kind.Build()->Fingerprint());  // layer kind changes
}

TEST(StageTest, GlobalParameterNamesAndShapes) {
  auto g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok());
  auto whole = g->Instantiate(0, g->num_layers(), 1);
  ASSERT_TRUE(whole.ok());
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, bool> decay;
  for (Parameter* p : (*whole)->Parameters()) {
    EXPECT_TRUE(shapes.emplace(p->name, p->value.shape()).second) << "duplicate " << p->name;
    EXPECT_EQ(p->grad.shape(), p->value.shape()) << p->name;
    decay[p->name] = p->weight_decay;
  }
  using S = std::vector<int64_t>;
  EXPECT_EQ(shapes["embed.wte.weight"], (S{256, 64}));
  EXPECT_EQ(shapes["embed.wpe.weight"], (S{32, 64}));
  EXPECT_EQ(shapes["blocks.3.attn.qkv.weight"], (S{192, 64}));
  EXPECT_EQ(shapes["blocks.3.attn.qkv.bias"], (S{192}));
  EXPECT_EQ(shapes["blocks.0.attn.proj.weight"], (S{64, 64}));
  EXPECT_EQ(shapes["blocks.2.mlp.fc.weight"], (S{256, 64}));
  EXPECT_EQ(shapes["blocks.2.mlp.proj.weight"], (S{64, 256}));
  EXPECT_EQ(shapes["blocks.1.ln_1.weight"], (S{64}));
  EXPECT_EQ(shapes["blocks.1.ln_2.bias"], (S{64}));
  EXPECT_EQ(shapes["ln_f.weight"], (S{64}));
  EXPECT_EQ(shapes["lm_head.weight"], (S{256, 64}));
  EXPECT_FALSE(shapes.count("lm_head.bias"));
  EXPECT_TRUE(decay["blocks.3.attn.qkv.weight"]);
  EXPECT_FALSE(decay["blocks.3.attn.qkv.bias"]);
  EXPECT_FALSE(decay["ln_f.weight"]);
  EXPECT_FALSE(decay["embed.wpe.weight"]);

  // A stage in the middle carries the same global names.
  auto mid = g->Instantiate(4, 5, 1);
  ASSERT_TRUE(mid.ok());
  EXPECT_EQ((*mid)->name(0), "blocks.3");
  std::vector<Parameter*> ps = (*mid)->Parameters();
  ASSERT_EQ(ps.size(), 12u);
  for (Parameter* p : ps) EXPECT_EQ(p->name.rfind("blocks.3.", 0), 0u) << p->name;
  bool found = false;
  for (Parameter* p : ps) found |= p->name == "blocks.3.attn.qkv.weight";
  EXPECT_TRUE(found);
}

TEST(LayerGraphTest, ResidualProjectionsScaledByDepth) {
  // GPT-2 init: projections into the residual stream have std 0.02 / sqrt(2 L).
  auto g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok());
  auto s = g->Instantiate(1, 2, 1);
  ASSERT_TRUE(s.ok());
  auto stdev = [](const Tensor& t) {
    double ss = 0;
    for (float v : t.ToVector()) ss += double(v) * v;
    return std::sqrt(ss / t.numel());
  };
  for (Parameter* p : (*s)->Parameters()) {
    if (p->name == "blocks.0.mlp.proj.weight" || p->name == "blocks.0.attn.proj.weight") {
      EXPECT_NEAR(stdev(p->value), 0.02 / std::sqrt(8.0), 0.002) << p->name;
    }
    if (p->name == "blocks.0.mlp.fc.weight") {
      EXPECT_NEAR(stdev(p->value), 0.02, 0.002);
    }
  }
}

}  // namespace
}  // namespace pipewright

namespace pipewright {
namespace {

// A stage's training micro-batches allocate the same sizes every time, so after the first one
// the caching allocator serves every allocation: no system allocation (and no page fault on
// fresh memory) in steady state.
TEST(StageMemoryTest, SteadyStateMakesNoSystemAllocations) {
  auto g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok()) << g.status();
  CpuAllocator alloc;
  auto stage = g->Instantiate(0, g->num_layers(), 7, &alloc);
  ASSERT_TRUE(stage.ok()) << stage.status();
  auto data = SyntheticDataset(g->shape().seq_len, 7);
  BatchLayout layout{1, g->shape().batch, g->shape().seq_len, 1};
  Tensor dloss = Tensor::FromVector({1}, {1.0f});
  auto micro_batch = [&](int64_t step) {
    StepBatch b = MakeStepBatch(*data, layout, step, 0);
    LayerContext ctx{&alloc, &b.targets[0]};
    std::vector<Saved> saved;
    ASSERT_TRUE((*stage)->Forward(b.inputs[0], ctx, &saved).ok());
    ASSERT_TRUE((*stage)->BackwardInput(dloss, ctx, &saved).ok());
    ASSERT_TRUE((*stage)->BackwardWeight(ctx, &saved).ok());
  };
  micro_batch(0);
  micro_batch(1);
  const int64_t warm = alloc.system_allocations();
  const int64_t in_use = alloc.current_bytes();
  for (int64_t step = 2; step < 6; ++step) micro_batch(step);
  EXPECT_EQ(alloc.system_allocations(), warm);
  EXPECT_EQ(alloc.current_bytes(), in_use);  // everything a micro-batch made was freed
}

}  // namespace
}  // namespace pipewright
