// Selective recomputation (issue 17, part 3; Note [Selective recomputation] in
// runtime/layers/transformer.cc): the block's cost against Korthikanti et al.'s per-layer formula,
// bit-identity with keeping everything, the measured saving against the memory model, and the
// partitioner's choice among none, selective and full.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include "pipewright/engine.h"
#include "pipewright/model.h"
#include "pipewright/partitioner.h"
#include "tests/runtime/engine_util.h"

namespace pipewright {
namespace {

using testing_util::EngineSetup;
using testing_util::ExpectSameRun;
using testing_util::MakeEngine;
using testing_util::RunResult;
using testing_util::ToMap;

// Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
// equation (1): a block keeps sbh(34 + 5as/h) bytes — 2-byte activations with dropout; 11sbh +
// 5as²b for attention, 19sbh for the MLP, 4sbh for the two LayerNorms — and selective
// recomputation of the attention core leaves 34sbh. Here activations are fp32 (x 2), there is no
// dropout (minus the two 1-byte masks, sbh each, and the as²b softmax mask), and the attention is
// flash-style: its backward remakes the probabilities from q, k, v and the row log-sum-exp, so
// the paper's selective recomputation of the core is what every run does. That gives
// 2 x 32 sbh = 64 sbh, plus the log-sum-exp (4 abs) and the LayerNorms' mean and 1/std (2 x 8 bs).
// Our --recompute selective then drops the LayerNorm outputs (2 x 4 sbh) and the GELU output
// (16 sbh): 24 sbh, remade by two LayerNorm forwards (8 sbh FLOPs each) and a GELU (10 x 4 sbh).
TEST(SelectiveRecompute, BlockCostIsThePapersFormulaInFp32WithoutDropout) {
  for (const auto& [s, b, h, a] : std::vector<std::array<int64_t, 4>>{
           {32, 2, 64, 4}, {128, 8, 256, 8}, {1024, 1, 768, 12}, {2048, 1, 12288, 96}}) {
    auto g = GptModel("g", {.layers = 1, .hidden = h, .heads = a, .seq = s, .vocab = 256}, b);
    ASSERT_TRUE(g.ok()) << g.status();
    const Cost& c = g->node(1).cost;
    ASSERT_EQ(g->node(1).spec->kind(), "transformer_block");
    const int64_t paper_2byte_no_dropout = 34 * s * b * h - 2 * s * b * h;  // 5as²b: flash
    EXPECT_EQ(c.activation_bytes, 2 * paper_2byte_no_dropout + 4 * a * b * s + 16 * b * s)
        << "s=" << s << " b=" << b << " h=" << h << " a=" << a;
    EXPECT_EQ(c.selective_saving_bytes, 24 * s * b * h);
    EXPECT_DOUBLE_EQ(c.selective_recompute_flops, 2.0 * 8 * s * b * h + 10.0 * 4 * s * b * h);
    // 56 sbh FLOPs against the block's 24 sbh² + 4 bs²h: under 2.4 / h of its forward.
    EXPECT_LT(c.selective_recompute_flops / c.forward_flops, 2.4 / static_cast<double>(h));
  }
}

EngineSetup Layout(int pp, ScheduleKind kind, int chunks, Recompute rc) {
  return testing_util::ParitySetup(pp, 1, kind, chunks, rc, /*micro_batches=*/8, /*steps=*/3);
}

RunResult Train(const EngineSetup& o, int64_t* peak_activations = nullptr) {
  std::vector<StepReport> reports;
  RunResult r = testing_util::RunSteps(testing_util::Tiny(), o, o.train.steps, &reports);
  for (const StepReport& s : reports) {
    for (const RankTimes& t : s.ranks) {
      if (peak_activations != nullptr) {
        *peak_activations = std::max(*peak_activations, t.peak_activation_bytes);
      }
    }
  }
  return r;
}

// The remade tensors are the dropped ones bit for bit, so the run is the run that kept them:
// fused (B) and split (I, W) backwards, one and two chunks, fp32 and bf16.
TEST(SelectiveRecompute, BitIdenticalToKeepingEverything) {
  struct Case {
    int pp;
    ScheduleKind kind;
    int chunks;
    Precision precision;
  };
  for (const Case& c : {Case{1, ScheduleKind::k1F1B, 1, Precision::kFp32},
                        Case{2, ScheduleKind::k1F1B, 1, Precision::kFp32},
                        Case{4, ScheduleKind::kZbH1, 1, Precision::kFp32},
                        Case{2, ScheduleKind::kInterleaved, 2, Precision::kFp32},
                        Case{2, ScheduleKind::k1F1B, 1, Precision::kBf16}}) {
    EngineSetup keep = Layout(c.pp, c.kind, c.chunks, Recompute::kNone);
    keep.train.precision = c.precision;
    EngineSetup sel = keep;
    sel.recompute = Recompute::kSelective;
    const RunResult want = Train(keep);
    ASSERT_EQ(want.losses.size(), 3u);
    EXPECT_GT(want.losses.front(), want.losses.back());
    ExpectSameRun(
        Train(sel), want,
        absl::StrCat(ScheduleKindName(c.kind), " pp ", c.pp, " ", PrecisionName(c.precision)));
  }
}

// The peak activation bytes drop by what the memory model says selective saves: the held
// micro-batches' LayerNorm and GELU outputs, less at most one layer's remade tensors (the model
// counts all of them; the backward frees each as soon as its product's weight gradient has run,
// Note [Backward by layer], so fewer may be live at the peak).
TEST(SelectiveRecompute, MeasuredSavingIsThePredictedOne) {
  const LayerGraph g = testing_util::Tiny();
  const EngineSetup none = Layout(1, ScheduleKind::kGpipe, 1, Recompute::kNone);
  EngineSetup sel = none;
  sel.recompute = Recompute::kSelective;
  int64_t peak_none = 0, peak_sel = 0;
  Train(none, &peak_none);
  Train(sel, &peak_sel);
  ASSERT_GT(peak_none, 0);
  int64_t saving = 0, largest = 0;
  for (const LayerNode& n : g.nodes()) {
    saving += n.cost.selective_saving_bytes;
    largest = std::max(largest, n.cost.selective_saving_bytes);
  }
  const int64_t predicted = 8 * saving - largest;  // gpipe holds all 8 micro-batches
  const int64_t measured = peak_none - peak_sel;
  EXPECT_GT(measured, 0);
  EXPECT_GE(measured, predicted) << "none " << peak_none << " selective " << peak_sel;
  EXPECT_LE(measured, predicted + largest) << "none " << peak_none << " selective " << peak_sel;
  std::printf("peak activations: none %lld, selective %lld; saving measured %lld, predicted %lld\n",
              static_cast<long long>(peak_none), static_cast<long long>(peak_sel),
              static_cast<long long>(measured), static_cast<long long>(predicted));
}

// With a device between what selective and none need, the partitioner recomputes selectively
// (cheaper than full), and the plan says so.
TEST(SelectiveRecompute, PartitionerPicksItWhereItIsEnough) {
  const ModelCosts costs = ToModelCosts(testing_util::Tiny());
  PartitionOptions o;
  o.pp = 2;
  o.schedule = ScheduleKind::kGpipe;
  o.micro_batches = 8;
  DeviceSpec dev;
  dev.count = 2;
  dev.memory_bytes = int64_t{1} << 40;
  auto roomy = Partition(costs, dev, o);
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  int64_t need = 0;
  for (const PlanStage& s : roomy->stages) {
    EXPECT_EQ(s.recompute, Recompute::kNone);
    need = std::max(need, s.memory.total);
  }
  dev.memory_bytes = need - 1;  // none no longer fits on the larger stage; selective does
  auto tight = Partition(costs, dev, o);
  ASSERT_TRUE(tight.ok()) << tight.status();
  bool selective = false;
  for (const PlanStage& s : tight->stages) {
    EXPECT_NE(s.recompute, Recompute::kFull);
    selective = selective || s.recompute == Recompute::kSelective;
  }
  EXPECT_TRUE(selective);
  auto back = PlanFromJson(PlanToJson(*tight));
  ASSERT_TRUE(back.ok()) << back.status();
  for (size_t k = 0; k < tight->stages.size(); ++k) {
    EXPECT_EQ(back->stages[k].recompute, tight->stages[k].recompute);
  }
  EXPECT_EQ(ParseRecompute("selective").value(), Recompute::kSelective);
  EXPECT_FALSE(ParseRecompute("partial").ok());
}

}  // namespace
}  // namespace pipewright
