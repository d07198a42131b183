// Tied embeddings (Note [Tied parameters] in runtime/model.cc): the LM head's weight is the token
// embedding's, one tensor on one rank and two kept equal across ranks; pipelines of any depth
// and schedule are bit-identical to one stage, with and without data parallelism; checkpoints
// hold the weight once and resume under another layout.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "pipewright/checkpoint.h"
#include "pipewright/engine.h"
#include "pipewright/model.h"
#include "pipewright/partitioner.h"
#include "tests/runtime/engine_util.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

using testing_util::EngineSetup;
using testing_util::ExpectSameRun;
using testing_util::MakeEngine;
using testing_util::RunResult;
using testing_util::ToMap;

constexpr int kSteps = 3;
constexpr int64_t kMicroBatches = 8;

using testing_util::TiedTiny;
using testing_util::TiedTinyConfig;

RunResult Reference(int64_t micro_batches) {
  return testing_util::RunReference(TiedTiny(), micro_batches,
                                    testing_util::ParityTrainOptions(kSteps), kSteps);
}

EngineSetup Layout(int pp, int dp, ScheduleKind kind, int chunks, Recompute rc) {
  return testing_util::ParitySetup(pp, dp, kind, chunks, rc, kMicroBatches / dp, kSteps);
}

// Runs the engine; also checks that every rank's tied copy equals the embedding's weight.
RunResult RunEngine(const EngineSetup& o) {
  RunResult r;
  r = testing_util::RunSteps(TiedTiny(), o, kSteps, nullptr, [&](Engine& e) {
    const testing_util::WeightMap w = ToMap(e.Weights());
    for (int g = 0; g < o.pp * o.dp; ++g) {
      for (Parameter* p : e.RankParameters(g)) {
        if (p->tied_to.empty()) continue;
        EXPECT_EQ(p->value.ToVector(), w.at(p->tied_to)) << "rank " << g << " " << p->name;
      }
    }
  });
  return r;
}

TEST(TiedModel, OneTensorOnOneStageAndTheHeadStartsAsTheEmbedding) {
  const LayerGraph g = TiedTiny();
  EXPECT_EQ(g.node(g.num_layers() - 2).spec->tied_to(), "embed");
  EXPECT_EQ(g.node(g.num_layers() - 2).spec->tied_parameter(), "embed.wte.weight");
  auto whole = g.Instantiate(0, g.num_layers(), 7);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_EQ((*whole)->tied().size(), 1u);
  const TiedLink& link = (*whole)->tied()[0];
  EXPECT_EQ(link.copy->name, "lm_head.weight");
  EXPECT_EQ(link.owner->name, "embed.wte.weight");
  EXPECT_EQ(link.copy->value.raw(), link.owner->value.raw());  // one tensor
  for (Parameter* p : (*whole)->Parameters()) EXPECT_NE(p, link.copy);
  // The head alone (another stage) holds its own copy, initialised equal to the embedding.
  auto head = g.Instantiate(g.num_layers() - 2, g.num_layers(), 7);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_TRUE((*head)->tied().empty());
  std::vector<Parameter*> hp = (*head)->Parameters();
  ASSERT_EQ(hp.size(), 1u);
  EXPECT_EQ(hp[0]->tied_to, "embed.wte.weight");
  EXPECT_EQ(hp[0]->value.ToVector(), link.owner->value.ToVector());
  // The tie is part of the model's identity, and the untied model has 256 x 64 more weights.
  GptConfig untied = TiedTinyConfig();
  untied.tied = false;
  auto u = GptModel("gpt-tiny-tied", untied, 2);
  ASSERT_TRUE(u.ok());
  EXPECT_NE(u->Fingerprint(), g.Fingerprint());
  auto tc = GptModelCosts("t", TiedTinyConfig(), 2);
  auto uc = GptModelCosts("t", untied, 2);
  ASSERT_TRUE(tc.ok() && uc.ok());
  EXPECT_EQ(uc->UniqueParams() - tc->UniqueParams(), 256 * 64);
}

