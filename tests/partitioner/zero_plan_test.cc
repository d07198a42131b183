// ZeRO in the planner (docs/memory.md, "Memory of a stage" and "Predicted step time"): ZeRO-2's
// gradient shard and in-flight buckets, the data-parallel traffic of ZeRO 0, 1 and 2 and its
// place in the step time, the plan search's choice, the checks of `zero` and its plan JSON.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipewright/partitioner.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"

namespace pipewright {
namespace {

constexpr int64_t kMB = 1000 * 1000;

// `layers` equal layers of `params` parameters each, with small activations and messages, so
// the weights, gradients and optimizer state decide what fits.
ModelCosts BigParamsModel(int layers, int64_t params) {
  ModelCosts m;
  m.name = "big-params";
  m.fingerprint = "sha256:zero";
  m.micro_batch_size = 1;
  m.seq_len = 1;
  m.input_bytes = 1000;
  for (int i = 0; i < layers; ++i) {
    LayerCost l;
    l.name = absl::StrCat("l", i);
    l.kind = "test";
    l.params = params;
    l.forward_flops = 1e9;
    l.backward_flops = 2e9;
    l.activation_bytes = 1000;
    l.output_bytes = 1000;
    m.layers.push_back(l);
  }
  return m;
}

DeviceSpec Devices(int count, int64_t memory) {
  DeviceSpec d;
  d.count = count;
  d.memory_bytes = memory;
  d.tflops = 1;
  d.layer_overhead_s = 0;
  d.link_bandwidth = 1e9;
  d.link_latency_s = 1e-5;
  return d;
}

PartitionOptions Options(int pp, int dp, int zero, int micro_batches) {
  PartitionOptions o;
  o.pp = pp;
  o.dp = dp;
  o.zero = zero;
  o.schedule = ScheduleKind::k1F1B;
  o.micro_batches = micro_batches;
  o.micro_batch_size = 1;
  return o;
}

// ---------------------------------------------------------------------------------------------
// Memory.

TEST(ZeroSharding, GradientsAreTheShardPlusAtMostTwoBucketsInFlight) {
  const int64_t bucket = int64_t{1} << 20;
  const int64_t stage = 40 * kMB + 3;  // not a multiple of dp: the share rounds up
  for (int dp : {2, 4, 8}) {
    const ZeroSharding z2{2, dp, bucket};
    const int64_t share = stage / dp + 1;
    EXPECT_EQ(z2.GradientBytes(stage), share + 2 * bucket) << dp;
    EXPECT_GE(z2.GradientBytes(stage), stage / dp) << dp;
    EXPECT_LE(z2.GradientBytes(stage) - share, 2 * bucket) << dp;
    EXPECT_EQ(z2.OptimizerBytes(stage), share) << "ZeRO-2 splits the optimizer state as 1 does";
    // ZeRO 0 and 1 keep every gradient.
    EXPECT_EQ((ZeroSharding{0, dp, bucket}.GradientBytes(stage)), stage);
    EXPECT_EQ((ZeroSharding{1, dp, bucket}.GradientBytes(stage)), stage);
    EXPECT_EQ((ZeroSharding{1, dp, bucket}.OptimizerBytes(stage)), share);
    EXPECT_EQ((ZeroSharding{0, dp, bucket}.OptimizerBytes(stage)), stage);
  }
  // A stage smaller than two buckets has at most its whole gradient in flight.
  EXPECT_EQ((ZeroSharding{2, 4, bucket}.GradientBytes(1000)), 250 + 1000);
  // The bucket size is the one given.
  EXPECT_EQ((ZeroSharding{2, 4, 4096}.GradientBytes(stage)), stage / 4 + 1 + 8192);
  // Saturated counts stay saturated.
  EXPECT_EQ((ZeroSharding{2, 4, bucket}.GradientBytes(kMemoryOverflow)), kMemoryOverflow);
}

// A partitioned plan under ZeRO-2: every stage's gradients are the stage's (ZeRO 0's, same
// split) over dp within two buckets, its optimizer state ZeRO-1's, its weights unchanged.
TEST(Zero2, PlanGradientsPerRankAreTheStagesOverDp) {
  const ModelCosts model = BigParamsModel(80, 250000);
  // Two bucket buffers; a bucket holds whole gradient groups (here a layer each), as large as
  // the bucket size or one group.
  const int64_t in_flight = 2 * std::max<int64_t>(kDefaultGradBucketBytes, 4 * 250000);
  const int dp = 4;
  absl::StatusOr<Plan> z0 = Partition(model, Devices(8, 80 * kGiB), Options(2, dp, 0, 8));
  ASSERT_TRUE(z0.ok()) << z0.status();
  Plan z1 = *z0, z2 = *z0;
  z1.zero = 1;
  z2.zero = 2;
  ASSERT_TRUE(Predict(model, Devices(8, 80 * kGiB), Precision::kFp32, z1).ok());
  ASSERT_TRUE(Predict(model, Devices(8, 80 * kGiB), Precision::kFp32, z2).ok());
  for (size_t k = 0; k < z0->stages.size(); ++k) {
    const StageMemory &m0 = z0->stages[k].memory, &m1 = z1.stages[k].memory,
                      &m2 = z2.stages[k].memory;
    ASSERT_GT(m0.grads, in_flight) << k;
    const int64_t share = (m0.grads + dp - 1) / dp;
    EXPECT_EQ(m2.grads, share + in_flight) << k;
    EXPECT_LE(m2.grads - m0.grads / dp, in_flight + 1) << k;
    EXPECT_EQ(m1.grads, m0.grads) << k;
    EXPECT_EQ(m2.optimizer, m1.optimizer) << k;
    EXPECT_EQ(m2.params, m0.params) << k;
    EXPECT_EQ(m2.total, m2.params + m2.grads + m2.optimizer + m2.activations) << k;
  }
  EXPECT_LT(z2.predicted.peak_memory_bytes, z1.predicted.peak_memory_bytes);
}

// Layers whose gradients come in groups (Note [Gradient groups] in pipewright/layer.h): ZeRO-2's
// buckets close between groups, so the buffers in flight are two of the largest group, not of
// the largest layer.
TEST(Zero2, BucketsAreAsLargeAsTheLargestGradientGroup) {
  ModelCosts whole = BigParamsModel(16, 2500000), grouped = whole;
  for (LayerCost& l : grouped.layers) l.largest_group_params = 2500000 / 5;
  const int dp = 2;
  absl::StatusOr<Plan> a = Partition(whole, Devices(4, 80 * kGiB), Options(2, dp, 2, 8));
  absl::StatusOr<Plan> b = Partition(grouped, Devices(4, 80 * kGiB), Options(2, dp, 2, 8));
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t k = 0; k < a->stages.size(); ++k) {
    EXPECT_EQ(a->stages[k].memory.grads - b->stages[k].memory.grads,
              2 * 4 * (2500000 - 2500000 / 5))
        << k;
  }
  const ZeroSharding z{2, 4, 1 << 20, 3 << 20};
  EXPECT_EQ(z.GradientBytes(int64_t{1} << 30), (int64_t{1} << 28) + 2 * (3 << 20));
}

// PredictRankMemory (what the runtime's own check uses) counts ZeRO-2 as the plan does.
TEST(Zero2, RankMemoryMatchesThePlan) {
  ModelCosts model = BigParamsModel(8, 2500000);
  for (LayerCost& l : model.layers) l.largest_group_params = 100000;  // 400 KB groups
  PartitionOptions o = Options(2, 4, 2, 8);
  absl::StatusOr<Plan> plan = Partition(model, Devices(8, 80 * kGiB), o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<Schedule> sched = GenerateSchedule(plan->schedule);
  ASSERT_TRUE(sched.ok());
  std::vector<Recompute> recompute;
  for (const PlanStage& s : plan->stages) recompute.push_back(s.recompute);
  auto ranks = PredictRankMemory(model, *sched, plan->Boundaries(), recompute,
                                 BytesPerParam(Precision::kFp32), ZeroSharding{2, 4});
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  for (const RankMemory& r : *ranks) {
    ASSERT_EQ(r.stages.size(), 1u);
    EXPECT_EQ(r.memory.grads, plan->stages[r.stages[0]].memory.grads);
    EXPECT_EQ(r.memory.total, plan->stages[r.stages[0]].memory.total);
  }
  // A smaller bucket holds less in flight, down to two of the largest group.
  auto small = PredictRankMemory(model, *sched, plan->Boundaries(), recompute,
                                 BytesPerParam(Precision::kFp32), ZeroSharding{2, 4, 1024});
  ASSERT_TRUE(small.ok());
  EXPECT_EQ((*ranks)[0].memory.grads - (*small)[0].memory.grads,
            2 * kDefaultGradBucketBytes - 2 * 4 * 100000);
  for (const ZeroSharding& bad :
       {ZeroSharding{3, 4}, ZeroSharding{-1, 4}, ZeroSharding{2, 0}, ZeroSharding{2, 4, 0}}) {
    EXPECT_EQ(PredictRankMemory(model, *sched, plan->Boundaries(), recompute,
                                BytesPerParam(Precision::kFp32), bad)
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << bad.zero << " " << bad.dp << " " << bad.bucket_bytes;
  }
}

// ---------------------------------------------------------------------------------------------
// Traffic and step time.

TEST(GradSync, Zero2GrowsWithMicroBatchesAndZero1EqualsZero0) {
  const DeviceSpec dev = Devices(4, 80 * kGiB);
  const ParamBytes fp32 = BytesPerParam(Precision::kFp32);
  const int64_t params = 10000000;
  const double G = 4.0 * params, W = 4.0 * params;
  for (int dp : {2, 4}) {
    const double share = (dp - 1.0) / dp;
    for (int m : {2, 8}) {
      const GradSyncCost z0 = PredictGradSync(params, fp32, {0, dp}, m, dev);
      const GradSyncCost z1 = PredictGradSync(params, fp32, {1, dp}, m, dev);
      const GradSyncCost z2 = PredictGradSync(params, fp32, {2, dp}, m, dev);
      EXPECT_DOUBLE_EQ(z0.bytes, 2 * share * G) << dp << " " << m;
      EXPECT_DOUBLE_EQ(z1.bytes, z0.bytes) << "fp32: RS + AG moves what the all-reduce does";
      EXPECT_EQ(z1.latencies, z0.latencies);
      EXPECT_DOUBLE_EQ(z1.seconds, z0.seconds);
      EXPECT_DOUBLE_EQ(z2.bytes, share * (m * G + W)) << dp << " " << m;
      EXPECT_EQ(z2.latencies, (m + 1) * (dp - 1));
      EXPECT_DOUBLE_EQ(z2.seconds, z2.bytes / dev.link_bandwidth + z2.latencies * 1e-5);
      EXPECT_GT(z2.seconds, z1.seconds) << dp << " " << m;
    }
    const ZeroSharding z2{2, dp};
    EXPECT_GT(PredictGradSync(params, fp32, z2, 8, dev).seconds,
              PredictGradSync(params, fp32, z2, 2, dev).seconds);
    // ZeRO 0 and 1 do not depend on the micro-batches.
    for (int zero : {0, 1}) {
      EXPECT_DOUBLE_EQ(PredictGradSync(params, fp32, {zero, dp}, 8, dev).seconds,
                       PredictGradSync(params, fp32, {zero, dp}, 2, dev).seconds);
    }
    // At one micro-batch ZeRO-2 moves what ZeRO-1 does.
    EXPECT_DOUBLE_EQ(PredictGradSync(params, fp32, z2, 1, dev).seconds,
                     PredictGradSync(params, fp32, {1, dp}, 1, dev).seconds);
  }
  // Mixed precision: the all-gather moves 16-bit weights, less than the all-reduce's second half.
  const ParamBytes bf16 = BytesPerParam(Precision::kBf16);
  EXPECT_LT(PredictGradSync(params, bf16, {1, 4}, 4, dev).bytes,
            PredictGradSync(params, bf16, {0, 4}, 4, dev).bytes);
  // No data parallelism, no traffic.
  EXPECT_EQ(PredictGradSync(params, fp32, {2, 1}, 8, dev).seconds, 0);
}

// The traffic goes into the step time where the all-reduce does (after the backward): one stage,
// so the step is m (F + B) + sync + optimizer and the differences are the traffic's.
TEST(GradSync, StepTimeAddsTheTraffic) {
  const ModelCosts model = BigParamsModel(4, 2500000);
  DeviceSpec dev = Devices(4, 80 * kGiB);
  dev.memory_bandwidth = 1e30;  // no optimizer time: ZeRO 0 and 1 then differ in nothing
  const ParamBytes fp32 = BytesPerParam(Precision::kFp32);
  const int64_t params = 4 * 2500000;
  double gap[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    const int m = i == 0 ? 2 : 8;
    double step[3] = {0, 0, 0};
    for (int zero = 0; zero <= 2; ++zero) {
      absl::StatusOr<Plan> p = Partition(model, dev, Options(1, 4, zero, m));
      ASSERT_TRUE(p.ok()) << p.status();
      step[zero] = p->predicted.step_time_s;
    }
    EXPECT_NEAR(step[1], step[0], 1e-12 * step[0]) << m;
    gap[i] = step[2] - step[1];
    const double traffic = PredictGradSync(params, fp32, {2, 4}, m, dev).seconds -
                           PredictGradSync(params, fp32, {1, 4}, m, dev).seconds;
    EXPECT_NEAR(gap[i], traffic, 1e-9 * step[2]) << m;
  }
  EXPECT_GT(gap[0], 0);
  EXPECT_GT(gap[1], gap[0]) << "ZeRO-2 at 8 micro-batches costs more than at 2";
}

// ---------------------------------------------------------------------------------------------
// The plan search.

SearchOptions OnePipelineStage(int64_t global_batch) {
  SearchOptions o;
  o.pp = 1;
  o.dp = 2;
  o.schedule = ScheduleKind::k1F1B;
  o.micro_batch_size = 1;
  o.global_batch = global_batch;
  o.keep = 10;
  return o;
}

// 10 M fp32 parameters (40 layers) on each of 2 replicas: ZeRO 0 needs 160 MB, 1 needs 120 MB,
// 2 needs 100 MB + two buckets (1 MiB and a 1 MB layer each); a 110 MB device holds only ZeRO-2.
TEST(SearchZero, PicksZero2WhereOnlyItFits) {
  const ModelCosts model = BigParamsModel(40, 250000);
  auto r = SearchPlans(model, Devices(2, 110 * kMB), OnePipelineStage(8));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->candidates, 3);  // zero 0, 1 and 2
  EXPECT_EQ(r->feasible, 1);
  EXPECT_EQ(r->best.front().zero, 2);
  EXPECT_LE(r->best.front().predicted.peak_memory_bytes, 110 * kMB);
  // And each of the others is named as a miss.
  ASSERT_FALSE(r->infeasible.empty());
  EXPECT_TRUE(absl::StrContains(r->infeasible.front(), "zero=1")) << r->infeasible.front();
}

// A fixed configuration that does not fit names the ZeRO stage that would.
TEST(SearchZero, NoFitSuggestsTheZeroThatFits) {
  const ModelCosts model = BigParamsModel(40, 250000);
  for (int zero : {0, 1}) {
    absl::Status s = Partition(model, Devices(2, 110 * kMB), Options(1, 2, zero, 4)).status();
    ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(),
                                  "would fit: PartitionOptions.zero = 2 (splits the optimizer "
                                  "state and the gradients over the 2 replicas)"))
        << s;
  }
  absl::Status s = Partition(model, Devices(2, 130 * kMB), Options(1, 2, 0, 4)).status();
  EXPECT_TRUE(absl::StrContains(
      s.message(), "would fit: PartitionOptions.zero = 1 (splits the optimizer state over the 2"))
      << s;
}

