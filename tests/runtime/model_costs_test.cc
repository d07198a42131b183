// The analytic and profiled cost model: GPT layer graphs against the published parameter and
// FLOP formulas of Narayanan et al. 2021, ParseGptSpec, ties, ToModelCosts, micro-batch
// scaling, and ProfileModel.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "pipewright/model.h"
#include "pipewright/plan.h"

namespace pipewright {
namespace {

// The formulas, written out here rather than taken from the library so that a wrong preset
// or a wrong layer cost cannot agree with itself.
double PaperParams(double l, double h, double s, double v) {
  return 12 * l * h * h + 13 * l * h + (v + s) * h;
}
double PaperForwardFlopsPerSequence(double l, double h, double s, double v) {
  return 24 * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h));
}

double ForwardFlops(const ModelCosts& m) {
  double f = 0;
  for (const LayerCost& l : m.layers) f += l.forward_flops;
  return f;
}

struct PublishedModel {
  const char* preset;
  int64_t heads, hidden, layers;
  double published_billions;  // as printed in the paper: rounded to 0.1B
};

// Narayanan et al. 2021, Table 1 (all sequence 2048, vocabulary 51200), and GPT-3.
const PublishedModel kTable1[] = {
    {"megatron-1.7b", 24, 2304, 24, 1.7},        {"megatron-3.6b", 32, 3072, 30, 3.6},
    {"megatron-7.5b", 32, 4096, 36, 7.5},        {"megatron-18.4b", 48, 6144, 40, 18.4},
    {"megatron-39.1b", 64, 8192, 48, 39.1},      {"megatron-76.1b", 80, 10240, 60, 76.1},
    {"megatron-145.6b", 96, 12288, 80, 145.6},   {"megatron-310.1b", 128, 16384, 96, 310.1},
    {"megatron-529.6b", 128, 20480, 105, 529.6}, {"megatron-1t", 160, 25600, 128, 1008.0},
    {"gpt3-175b", 96, 12288, 96, 174.6},
};

TEST(ModelCostsTest, PresetsMatchTable1Configurations) {
  for (const PublishedModel& p : kTable1) {
    absl::StatusOr<GptConfig> c = PresetGptConfig(p.preset);
    ASSERT_TRUE(c.ok()) << p.preset << ": " << c.status();
    EXPECT_EQ(c->heads, p.heads) << p.preset;
    EXPECT_EQ(c->hidden, p.hidden) << p.preset;
    EXPECT_EQ(c->layers, p.layers) << p.preset;
    EXPECT_EQ(c->seq, 2048) << p.preset;
    EXPECT_EQ(c->vocab, 51200) << p.preset;
    EXPECT_TRUE(c->tied) << p.preset;
  }
}

TEST(ModelCostsTest, PublishedParameterCounts) {
  for (const PublishedModel& p : kTable1) {
    absl::StatusOr<ModelCosts> m = PresetModelCosts(p.preset, 0);
    ASSERT_TRUE(m.ok()) << p.preset << ": " << m.status();
    const double ours = static_cast<double>(m->UniqueParams());
    // Within the rounding of the published one-decimal billions.
    EXPECT_LE(std::abs(ours / 1e9 - p.published_billions), 0.05 + 1e-9) << p.preset << ": " << ours;
    // The formula omits only the final LayerNorm's scale and shift (2h).
    const double formula = PaperParams(p.layers, p.hidden, 2048, 51200);
    EXPECT_LT(std::abs(ours - formula) / formula, 1e-4) << p.preset;
    EXPECT_EQ(ours - formula, 2.0 * p.hidden) << p.preset;
  }
}