TEST(TiedModel, BuilderRejectsBadTies) {
  auto build = [](LayerSpecPtr head) {
    ModelBuilder b("m", {2, 8});
    b.Add("embed", layers::Embedding(16, 8, 4));
    b.Add("norm", layers::LayerNorm(4));
    b.Add("lm_head", std::move(head));
    b.Add("loss", layers::CrossEntropyLoss());
    return b.Build();
  };
  EXPECT_TRUE(build(layers::LmHead(4, 16, "embed")).ok());
  auto missing = build(layers::LmHead(4, 16, "wte"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("'wte' names no earlier layer"), std::string::npos)
      << missing.status();
  auto kind = build(layers::LmHead(4, 16, "norm"));
  ASSERT_FALSE(kind.ok());
  EXPECT_NE(kind.status().message().find("must name an embedding"), std::string::npos);
  auto vocab = build(layers::LmHead(4, 32, "embed"));
  ASSERT_FALSE(vocab.ok());
  EXPECT_NE(vocab.status().message().find("vocab is 32 where the embedding's is 16"),
            std::string::npos)
      << vocab.status();
}

struct TiedCase {
  int pp, dp;
  ScheduleKind kind;
  int chunks;
  Recompute recompute;
};

std::string CaseName(const testing::TestParamInfo<TiedCase>& info) {
  std::string k = ScheduleKindName(info.param.kind);
  for (char& c : k) {
    if (c == '-') c = '_';
  }
  return absl::StrCat("pp", info.param.pp, "_dp", info.param.dp, "_", k, "_v", info.param.chunks,
                      info.param.recompute == Recompute::kFull ? "_recompute" : "");
}

class TiedParityTest : public testing::TestWithParam<TiedCase> {};

// pp = k is bit-identical to one stage: the head and the embedding on one stage (pp 1), on one
// rank's two stages (zb-v, dualpipev: the V puts the first and last stage on rank 0) and on two
// ranks (1f1b, interleaved, zb-h1).
TEST_P(TiedParityTest, BitIdenticalToSingleStage) {
  const TiedCase& c = GetParam();
  if (c.dp > 1) {
    // dp = 2: the same global batch on two replicas; bit-identical to dp = 2 at pp = 1 (the
    // data-parallel sum comes before the tie's, at every depth).
    static const RunResult* ref =
        new RunResult(RunEngine(Layout(1, 2, ScheduleKind::k1F1B, 1, Recompute::kNone)));
    ExpectSameRun(RunEngine(Layout(c.pp, c.dp, c.kind, c.chunks, c.recompute)), *ref,
                  CaseName({c, 0}));
    return;
  }
  static const RunResult* ref = new RunResult(Reference(kMicroBatches));
  ASSERT_EQ(ref->losses.size(), static_cast<size_t>(kSteps));
  EXPECT_GT(ref->losses.front(), ref->losses.back());
  EXPECT_EQ(ref->weights.count("lm_head.weight"), 0u);
  ExpectSameRun(RunEngine(Layout(c.pp, c.dp, c.kind, c.chunks, c.recompute)), *ref,
                CaseName({c, 0}));
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, TiedParityTest,
    testing::Values(TiedCase{1, 1, ScheduleKind::k1F1B, 1, Recompute::kNone},
                    TiedCase{2, 1, ScheduleKind::k1F1B, 1, Recompute::kNone},
                    TiedCase{4, 1, ScheduleKind::kInterleaved, 2, Recompute::kFull},
                    TiedCase{4, 1, ScheduleKind::kZbH1, 1, Recompute::kNone},
                    TiedCase{2, 1, ScheduleKind::kZbV, 2, Recompute::kNone},
                    TiedCase{4, 1, ScheduleKind::kDualPipeV, 2, Recompute::kFull},
                    TiedCase{2, 2, ScheduleKind::k1F1B, 1, Recompute::kNone},
                    TiedCase{2, 2, ScheduleKind::kZbV, 2, Recompute::kNone}),
    CaseName);

// The tied weight costs one optimizer state on one rank: the untied model's rank holds
// 3 x V x C floats more (weight and two AdamW moments; the copy's gradient buffer is in both).
TEST(TiedModel, OneRankHoldsTheWeightOnce) {
  auto bytes = [](const LayerGraph& g) {
    EngineSetup o = Layout(1, 1, ScheduleKind::k1F1B, 1, Recompute::kNone);
    auto e = MakeEngine(g, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? (*e)->RankMemoryBytes(0) : int64_t{0};
  };
  GptConfig untied = TiedTinyConfig();
  untied.tied = false;
  auto u = GptModel("u", untied, 2);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(bytes(*u) - bytes(TiedTiny()), 3 * 256 * 64 * 4);
}

// The planner's memory model (docs/memory.md) counts the tie as the engine holds it: the
// predicted weights, gradients and optimizer state of each rank are its measured bytes, for
// the head on the embedding's stage, on another stage of its rank, and on another rank.
TEST(TiedModel, PredictedStaticMemoryIsWhatEachRankHolds) {
  const LayerGraph g = TiedTiny();
  const ModelCosts costs = ToModelCosts(g);
  ASSERT_EQ(costs.layers[g.num_layers() - 2].tied_to, "embed");
  for (const EngineSetup& o :
       std::vector<EngineSetup>{Layout(1, 1, ScheduleKind::k1F1B, 1, Recompute::kNone),
                                Layout(2, 1, ScheduleKind::k1F1B, 1, Recompute::kNone),
                                Layout(2, 1, ScheduleKind::kZbV, 2, Recompute::kNone)}) {
    PartitionOptions po;
    po.pp = o.pp;
    po.schedule = o.schedule;
    po.chunks = o.chunks;
    po.micro_batches = static_cast<int>(o.micro_batches);
    DeviceSpec dev;
    dev.count = o.pp;
    dev.memory_bytes = int64_t{1} << 40;
    auto plan = Partition(costs, dev, po);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<int64_t> predicted(o.pp, 0);
    EngineSetup run = o;
    run.stage_boundaries = {0};
    for (const PlanStage& st : plan->stages) {
      predicted[st.rank] += st.memory.params + st.memory.grads + st.memory.optimizer;
      run.stage_boundaries.push_back(st.end);
    }
    auto e = MakeEngine(g, run);
    ASSERT_TRUE(e.ok()) << e.status();
    for (int r = 0; r < o.pp; ++r) {
      EXPECT_EQ((*e)->RankMemoryBytes(r), predicted[r])
          << ScheduleKindName(o.schedule) << " pp " << o.pp << " rank " << r;
    }
  }
}

TEST(TiedModel, AsyncDpRefusesATieAcrossRanks) {
  EngineSetup o = Layout(2, 2, ScheduleKind::k1F1B, 1, Recompute::kNone);
  o.train.dp_mode = DpMode::kAsync;
  auto e = MakeEngine(TiedTiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("tied weight split across pipeline ranks"), std::string::npos)
      << e.status();
}

class TiedCheckpointTest : public testing_util::ScratchDirTest {};

// Saved at pp = 2 (the weight on both ends), resumed at pp = 1 (one tensor) and under zb-v (one
// rank's two stages): bit-identical to the run that was never interrupted. The checkpoint holds
// the weight once, under the embedding's name.
TEST_F(TiedCheckpointTest, HoldsTheWeightOnceAndResumesUnderAnyLayout) {
  EngineSetup o = Layout(2, 1, ScheduleKind::k1F1B, 1, Recompute::kNone);
  o.train.steps = 4;
  RunResult whole;
  {
    auto e = MakeEngine(TiedTiny(), o);
    ASSERT_TRUE(e.ok()) << e.status();
    for (int i = 0; i < 4; ++i) {
      auto s = (*e)->Step();
      ASSERT_TRUE(s.ok()) << s.status();
      whole.losses.push_back(s->result.loss);
    }
    whole.weights = ToMap((*e)->Weights());
  }
  {
    auto e = MakeEngine(TiedTiny(), o);
    ASSERT_TRUE(e.ok());
    for (int i = 0; i < 2; ++i) ASSERT_TRUE((*e)->Step().ok());
    ASSERT_TRUE((*e)->Save(Path("ck")).ok());
  }
  auto ck = ReadCheckpoint(Path("ck"));
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->model.count("embed.wte.weight"), 1u);
  EXPECT_EQ(ck->model.count("lm_head.weight"), 0u);
  EXPECT_EQ(ck->optimizer.count("exp_avg.lm_head.weight"), 0u);
  for (const EngineSetup& to :
       std::vector<EngineSetup>{Layout(1, 1, ScheduleKind::k1F1B, 1, Recompute::kNone),
                                Layout(2, 1, ScheduleKind::kZbV, 2, Recompute::kNone)}) {
    EngineSetup t = to;
    t.train.steps = 4;
    auto e = MakeEngine(TiedTiny(), t);
    ASSERT_TRUE(e.ok()) << e.status();
    absl::Status rs = (*e)->Resume(Path("ck"));
    ASSERT_TRUE(rs.ok()) << rs;
    for (int i = 2; i < 4; ++i) {
      auto s = (*e)->Step();
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(s->result.loss, whole.losses[i]) << "step " << i;
    }
    EXPECT_EQ(ToMap((*e)->Weights()), whole.weights);
  }
}

}  // namespace
}  // namespace pipewright
