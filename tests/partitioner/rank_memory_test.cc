// PredictRankMemory: the partitioner's per-stage memory model summed per rank for any schedule
// (what the runtime checks a run against before it allocates), and its saturating arithmetic.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/partitioner.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"

namespace pipewright {
namespace {

LayerCost Layer(const std::string& name, int64_t params, int64_t saved, int64_t out) {
  LayerCost l;
  l.name = name;
  l.kind = "test";
  l.params = params;
  l.forward_flops = 1e9;
  l.backward_flops = 2e9;
  l.activation_bytes = saved;
  l.output_bytes = out;
  return l;
}

// Eight layers, the last one tied to the first (an LM head sharing the embedding's weights), with
// a selective saving on the middle ones.
ModelCosts TiedModel() {
  ModelCosts m;
  m.name = "tied";
  m.fingerprint = "sha256:test";
  m.input_bytes = 512;
  m.layers.push_back(Layer("embed", 4000, 1000, 2048));
  for (int i = 1; i < 7; ++i) {
    LayerCost l = Layer("block" + std::to_string(i), 1000 * i, 3000 + 100 * i, 2048);
    l.selective_saving_bytes = 1000;
    m.layers.push_back(l);
  }
  LayerCost head = Layer("head", 4000, 5000, 4);
  head.tied_to = "embed";
  m.layers.push_back(head);
  return m;
}

void ExpectSameMemory(const StageMemory& got, const StageMemory& want, const std::string& what) {
  EXPECT_EQ(got.params, want.params) << what;
  EXPECT_EQ(got.grads, want.grads) << what;
  EXPECT_EQ(got.optimizer, want.optimizer) << what;
  EXPECT_EQ(got.activations, want.activations) << what;
  EXPECT_EQ(got.total, want.total) << what;
}

// For every schedule, precision, recompute choice and ZeRO setting: each rank's prediction is the
// sum of the plan's stages on that rank (Predict's numbers, tied copies linked within a rank).
TEST(RankMemory, SumsThePlansStagesOnEachRank) {
  const ModelCosts model = TiedModel();
  struct Case {
    ScheduleKind kind;
    int pp, dp, chunks, m, zero;
    Precision precision;
    Recompute recompute;
  };
  const Case cases[] = {
      {ScheduleKind::kGpipe, 2, 1, 1, 4, 0, Precision::kFp32, Recompute::kNone},
      {ScheduleKind::k1F1B, 4, 1, 1, 8, 0, Precision::kBf16, Recompute::kFull},
      {ScheduleKind::kInterleaved, 2, 1, 2, 4, 0, Precision::kFp32, Recompute::kSelective},
      {ScheduleKind::kZbV, 2, 2, 2, 4, 1, Precision::kFp32, Recompute::kNone},
      {ScheduleKind::kZbH1, 2, 2, 1, 4, 1, Precision::kFp16, Recompute::kSelective},
      {ScheduleKind::k1F1B, 2, 4, 1, 4, 2, Precision::kBf16, Recompute::kNone},
      {ScheduleKind::kInterleaved, 2, 2, 2, 4, 2, Precision::kFp32, Recompute::kFull},
  };
  for (const Case& c : cases) {
    const std::string what = absl::StrCat(ScheduleKindName(c.kind), " pp=", c.pp, " dp=", c.dp);
    absl::StatusOr<Schedule> sched = GenerateSchedule({c.kind, c.pp, c.m, c.chunks});
    ASSERT_TRUE(sched.ok()) << what << ": " << sched.status();
    const int S = sched->num_stages;
    Plan plan;
    plan.model_name = model.name;
    plan.num_layers = model.num_layers();
    plan.pipeline_parallel = c.pp;
    plan.data_parallel = c.dp;
    plan.zero = c.zero;
    plan.schedule = sched->spec;
    plan.micro_batch_size = 1;
    std::vector<int> bounds = {0};
    std::vector<Recompute> recompute;
    for (int k = 0; k < S; ++k) {
      PlanStage st;
      st.index = k;
      st.begin = bounds.back();
      st.end = k == S - 1 ? model.num_layers() : st.begin + 1;
      st.recompute = c.recompute;
      bounds.push_back(st.end);
      recompute.push_back(c.recompute);
      plan.stages.push_back(st);
    }
    ASSERT_TRUE(Predict(model, DeviceSpec{}, c.precision, plan).ok()) << what;
    absl::StatusOr<std::vector<RankMemory>> ranks = PredictRankMemory(
        model, *sched, bounds, recompute, BytesPerParam(c.precision), ZeroSharding{c.zero, c.dp});
    ASSERT_TRUE(ranks.ok()) << what << ": " << ranks.status();
    ASSERT_EQ(static_cast<int>(ranks->size()), c.pp) << what;
    const std::vector<int> held = PeakInflightPerStage(*sched);
    int64_t peak = 0;
    for (const RankMemory& r : *ranks) {
      StageMemory want;
      std::vector<int> stages, want_held;
      for (const PlanStage& st : plan.stages) {
        if (st.rank != r.rank) continue;
        stages.push_back(st.index);
        want_held.push_back(held[st.index]);
        want.params += st.memory.params;
        want.grads += st.memory.grads;
        want.optimizer += st.memory.optimizer;
        want.activations += st.memory.activations;
        want.total += st.memory.total;
      }
      EXPECT_EQ(r.stages, stages) << what << " rank " << r.rank;
      EXPECT_EQ(r.held, want_held) << what << " rank " << r.rank;
      ExpectSameMemory(r.memory, want, absl::StrCat(what, " rank ", r.rank));
      peak = std::max(peak, r.memory.total);
    }
    EXPECT_EQ(peak, plan.predicted.peak_memory_bytes) << what;
  }
}

// The tied head on the embedding's rank (a V schedule puts the first and last stage on rank 0)
// holds its gradient only; on another rank it is a full copy.
TEST(RankMemory, TiedCopyOnTheOwnersRankHoldsItsGradientOnly) {
  const ModelCosts model = TiedModel();
  absl::StatusOr<Schedule> v = GenerateSchedule({ScheduleKind::kZbV, 2, 4, 2});
  absl::StatusOr<Schedule> one = GenerateSchedule({ScheduleKind::k1F1B, 2, 4, 1});
  ASSERT_TRUE(v.ok() && one.ok());
  const std::vector<int> v_bounds = {0, 2, 4, 6, 8}, one_bounds = {0, 4, 8};
  auto rv = PredictRankMemory(model, *v, v_bounds, std::vector<Recompute>(4, Recompute::kNone),
                              BytesPerParam(Precision::kFp32));
  auto r1 = PredictRankMemory(model, *one, one_bounds, std::vector<Recompute>(2, Recompute::kNone),
                              BytesPerParam(Precision::kFp32));
  ASSERT_TRUE(rv.ok() && r1.ok());
  ASSERT_EQ((*rv)[0].stages, (std::vector<int>{0, 3}));
  // Rank 0 of zb-v holds layers [0, 2) and [6, 8): 4000 + 1000 + 6000 + 4000 parameters, of
  // which the head's 4000 share the embedding's weights.
  EXPECT_EQ((*rv)[0].memory.grads, 4 * 15000);
  EXPECT_EQ((*rv)[0].memory.params, 4 * 11000);
  EXPECT_EQ((*rv)[0].memory.optimizer, 8 * 11000);
  // 1f1b's rank 1 holds the head without the embedding: a full copy.
  EXPECT_EQ((*r1)[1].memory.params, 4 * (4000 + 5000 + 6000 + 4000));
}

// Byte counts that overflow int64 saturate at kMemoryOverflow: never a wrapped, small number.
TEST(RankMemory, SaturatesInsteadOfOverflowing) {
  ModelCosts model;
  model.name = "huge";
  model.fingerprint = "sha256:test";
  model.input_bytes = 8;
  model.layers.push_back(Layer("a", 10, int64_t{1} << 61, 8));
  model.layers.push_back(Layer("b", 10, int64_t{1} << 61, 8));
  absl::StatusOr<Schedule> sched = GenerateSchedule({ScheduleKind::kGpipe, 1, 4, 1});
  ASSERT_TRUE(sched.ok());
  auto ranks =
      PredictRankMemory(model, *sched, {0, 2}, {Recompute::kNone}, BytesPerParam(Precision::kFp32));
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  EXPECT_EQ((*ranks)[0].memory.activations, kMemoryOverflow);  // 4 x 2^62
  EXPECT_EQ((*ranks)[0].memory.total, kMemoryOverflow);
  EXPECT_EQ((*ranks)[0].memory.params, 80);
  // With full recomputation it is 4 x 8 bytes of inputs plus the one micro-batch's 2^62.
  auto full =
      PredictRankMemory(model, *sched, {0, 2}, {Recompute::kFull}, BytesPerParam(Precision::kFp32));
  ASSERT_TRUE(full.ok());
  EXPECT_EQ((*full)[0].memory.activations, (int64_t{1} << 62) + 32);
  // The partitioner refuses it as too big, naming the overflow.
  PartitionOptions o;
  o.schedule = ScheduleKind::kGpipe;
  o.micro_batches = 4;
  o.allow_recompute = false;
  o.suggest = false;
  DeviceSpec dev;
  dev.memory_bytes = int64_t{1} << 62;
  absl::StatusOr<Plan> plan = Partition(model, dev, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("overflows 64 bits"), std::string::npos) << plan.status();
}

TEST(RankMemory, ASplitThatDoesNotFitTheScheduleIsAnError) {
  const ModelCosts model = TiedModel();
  absl::StatusOr<Schedule> sched = GenerateSchedule({ScheduleKind::k1F1B, 2, 4, 1});
  ASSERT_TRUE(sched.ok());
  const ParamBytes pb = BytesPerParam(Precision::kFp32);
  const std::vector<Recompute> none(2, Recompute::kNone);
  EXPECT_EQ(PredictRankMemory(model, *sched, {0, 8}, none, pb).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PredictRankMemory(model, *sched, {0, 4, 4}, none, pb).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PredictRankMemory(model, *sched, {0, 4, 7}, none, pb).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PredictRankMemory(model, *sched, {0, 4, 8}, {Recompute::kNone}, pb).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      PredictRankMemory(model, *sched, {0, 4, 8}, none, pb, ZeroSharding{1, 0}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(PredictRankMemory(model, *sched, {0, 4, 8}, none, pb).ok());
}

}  // namespace
}  // namespace pipewright