TEST(ModelCostsTest, Gpt3From175bSpec) {
  absl::StatusOr<GptConfig> c =
      ParseGptSpec("layers=96,hidden=12288,heads=96,seq=2048,vocab=51200");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->tied);  // tied is the default for --gpt
  absl::StatusOr<ModelCosts> m = GptModelCosts("gpt3", *c, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_NEAR(m->UniqueParams() / 1e9, 174.6, 0.05);
  EXPECT_EQ(m->num_layers(), 96 + 4);
  EXPECT_NEAR(ForwardFlops(*m), PaperForwardFlopsPerSequence(96, 12288, 2048, 51200),
              0.02 * PaperForwardFlopsPerSequence(96, 12288, 2048, 51200));
}

// Our forward FLOPs per sequence exceed the formula's by exactly the terms it leaves out:
//   * per block 5·a·s² (causal mask, softmax and scaling of the a·s² scores) and 58·s·h
//     (two LayerNorms 16sh, GELU on the 4h hidden 40sh, two residual adds 2sh);
//   * the embedding's s·h additions, the final LayerNorm's 8sh and the loss's 5sV;
//   * the LM head's full 2·s·V·h, where the formula's V/16lh term gives 1.5·s·V·h (the paper
//     divides a forward + 2x backward head by the 4 passes of a recomputed transformer).
// The 2% tolerance holds for every analytic preset; the largest gap is megatron-1.7b (~1.85%).
TEST(ModelCostsTest, ForwardFlopsWithinTwoPercentOfFormula) {
  for (const PublishedModel& p : kTable1) {
    for (int64_t b : {1, 4}) {
      absl::StatusOr<ModelCosts> m = PresetModelCosts(p.preset, b);
      ASSERT_TRUE(m.ok()) << p.preset << ": " << m.status();
      const double l = p.layers, h = p.hidden, a = p.heads, s = 2048, v = 51200;
      const double ours = ForwardFlops(*m) / b;
      const double formula = PaperForwardFlopsPerSequence(l, h, s, v);
      EXPECT_LT(std::abs(ours - formula) / formula, 0.02) << p.preset << " b=" << b;
      const double extra =
          l * (5 * a * s * s + 58 * s * h) + 9 * s * h + 0.5 * s * v * h + 5 * s * v;
      EXPECT_NEAR(ours - formula, extra, 1e-9 * formula) << p.preset << " b=" << b;
    }
  }
}

TEST(ModelCostsTest, ParseGptSpecGood) {
  absl::StatusOr<GptConfig> c = ParseGptSpec("layers=2,hidden=64,heads=4,seq=16,vocab=100");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layers, 2);
  EXPECT_EQ(c->hidden, 64);
  EXPECT_EQ(c->heads, 4);
  EXPECT_EQ(c->seq, 16);
  EXPECT_EQ(c->vocab, 100);
  EXPECT_TRUE(c->tied);

  // Any key order, spaces around items, and an explicit tie.
  c = ParseGptSpec("vocab=100, seq=16 ,heads=4,hidden=64,layers=2,tied=0");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab, 100);
  EXPECT_EQ(c->layers, 2);
  EXPECT_FALSE(c->tied);
  c = ParseGptSpec("layers=2,hidden=64,heads=4,seq=16,vocab=100,tied=1");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->tied);
}