// Where everything fits, ZeRO-2's extra reduce-scatters make it slower: it is not chosen, even
// when ZeRO 0 runs as fast as ZeRO 1 (no optimizer time), and ZeRO 1 wins that tie on memory.
TEST(SearchZero, DoesNotPickZero2WhereZero0FitsAtEqualSpeed) {
  const ModelCosts model = BigParamsModel(40, 250000);
  DeviceSpec dev = Devices(2, 80 * kGiB);
  dev.memory_bandwidth = 1e30;
  auto r = SearchPlans(model, dev, OnePipelineStage(8));  // m = 4
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->best.size(), 3u);
  EXPECT_EQ(r->best[0].zero, 1);
  EXPECT_EQ(r->best[1].zero, 0);
  EXPECT_NEAR(r->best[0].predicted.step_time_s, r->best[1].predicted.step_time_s,
              1e-9 * r->best[0].predicted.step_time_s);
  EXPECT_EQ(r->best[2].zero, 2);
  EXPECT_GT(r->best[2].predicted.step_time_s, r->best[1].predicted.step_time_s * (1 + 1e-6));
}

// At one micro-batch per step ZeRO-2 moves what ZeRO-1 does: it costs nothing and holds less,
// so the rule (fastest, then less memory) picks it.
TEST(SearchZero, PicksZero2WhenItCostsNothing) {
  const ModelCosts model = BigParamsModel(40, 250000);
  auto r = SearchPlans(model, Devices(2, 80 * kGiB), OnePipelineStage(2));  // m = 1
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->best.size(), 3u);
  EXPECT_EQ(r->best[0].zero, 2);
  EXPECT_EQ(r->best[1].zero, 1);
  EXPECT_DOUBLE_EQ(r->best[0].predicted.step_time_s, r->best[1].predicted.step_time_s);
  EXPECT_LT(r->best[0].predicted.peak_memory_bytes, r->best[1].predicted.peak_memory_bytes);
}

