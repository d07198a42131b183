// The Llama family in the engine (issue 38; Note [Llama layers] in runtime/ops/llama_ops.cc):
// llama-tiny pipelines bit-identically to one stage under every schedule, with recomputation,
// data parallelism, ZeRO and bf16, as the GPT presets do, and its tied variant ties across
// stages; the presets' shapes and parameter counts are the published ones.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "pipewright/engine.h"
#include "pipewright/model.h"
#include "tests/runtime/engine_util.h"

namespace pipewright {
namespace {

using testing_util::EngineSetup;
using testing_util::ExpectSameRun;
using testing_util::RunResult;

constexpr int kSteps = 3;
constexpr int64_t kMicroBatches = 4;

LayerGraph LlamaTiny(bool tied = false) {
  LlamaConfig c;
  c.tied = tied;
  auto g = LlamaModel(tied ? "llama-tiny-tied" : "llama-tiny", c, 2);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

EngineSetup Layout(int pp, int dp, ScheduleKind kind = ScheduleKind::k1F1B, int chunks = 1,
                   Recompute rc = Recompute::kNone) {
  return testing_util::ParitySetup(pp, dp, kind, chunks, rc, kMicroBatches, kSteps);
}

TEST(LlamaEngine, EveryScheduleIsBitIdenticalToOneStage) {
  const LayerGraph g = LlamaTiny();
  const RunResult want = testing_util::RunReference(
      g, kMicroBatches, testing_util::ParityTrainOptions(kSteps), kSteps);
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_GT(want.losses.front(), want.losses.back()) << "training moved the weights";
  struct Case {
    int pp;
    ScheduleKind kind;
    int chunks;
    Recompute rc;
  };
  for (const Case c : {Case{1, ScheduleKind::k1F1B, 1, Recompute::kNone},
                       Case{2, ScheduleKind::kGpipe, 1, Recompute::kNone},
                       Case{4, ScheduleKind::k1F1B, 1, Recompute::kFull},
                       Case{2, ScheduleKind::k1F1B, 1, Recompute::kSelective},
                       Case{2, ScheduleKind::kInterleaved, 2, Recompute::kNone},
                       Case{2, ScheduleKind::kZbH1, 1, Recompute::kNone},
                       Case{2, ScheduleKind::kZbV, 2, Recompute::kFull}}) {
    const std::string what = absl::StrCat("pp ", c.pp, " ", ScheduleKindName(c.kind));
    ExpectSameRun(testing_util::RunSteps(g, Layout(c.pp, 1, c.kind, c.chunks, c.rc), kSteps), want,
                  what);
  }
}

// Data parallelism at any depth, ZeRO-1 (bit-identical to zero 0), bf16 across depths, and a
// tied head whose owner is on another stage.
TEST(LlamaEngine, DataParallelZeroBf16AndTiesPipelineBitIdentically) {
  const LayerGraph g = LlamaTiny();
  const RunResult dp = testing_util::RunSteps(g, Layout(1, 2), kSteps);
  ExpectSameRun(testing_util::RunSteps(g, Layout(4, 2), kSteps), dp, "pp 4 x dp 2");
  EngineSetup z1 = Layout(2, 2);
  z1.train.zero = 1;
  ExpectSameRun(testing_util::RunSteps(g, z1, kSteps), dp, "pp 2 x dp 2, zero 1");
  EngineSetup z2 = Layout(2, 2);
  z2.train.zero = 2;
  const RunResult two = testing_util::RunSteps(g, z2, kSteps);
  ASSERT_EQ(two.losses.size(), dp.losses.size());
  for (size_t i = 0; i < two.losses.size(); ++i) {
    EXPECT_NEAR(two.losses[i], dp.losses[i], 1e-5 * dp.losses[i]) << "zero 2, step " << i;
  }
  EngineSetup bf1 = Layout(1, 1), bf4 = Layout(4, 1);
  bf1.train.precision = bf4.train.precision = Precision::kBf16;
  const RunResult b1 = testing_util::RunSteps(g, bf1, kSteps);
  ExpectSameRun(testing_util::RunSteps(g, bf4, kSteps), b1, "bf16, pp 4");
  EXPECT_NE(b1.losses, testing_util::RunSteps(g, Layout(1, 1), kSteps).losses)
      << "bf16 changed nothing";
  const LayerGraph tied = LlamaTiny(/*tied=*/true);
  const RunResult t1 = testing_util::RunSteps(tied, Layout(1, 1), kSteps);
  ExpectSameRun(testing_util::RunSteps(tied, Layout(4, 1), kSteps), t1, "tied, pp 4");
  EXPECT_EQ(t1.weights.count("lm_head.weight"), 0u) << "a tied head stores no weight of its own";
}

// Selective recomputation drops the two RMSNorm outputs and the SwiGLU output of each block and
// remakes them (Note [Selective recomputation]): the same bits (above), less activation memory.
TEST(LlamaEngine, SelectiveRecomputationKeepsLess) {
  const LayerGraph g = LlamaTiny();
  std::vector<StepReport> none, selective;
  testing_util::RunSteps(g, Layout(1, 1), 1, &none);
  testing_util::RunSteps(g, Layout(1, 1, ScheduleKind::k1F1B, 1, Recompute::kSelective), 1,
                         &selective);
  ASSERT_FALSE(none.empty());
  ASSERT_FALSE(selective.empty());
  EXPECT_LT(selective.back().ranks[0].peak_activation_bytes,
            none.back().ranks[0].peak_activation_bytes);
}

EngineSetup Tp(int tp, int pp, int dp, ScheduleKind kind = ScheduleKind::k1F1B, int chunks = 1,
               Recompute rc = Recompute::kNone, bool sp = false) {
  EngineSetup s = Layout(pp, dp, kind, chunks, rc);
  s.tp = tp;
  s.sequence_parallel = sp;
  return s;
}

// Tensor parallelism (Note [Tensor parallelism]): llama-tiny's 4 query heads and 2 key-value heads
// split over 2 ranks (the fused qkv in its unequal q, k and v sections). At tp 2 the layout, the
// schedule, recomputation, replicas and ZeRO change no bit, with and without sequence
// parallelism; against tp 1 the sums are split differently and agree within rounding.
TEST(LlamaEngine, TensorParallelIsBitIdenticalAcrossLayoutsAndAgreesWithOneRank) {
  const LayerGraph g = LlamaTiny();
  for (const bool sp : {false, true}) {
    const std::string with = sp ? "sp, " : "";
    const RunResult ref = testing_util::RunSteps(
        g, Tp(2, 1, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, sp), kSteps);
    ASSERT_EQ(ref.losses.size(), static_cast<size_t>(kSteps));
    ExpectSameRun(testing_util::RunSteps(
                      g, Tp(2, 2, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, sp), kSteps),
                  ref, with + "tp 2 pp 2");
    ExpectSameRun(testing_util::RunSteps(
                      g, Tp(2, 2, 1, ScheduleKind::kInterleaved, 2, Recompute::kNone, sp), kSteps),
                  ref, with + "interleaved");
    ExpectSameRun(testing_util::RunSteps(
                      g, Tp(2, 2, 1, ScheduleKind::kZbH1, 1, Recompute::kNone, sp), kSteps),
                  ref, with + "zb-h1");
    ExpectSameRun(testing_util::RunSteps(
                      g, Tp(2, 2, 1, ScheduleKind::k1F1B, 1, Recompute::kSelective, sp), kSteps),
                  ref, with + "selective");
    ExpectSameRun(testing_util::RunSteps(
                      g, Tp(2, 1, 1, ScheduleKind::k1F1B, 1, Recompute::kFull, sp), kSteps),
                  ref, with + "full");
    const RunResult dp = testing_util::RunSteps(
        g, Tp(2, 1, 2, ScheduleKind::k1F1B, 1, Recompute::kNone, sp), kSteps);
    EngineSetup zero = Tp(2, 2, 2, ScheduleKind::k1F1B, 1, Recompute::kNone, sp);
    zero.train.zero = 1;
    ExpectSameRun(testing_util::RunSteps(g, zero, kSteps), dp, with + "pp 2 dp 2 ZeRO-1");
  }
  const RunResult one = testing_util::RunSteps(g, Tp(1, 1, 1), kSteps);
  const RunResult two = testing_util::RunSteps(g, Tp(2, 1, 1), kSteps);
  ASSERT_EQ(two.losses.size(), one.losses.size());
  for (size_t i = 0; i < one.losses.size(); ++i) {
    EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5 * one.losses[i]) << "step " << i;
  }
  ASSERT_EQ(two.weights.size(), one.weights.size());
  for (const auto& [name, w] : one.weights) {
    const std::vector<float>& v = two.weights.at(name);
    ASSERT_EQ(v.size(), w.size()) << name << ": checkpoints hold whole tensors";
    for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(v[i], w[i], 1e-4) << name << " " << i;
  }
  const LayerGraph tied = LlamaTiny(/*tied=*/true);
  const RunResult t2 = testing_util::RunSteps(tied, Tp(2, 1, 1), kSteps);
  ExpectSameRun(testing_util::RunSteps(tied, Tp(2, 4, 1), kSteps), t2, "tied, tp 2 pp 4");
}

// A size that does not split the key-value heads is refused naming the layer.
TEST(LlamaEngine, ATensorParallelSizeThatDoesNotSplitTheKvHeadsIsRefusedByName) {
  const LayerGraph g = LlamaTiny();  // 4 heads, 2 key-value heads
  absl::StatusOr<std::unique_ptr<Engine>> e = testing_util::MakeEngine(g, Tp(4, 1, 1));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("2 key-value heads"), std::string::npos) << e.status();
}

// The presets are the published shapes: parameter counts as transformers reports them.
TEST(LlamaModels, PresetsHaveThePublishedParameterCounts) {
  const std::vector<std::pair<std::string, int64_t>> want = {{"smollm2-135m", 134515008},
                                                             {"llama3-8b", 8030261248},
                                                             {"llama3-70b", 70553706496},
                                                             {"llama3-405b", 405853388800}};
  for (const auto& [preset, params] : want) {
    auto costs = PresetModelCosts(preset, 1);
    ASSERT_TRUE(costs.ok()) << costs.status();
    EXPECT_EQ(costs->UniqueParams(), params) << preset;
  }
  LlamaConfig bad;
  bad.kv_heads = 3;  // 4 heads
  EXPECT_NE(CheckLlamaConfig(bad, "x").message().find("kv_heads=3"), std::string::npos);
  bad = LlamaConfig{};
  bad.hidden = 68;  // head dim 17: odd
  EXPECT_NE(CheckLlamaConfig(bad, "x").message().find("even"), std::string::npos);
  bad = LlamaConfig{};
  bad.layers = 100000;
  bad.hidden = 1 << 20;
  bad.heads = 1 << 10;
  bad.kv_heads = 1 << 10;
  bad.ffn = 1 << 23;
  EXPECT_NE(CheckLlamaConfig(bad, "x").message().find("overflow"), std::string::npos);
  EXPECT_FALSE(PresetGptConfig("llama-tiny").ok());
}

// The cost model's FLOPs against the 6 N D rule (Kaplan et al. 2020) and the Llama 3 paper's
// total: 3.8e25 FLOPs for 405B parameters on 15.6T tokens. The products are 6 N a token (the
// embedding's lookups aside); the attention core adds 12 T h a token and block (it counts the
// whole T x T square, as the kernels compute it), 8% at T = 8192.
TEST(LlamaModels, FlopsFollowSixNDAndTheLlama3PaperTotal) {
  auto costs = PresetModelCosts("llama3-405b", 1);
  ASSERT_TRUE(costs.ok()) << costs.status();
  const double tokens = static_cast<double>(costs->seq_len);  // one sequence
  double total = 0, attention = 0;
  int blocks = 0;
  for (const LayerCost& l : costs->layers) {
    total += l.forward_flops + l.backward_flops;
    if (l.kind == "llama_block") ++blocks;
  }
  const LlamaConfig c = *PresetLlamaConfig("llama3-405b");
  attention = 12.0 * tokens * tokens * static_cast<double>(c.hidden) * blocks;
  const double n = static_cast<double>(costs->UniqueParams());
  const double embedding = static_cast<double>(c.vocab * c.hidden);  // looked up, not multiplied
  const double per_token = total / tokens;
  const double six_n = 6 * (n - embedding);
  EXPECT_NEAR((total - attention) / tokens / six_n, 1.0, 0.01) << per_token / six_n;
  const double run = per_token * 15.6e12;
  std::printf("llama3-405b: %.4g FLOPs a token (6N = %.4g); 15.6T tokens: %.3g FLOPs\n", per_token,
              6 * n, run);
  EXPECT_NEAR(6 * n * 15.6e12 / 3.8e25, 1.0, 0.01) << "the published total is 6 N D";
  EXPECT_GT(run / 3.8e25, 1.0);
  EXPECT_LT(run / 3.8e25, 1.1) << "attention at T = 8192 adds under 10%";
}

// Model specs: any shape by its name, which rebuilds it (checkpoints and plans record only it).
TEST(LlamaModels, SpecsBuildAnyShapeAndTheirNameRebuildsIt) {
  auto g = ModelFromSpec("llama:layers=3,hidden=48,heads=6,kv_heads=2,ffn=96,seq=16,vocab=300", 2);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->name(),
            "llama:layers=3,hidden=48,heads=6,kv_heads=2,ffn=96,seq=16,vocab=300,tied=0,"
            "rope_theta=10000");
  EXPECT_EQ(g->num_layers(), 3 + 4);
  auto again = ModelFromSpec(g->name(), 2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->Fingerprint(), g->Fingerprint());
  auto gpt = ModelFromSpec("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=256,tied=0", 1);
  ASSERT_TRUE(gpt.ok()) << gpt.status();
  EXPECT_TRUE(GptConfigOf(*gpt).ok());
  EXPECT_EQ(ModelFromSpec("llama-tiny", 0)->Fingerprint(),
            PresetModel("llama-tiny", 0)->Fingerprint())
      << "a preset name is a spec too";
  // kv_heads defaults to heads (multi-head); tied and rope_theta are read.
  auto c = ParseLlamaSpec("layers=1,hidden=8,heads=2,ffn=8,seq=4,vocab=9,tied=1,rope_theta=5e5");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->kv_heads, 2);
  EXPECT_TRUE(c->tied);
  EXPECT_EQ(c->rope_theta, 500000);
  for (const auto& [spec, word] : std::vector<std::pair<std::string, std::string>>{
           {"layers=1,hidden=8,heads=2,seq=4,vocab=9", "missing ffn"},
           {"layers=1,hidden=8,heads=2,ffn=8,seq=4,vocab=9,heads=2", "heads given twice"},
           {"layers=1,hidden=8,heads=2,ffn=8,seq=4,vocab=9,bias=1", "unknown key 'bias'"},
           {"layers=x,hidden=8,heads=2,ffn=8,seq=4,vocab=9", "layers='x' is not an integer"},
           {"layers=1,hidden=8,heads=2,ffn=8,seq=4,vocab=9,tied=2", "tied=2"},
           {"layers=1,hidden=8,heads=2,kv_heads=3,ffn=8,seq=4,vocab=9", "kv_heads=3"},
           {"layers=1,hidden=8,heads=2,ffn=8,seq=4,vocab=9,rope_theta=nan", "rope_theta"},
           {"layers=2147483648,hidden=8,heads=2,ffn=8,seq=4,vocab=9", "layers=2147483648"},
           {"", "empty"}}) {
    auto bad = ParseLlamaSpec(spec);
    ASSERT_FALSE(bad.ok()) << spec;
    EXPECT_NE(bad.status().message().find(word), std::string::npos) << bad.status();
  }
  EXPECT_FALSE(ModelFromSpec("llama:", 1).ok());
  EXPECT_FALSE(ModelFromSpec("no-such-preset", 1).ok());
}

}  // namespace
}  // namespace pipewright