TEST(ModelCostsTest, ParseGptSpecBad) {
  const std::string ok = "hidden=64,heads=4,seq=16,vocab=100";
  struct Case {
    std::string spec, must_mention;
  };
  const std::vector<Case> cases = {
      {"", "empty"},
      {ok, "layers"},                                   // missing
      {"layers=2,heads=4,seq=16,vocab=100", "hidden"},  // missing
      {"layers=2," + ok + ",layers=3", "layers"},       // duplicate
      {"layers=two," + ok, "layers"},                   // not an integer
      {"layers=2.5," + ok, "layers"},
      {"layers=," + ok, "layers"},
      {"layers=0," + ok, "layers"},  // < 1
      {"layers=2,hidden=64,heads=-4,seq=16,vocab=100", "heads"},
      {"layers=2,hidden=64,heads=4,seq=0,vocab=100", "seq"},
      {"layers=2,hidden=64,heads=4,seq=16,vocab=0", "vocab"},
      {"layers=2," + ok + ",depth=3", "depth"},  // unknown key
      {"layers=2," + ok + ",tied=2", "tied"},
      {"layers=2," + ok + ",tied=yes", "tied"},
      {"layers=2,hidden=64,heads=5,seq=16,vocab=100", "heads"},  // 64 % 5 != 0
      {"layers 2," + ok, "key=value"},
      {"layers=2,," + ok, "key=value"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<GptConfig> r = ParseGptSpec(c.spec);
    ASSERT_FALSE(r.ok()) << "'" << c.spec << "' parsed";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.spec;
    // Look past the "GPT spec '<spec>': " prefix, which echoes every key given.
    const std::string msg(r.status().message());
    const size_t prefix = msg.find("': ");
    const std::string why = prefix == std::string::npos ? msg : msg.substr(prefix + 3);
    EXPECT_NE(why.find(c.must_mention), std::string::npos) << c.spec << ": " << msg;
  }
}

TEST(ModelCostsTest, TiedAndUntiedDifferByTheHead) {
  GptConfig c{.layers = 3, .hidden = 48, .heads = 4, .seq = 20, .vocab = 300, .tied = true};
  absl::StatusOr<ModelCosts> tied = GptModelCosts("t", c, 2);
  c.tied = false;
  absl::StatusOr<ModelCosts> untied = GptModelCosts("t", c, 2);
  ASSERT_TRUE(tied.ok()) << tied.status();
  ASSERT_TRUE(untied.ok()) << untied.status();
  EXPECT_EQ(untied->UniqueParams() - tied->UniqueParams(), 300 * 48);
  ASSERT_EQ(tied->num_layers(), untied->num_layers());
  for (int i = 0; i < tied->num_layers(); ++i) {
    const LayerCost& t = tied->layers[i];
    const LayerCost& u = untied->layers[i];
    EXPECT_EQ(t.params, u.params) << t.name;  // the tied head still holds its copy
    EXPECT_EQ(t.tied_to, t.name == "lm_head" ? "embed" : "") << t.name;
    EXPECT_EQ(u.tied_to, "") << u.name;
    if (t.name == "embed") {
      EXPECT_EQ(t.params, (300 + 20) * 48);  // token + position tables
    }
    if (t.name == "lm_head") {
      EXPECT_EQ(t.params, 300 * 48);  // no bias
    }
  }
  // The runnable presets keep the runtime's untied head; the analytic ones are tied.
  EXPECT_FALSE(PresetGptConfig("gpt-tiny")->tied);
  EXPECT_FALSE(PresetGptConfig("gpt-small")->tied);
  absl::StatusOr<ModelCosts> tiny = PresetModelCosts("gpt-tiny", 0);
  ASSERT_TRUE(tiny.ok());
  for (const LayerCost& l : tiny->layers) EXPECT_EQ(l.tied_to, "") << l.name;
  absl::StatusOr<ModelCosts> gpt3 = PresetModelCosts("gpt3-175b", 0);
  ASSERT_TRUE(gpt3.ok());
  EXPECT_EQ(gpt3->layers[gpt3->num_layers() - 2].tied_to, "embed");
}

TEST(ModelCostsTest, ToModelCostsEqualsTheGraphsNodeCosts) {
  absl::StatusOr<LayerGraph> g = PresetModel("gpt-tiny", 3);
  ASSERT_TRUE(g.ok());
  const ModelCosts m = ToModelCosts(*g);
  EXPECT_EQ(m.name, "gpt-tiny");
  EXPECT_EQ(m.fingerprint, g->Fingerprint());
  EXPECT_EQ(m.micro_batch_size, 3);
  EXPECT_EQ(m.seq_len, 32);
  EXPECT_EQ(m.input_bytes, 3 * 32 * 4);
  ASSERT_EQ(m.num_layers(), g->num_layers());
  for (int i = 0; i < g->num_layers(); ++i) {
    const LayerNode& n = g->node(i);
    const LayerCost& c = m.layers[i];
    EXPECT_EQ(c.name, n.name);
    EXPECT_EQ(c.kind, n.spec->kind());
    EXPECT_EQ(c.params, n.cost.params) << n.name;
    EXPECT_EQ(c.forward_flops, n.cost.forward_flops) << n.name;
    EXPECT_EQ(c.backward_flops, n.cost.backward_flops) << n.name;
    EXPECT_EQ(c.activation_bytes, n.cost.activation_bytes) << n.name;
    EXPECT_EQ(c.output_bytes, n.cost.output_bytes) << n.name;
    EXPECT_FALSE(c.forward_time_s.has_value());
    EXPECT_EQ(c.tied_to, "");
  }
  EXPECT_EQ(m.UniqueParams(), g->TotalCost().params);
  // GptModelCosts is the same graph, plus the tie.
  absl::StatusOr<ModelCosts> same = GptModelCosts("gpt-tiny", *PresetGptConfig("gpt-tiny"), 3);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->fingerprint, m.fingerprint);
  EXPECT_EQ(ForwardFlops(*same), ForwardFlops(m));
}