// ---------------------------------------------------------------------------------------------
// Checks and the plan JSON.

TEST(ZeroChecks, InvalidZeroIsRefusedNamingTheField) {
  const ModelCosts model = BigParamsModel(4, 1000);
  for (int zero : {3, -1}) {
    absl::Status s = Partition(model, Devices(2, 80 * kGiB), Options(1, 2, zero, 2)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(
        s.message(), absl::StrCat("PartitionOptions.zero = ", zero, ": must be 0, 1 or 2")))
        << s;
    SearchOptions o = OnePipelineStage(8);
    o.zero = zero;
    s = SearchPlans(model, Devices(2, 80 * kGiB), o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(
        s.message(), absl::StrCat("SearchOptions.zero = ", zero, ": must be 0, 1 or 2")))
        << s;
  }
  // ZeRO-2 needs replicas to split over.
  absl::Status s = Partition(model, Devices(1, 80 * kGiB), Options(1, 1, 2, 2)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(),
                                "PartitionOptions.zero = 2 splits the optimizer state "
                                "and the gradients over PartitionOptions.dp >= 2"))
      << s;
  SearchOptions o = OnePipelineStage(8);
  o.dp = 1;
  o.zero = 2;
  s = SearchPlans(model, Devices(1, 80 * kGiB), o).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "SearchOptions.zero = 2 needs dp >= 2")) << s;
  // Valid: each of 0, 1, 2 with dp = 2.
  for (int zero : {0, 1, 2}) {
    EXPECT_TRUE(Partition(model, Devices(2, 80 * kGiB), Options(1, 2, zero, 2)).ok()) << zero;
  }
}