TEST(ModelCostsTest, WithMicroBatchSizeScalesFlopsAndBytesNotParams) {
  absl::StatusOr<ModelCosts> one = PresetModelCosts("megatron-1.7b", 1);
  absl::StatusOr<ModelCosts> four = PresetModelCosts("megatron-1.7b", 4);
  ASSERT_TRUE(one.ok() && four.ok());
  const ModelCosts scaled = one->WithMicroBatchSize(4);
  EXPECT_EQ(scaled.micro_batch_size, 4);
  EXPECT_EQ(scaled.input_bytes, four->input_bytes);
  EXPECT_EQ(scaled.UniqueParams(), one->UniqueParams());
  ASSERT_EQ(scaled.num_layers(), four->num_layers());
  for (int i = 0; i < scaled.num_layers(); ++i) {
    const LayerCost& s = scaled.layers[i];
    const LayerCost& f = four->layers[i];
    EXPECT_EQ(s.params, one->layers[i].params) << s.name;
    EXPECT_DOUBLE_EQ(s.forward_flops, 4 * one->layers[i].forward_flops) << s.name;
    EXPECT_DOUBLE_EQ(s.forward_flops, f.forward_flops) << s.name;
    EXPECT_DOUBLE_EQ(s.backward_flops, f.backward_flops) << s.name;
    EXPECT_EQ(s.activation_bytes, f.activation_bytes) << s.name;
    EXPECT_EQ(s.tied_to, f.tied_to) << s.name;
    if (s.kind != "cross_entropy") {  // the loss's output is one scalar whatever the batch
      EXPECT_EQ(s.output_bytes, f.output_bytes) << s.name;
    }
  }
}

TEST(ModelCostsTest, PresetsIncludeTheAnalyticModels) {
  std::vector<std::string> names = PresetNames();
  std::set<std::string> set(names.begin(), names.end());
  EXPECT_EQ(set.size(), names.size());
  for (const char* n : {"mlp", "gpt-tiny", "gpt-small"}) EXPECT_TRUE(set.count(n)) << n;
  for (const PublishedModel& p : kTable1) {
    EXPECT_TRUE(set.count(p.preset)) << p.preset;
    // Building the graph is analytic: even megatron-1t allocates nothing here.
    absl::StatusOr<LayerGraph> g = PresetModel(p.preset, 0);
    ASSERT_TRUE(g.ok()) << p.preset << ": " << g.status();
    EXPECT_EQ(g->shape().batch, 1) << p.preset;
    EXPECT_EQ(g->shape().seq_len, 2048) << p.preset;
    EXPECT_EQ(g->num_blocks(), p.layers) << p.preset;
  }
  EXPECT_EQ(PresetModel("gpt-tiny", 0)->shape().batch, 8);
  EXPECT_EQ(PresetGptConfig("mlp").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PresetGptConfig("gpt-huge").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PresetModelCosts("gpt-huge", 0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ModelCosts> mlp = PresetModelCosts("mlp", 0);
  ASSERT_TRUE(mlp.ok());
  EXPECT_EQ(mlp->UniqueParams(), PresetModel("mlp", 0)->TotalCost().params);
}

TEST(ModelCostsTest, OverflowingConfigIsRefused) {
  absl::StatusOr<GptConfig> c =
      ParseGptSpec("layers=1000000,hidden=4000000,heads=4,seq=8,vocab=10");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  GptConfig big{.layers = 1000000, .hidden = 4000000, .heads = 4, .seq = 8, .vocab = 10};
  EXPECT_EQ(GptModelCosts("big", big, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(GptModelCosts("x", *PresetGptConfig("gpt-tiny"), 0).ok());
}

TEST(ModelCostsTest, GptFieldsOutsideTheirRangesAreRefusedByName) {
  const GptConfig ok{.layers = 2, .hidden = 64, .heads = 4, .seq = 16, .vocab = 100};
  EXPECT_TRUE(CheckGptConfig(ok, "ok").ok());
  struct Case {
    const char* field;
    int64_t GptConfig::*member;
    int64_t max;
  };
  const Case cases[] = {{"layers", &GptConfig::layers, kMaxGptLayers},
                        {"hidden", &GptConfig::hidden, kMaxGptHidden},
                        {"heads", &GptConfig::heads, kMaxGptHidden},
                        {"seq", &GptConfig::seq, kMaxGptSeq},
                        {"vocab", &GptConfig::vocab, kMaxGptVocab}};
  for (const Case& c : cases) {
    for (int64_t v : {int64_t{0}, int64_t{-1}, c.max + 1, std::numeric_limits<int64_t>::max()}) {
      GptConfig bad = ok;
      bad.*c.member = v;
      absl::Status s = CheckGptConfig(bad, "ctx");
      ASSERT_FALSE(s.ok()) << c.field << "=" << v;
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      const std::string want = std::string("ctx: ") + c.field + "=" + std::to_string(v) +
                               " is out of range [1, " + std::to_string(c.max) + "]";
      EXPECT_EQ(std::string(s.message()), want);
    }
  }
  // The largest layer count is accepted; GptModel refuses the next without building anything
  // (a billion layer nodes would take gigabytes).
  GptConfig deep = ok;
  deep.layers = kMaxGptLayers;
  EXPECT_TRUE(CheckGptConfig(deep, "deep").ok());
  deep.layers = 1000000000;
  absl::StatusOr<LayerGraph> g = GptModel("deep", deep, 1);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("layers=1000000000 is out of range [1, 100000]"),
            std::string::npos)
      << g.status();
  // The micro-batch size is checked too.
  for (int64_t b : {int64_t{0}, kMaxGptMicroBatchSize + 1}) {
    absl::Status s = CheckGptConfig(ok, "ctx", b);
    ASSERT_FALSE(s.ok()) << b;
    EXPECT_NE(s.message().find("micro_batch_size=" + std::to_string(b)), std::string::npos) << s;
  }
  EXPECT_NE(ParseGptSpec("layers=100001,hidden=64,heads=4,seq=16,vocab=100")
                .status()
                .message()
                .find("layers=100001 is out of range [1, 100000]"),
            std::string::npos);
}

TEST(ModelCostsTest, GptCountsThatOverflowInt64AreRefused) {
  // Every field within its range, but 12 * layers * hidden^2 parameters (x 18 bytes) overflow.
  GptConfig wide{
      .layers = kMaxGptLayers, .hidden = kMaxGptHidden, .heads = 16, .seq = 8, .vocab = 10};
  absl::Status s = CheckGptConfig(wide, "wide");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("parameters"), std::string::npos) << s;
  EXPECT_NE(s.message().find("overflow 64-bit integers"), std::string::npos) << s;
  // The logits of a long sequence over a large vocabulary at a large micro-batch size.
  GptConfig wordy{.layers = 1, .hidden = 64, .heads = 4, .seq = kMaxGptSeq, .vocab = kMaxGptVocab};
  EXPECT_TRUE(CheckGptConfig(wordy, "wordy", 1).ok());
  s = CheckGptConfig(wordy, "wordy", kMaxGptMicroBatchSize);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("overflow 64-bit integers"), std::string::npos) << s;
  // The presets, at their default micro-batch sizes, are within every limit.
  for (const std::string& name : PresetNames()) {
    if (absl::StatusOr<GptConfig> c = PresetGptConfig(name); c.ok()) {
      EXPECT_TRUE(CheckGptConfig(*c, name).ok()) << name;
    }
  }
}

TEST(ModelCostsTest, ProfileGptTinyTimesEveryLayer) {
  absl::StatusOr<LayerGraph> g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok());
  absl::StatusOr<ModelCosts> m = ProfileModel(*g, 3, 7);
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelCosts analytic = ToModelCosts(*g);
  ASSERT_EQ(m->num_layers(), analytic.num_layers());
  for (int i = 0; i < m->num_layers(); ++i) {
    const LayerCost& l = m->layers[i];
    ASSERT_TRUE(l.forward_time_s.has_value()) << l.name;
    ASSERT_TRUE(l.backward_time_s.has_value()) << l.name;
    EXPECT_TRUE(std::isfinite(*l.forward_time_s) && *l.forward_time_s > 0) << l.name;
    EXPECT_TRUE(std::isfinite(*l.backward_time_s) && *l.backward_time_s > 0) << l.name;
    EXPECT_LT(*l.forward_time_s + *l.backward_time_s, 10.0) << l.name;
    EXPECT_EQ(l.forward_flops, analytic.layers[i].forward_flops) << l.name;  // costs kept
    EXPECT_EQ(l.params, analytic.layers[i].params) << l.name;
  }
  EXPECT_EQ(m->fingerprint, analytic.fingerprint);
  // The mlp preset (embedding, linears, GELUs, head, loss) profiles too.
  absl::StatusOr<ModelCosts> mlp = ProfileModel(*PresetModel("mlp", 1), 1, 0);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  for (const LayerCost& l : mlp->layers) EXPECT_TRUE(l.forward_time_s.has_value()) << l.name;
}