TEST(ZeroPlanJson, Zero2RoundTrips) {
  const ModelCosts model = BigParamsModel(8, 2500000);
  absl::StatusOr<Plan> plan = Partition(model, Devices(8, 80 * kGiB), Options(2, 4, 2, 8));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->zero, 2);
  const std::string text = PlanToJson(*plan);
  EXPECT_TRUE(absl::StrContains(text, "\"zero\": 2")) << text;
  EXPECT_TRUE(ValidatePlanJson(text, &model).empty())
      << absl::StrJoin(ValidatePlanJson(text), "\n");
  absl::StatusOr<Plan> back = PlanFromJson(text, &model);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->zero, 2);
  EXPECT_EQ(PlanToJson(*back), text);
  // Predicting the plan read back gives the same numbers.
  Plan again = *back;
  ASSERT_TRUE(Predict(model, Devices(8, 80 * kGiB), Precision::kFp32, again).ok());
  EXPECT_EQ(PlanToJson(again), text);
}

TEST(ZeroPlanJson, OutOfRangeOrWithoutReplicasIsRefusedAtTheField) {
  const ModelCosts model = BigParamsModel(8, 2500000);
  absl::StatusOr<Plan> plan = Partition(model, Devices(8, 80 * kGiB), Options(2, 4, 2, 8));
  ASSERT_TRUE(plan.ok()) << plan.status();
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(PlanToJson(*plan));
  const std::pair<int, std::string> cases[] = {{3, "zero: must be <= 2, got 3"},
                                               {-1, "zero: must be >= 0, got -1"}};
  for (const auto& [zero, want] : cases) {
    doc["zero"] = zero;
    const std::vector<std::string> problems = ValidatePlanJson(doc.dump());
    ASSERT_EQ(problems.size(), 1u) << absl::StrJoin(problems, "\n");
    EXPECT_EQ(problems[0], want);
  }
  // A one-replica plan (pp 8 x dp 1) cannot split over replicas.
  absl::StatusOr<Plan> alone = Partition(model, Devices(8, 80 * kGiB), Options(8, 1, 0, 8));
  ASSERT_TRUE(alone.ok());
  nlohmann::ordered_json one = nlohmann::ordered_json::parse(PlanToJson(*alone));
  one["zero"] = 2;
  const std::vector<std::string> problems = ValidatePlanJson(one.dump());
  ASSERT_EQ(problems.size(), 1u) << absl::StrJoin(problems, "\n");
  EXPECT_EQ(problems[0],
            "zero: 2 splits the optimizer state and the gradients over the replicas: it needs "
            "data_parallel >= 2");
}

}  // namespace
}  // namespace pipewright