TEST(ModelCostsTest, ProfileRefusesLargeModelsAndBadReps) {
  // gpt3-175b: ~1.3 TiB of fp32 weights and gradients. Refused before any allocation (an
  // attempt would abort this test with an out-of-memory failure instead).
  absl::StatusOr<ModelCosts> r = ProfileModel(*PresetModel("gpt3-175b", 1), 1, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(r.status().message());
  const std::string bytes =
      std::to_string(int64_t{8} * PresetModel("gpt3-175b", 1)->TotalCost().params);
  EXPECT_NE(msg.find(bytes), std::string::npos) << msg;
  EXPECT_NE(msg.find("4 GiB"), std::string::npos) << msg;
  // Just over the limit of 4 GiB / 8 bytes = 2^29 parameters: 2 * 2^28 in the token table and
  // the head, plus the block.
  GptConfig over{.layers = 1, .hidden = 128, .heads = 1, .seq = 1, .vocab = (1 << 28) / 128};
  absl::StatusOr<LayerGraph> g = GptModel("over", over, 1);
  ASSERT_TRUE(g.ok());
  ASSERT_GT(g->TotalCost().params * 8, kProfileMemoryLimitBytes);
  EXPECT_EQ(ProfileModel(*g, 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ProfileModel(*PresetModel("gpt-tiny", 1), 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pipewright
