// The partitioner against brute force, its memory model, recomputation choices, errors and
// the plan search.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "pipewright/partitioner.h"
#include "pipewright/plan.h"
#include "pipewright/simulator.h"

namespace pipewright {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

LayerCost Layer(int i, int64_t params, double fwd, double bwd, int64_t saved, int64_t out) {
  LayerCost l;
  l.name = "l" + std::to_string(i);
  l.kind = "test";
  l.params = params;
  l.forward_flops = fwd;
  l.backward_flops = bwd;
  l.activation_bytes = saved;
  l.output_bytes = out;
  return l;
}

ModelCosts RandomModel(std::mt19937& rng, int layers) {
  std::uniform_real_distribution<double> flops(1e9, 1e11);
  std::uniform_int_distribution<int64_t> params(0, 4000), bytes(100, 20000);
  ModelCosts m;
  m.name = "random";
  m.fingerprint = "sha256:test";
  m.micro_batch_size = 1;
  m.seq_len = 1;
  m.input_bytes = bytes(rng);
  for (int i = 0; i < layers; ++i) {
    const int64_t p = params(rng);
    const double f = flops(rng), b = 2 * flops(rng);
    const int64_t saved = bytes(rng), out = bytes(rng);
    m.layers.push_back(Layer(i, p, f, b, saved, out));
  }
  return m;
}

DeviceSpec Devices(int count, int64_t memory) {
  DeviceSpec d;
  d.count = count;
  d.memory_bytes = memory;
  d.tflops = 1;  // seconds = FLOPs / 1e12
  d.layer_overhead_s = 0;
  return d;
}

// Independent re-statement of docs/memory.md for one stage of a one-chunk schedule.
struct Reference {
  const ModelCosts& m;
  std::vector<int> inflight;
  int64_t budget;
  bool allow_recompute;

  // Per-micro-batch time of stage k on [i, j), or kInf when it fits in no way.
  double Time(int k, int i, int j) const {
    double f = 0, b = 0;
    int64_t p = 0, saved = 0;
    for (int l = i; l < j; ++l) {
      f += m.layers[l].forward_flops / 1e12;
      b += m.layers[l].backward_flops / 1e12;
      p += m.layers[l].params;
      saved += m.layers[l].activation_bytes;
    }
    const int64_t in = i == 0 ? m.input_bytes : m.layers[i - 1].output_bytes;
    if (p * 16 + inflight[k] * saved <= budget) return f + b;
    if (allow_recompute && p * 16 + inflight[k] * in + saved <= budget) return 2 * f + b;
    return kInf;
  }

  // Minimum over every split of the largest stage time (kInf: nothing fits).
  double BruteForce(int S) const {
    const int L = m.num_layers();
    double best = kInf;
    std::vector<int> cut(S + 1, 0);
    cut[S] = L;
    std::function<void(int, double)> rec = [&](int k, double worst) {
      if (worst >= best) return;
      if (k == S - 1) {
        best = std::min(best, std::max(worst, Time(k, cut[k], L)));
        return;
      }
      for (int e = cut[k] + 1; e <= L - (S - k - 1); ++e) {
        cut[k + 1] = e;
        rec(k + 1, std::max(worst, Time(k, cut[k], e)));
      }
    };
    rec(0, 0);
    return best;
  }
};

double Bottleneck(const Plan& plan) {
  double t = 0;
  for (const PlanStage& s : plan.stages) t = std::max(t, s.forward_s + s.backward_s);
  return t;
}

std::vector<int> OneFOneBInflight(int p, int m) {
  std::vector<int> v;
  for (int k = 0; k < p; ++k) v.push_back(std::min(p - k, m));
  return v;
}

TEST(PeakInflight, MatchesTheSchedulesKnownDepths) {
  for (int p : {1, 2, 4, 5}) {
    for (int m : {1, 3, 8}) {
      auto one = GenerateSchedule({ScheduleKind::k1F1B, p, m, 1});
      ASSERT_TRUE(one.ok());
      EXPECT_EQ(PeakInflightPerStage(*one), OneFOneBInflight(p, m)) << p << " " << m;
      auto gpipe = GenerateSchedule({ScheduleKind::kGpipe, p, m, 1});
      ASSERT_TRUE(gpipe.ok());
      EXPECT_EQ(PeakInflightPerStage(*gpipe), std::vector<int>(p, m));
    }
  }
}

TEST(PeakInflight, AgreesWithTheSimulator) {
  // One chunk per rank: the simulator's per-rank peak (timed) equals the program-order count.
  for (ScheduleKind kind : {ScheduleKind::kGpipe, ScheduleKind::k1F1B, ScheduleKind::kZbH1}) {
    auto s = GenerateSchedule({kind, 4, 8, 1});
    ASSERT_TRUE(s.ok());
    std::vector<int> peak = PeakInflightPerStage(*s);
    ASSERT_TRUE(LowerComm(*s).ok());
    SimCosts costs;
    costs.w = 0.5;
    auto sim = Simulate(*s, costs);
    ASSERT_TRUE(sim.ok());
    for (int r = 0; r < 4; ++r) {
      EXPECT_DOUBLE_EQ(sim->ranks[r].peak_inflight, peak[r]) << ScheduleKindName(kind) << r;
    }
  }
}

// The acceptance check: on random 8-14-layer graphs the plan's bottleneck is the
// brute-force optimum, with and without memory limits, with and without recomputation.
TEST(Partition, BottleneckEqualsBruteForce) {
  std::mt19937 rng(1234);
  int checked = 0, infeasible = 0, recomputed = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const int L = 8 + trial % 7;
    ModelCosts model = RandomModel(rng, L);
    const int S = 2 + trial % 4;
    const int m = 1 + trial % 6;
    const ScheduleKind kind = trial % 2 ? ScheduleKind::k1F1B : ScheduleKind::kGpipe;
    const bool allow = trial % 3 != 0;
    std::vector<int> inflight =
        kind == ScheduleKind::kGpipe ? std::vector<int>(S, m) : OneFOneBInflight(S, m);
    // Memory from "no limit" down to tight: 1e12, then around a typical stage's need.
    int64_t typical = 0;
    for (const LayerCost& l : model.layers) typical += l.params * 16 + l.activation_bytes * m;
    typical /= S;
    for (int64_t memory : {int64_t{1} << 40, typical * 2, typical, typical * 3 / 4, typical / 2}) {
      Reference ref{model, inflight, memory, allow};
      const double want = ref.BruteForce(S);
      PartitionOptions o;
      o.pp = S;
      o.schedule = kind;
      o.micro_batches = m;
      o.allow_recompute = allow;
      o.suggest = false;
      auto plan = Partition(model, Devices(S, memory), o);
      if (want == kInf) {
        EXPECT_FALSE(plan.ok()) << "trial " << trial << " memory " << memory;
        if (!plan.ok()) {
          EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
        }
        ++infeasible;
        continue;
      }
      ASSERT_TRUE(plan.ok()) << "trial " << trial << ": " << plan.status();
      EXPECT_NEAR(Bottleneck(*plan), want, 1e-9 * want) << "trial " << trial;
      // Every stage fits, and recomputes only when it would not fit otherwise.
      ASSERT_EQ(plan->stages.size(), static_cast<size_t>(S));
      for (int k = 0; k < S; ++k) {
        const PlanStage& st = plan->stages[k];
        EXPECT_LE(st.memory.total, memory);
        EXPECT_EQ(st.memory.total,
                  st.memory.params + st.memory.grads + st.memory.optimizer + st.memory.activations);
        if (st.recompute == Recompute::kFull) {
          ++recomputed;
          Reference no_rc{model, inflight, memory, false};
          EXPECT_EQ(no_rc.Time(k, st.begin, st.end), kInf) << "needless recompute, trial " << trial;
        }
      }
      EXPECT_EQ(plan->stages.front().begin, 0);
      EXPECT_EQ(plan->stages.back().end, L);
      for (int k = 1; k < S; ++k) EXPECT_EQ(plan->stages[k].begin, plan->stages[k - 1].end);
      ++checked;
    }
  }
  // The sweep must exercise all three regimes, or it proves less than it claims.
  EXPECT_GT(checked, 300);
  EXPECT_GT(infeasible, 20);
  EXPECT_GT(recomputed, 20);
}

TEST(Partition, MoreMemoryNeverGivesASlowerPlan) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 40; ++trial) {
    ModelCosts model = RandomModel(rng, 12 + trial % 20);
    PartitionOptions o;
    o.pp = 4;
    o.micro_batches = 6;
    o.schedule = trial % 2 ? ScheduleKind::k1F1B : ScheduleKind::kGpipe;
    o.suggest = false;
    double last = kInf;
    bool fitted = false;
    for (int64_t memory = 20000; memory < (int64_t{1} << 30); memory = memory * 5 / 4) {
      auto plan = Partition(model, Devices(4, memory), o);
      if (!plan.ok()) {
        EXPECT_FALSE(fitted) << "fitted at less memory, not at " << memory;
        continue;
      }
      fitted = true;
      EXPECT_LE(Bottleneck(*plan), last * (1 + 1e-12)) << "trial " << trial << " at " << memory;
      last = Bottleneck(*plan);
    }
    EXPECT_TRUE(fitted);
  }
}

TEST(Partition, RecomputesOnlyTheStagesThatNeedIt) {
  // Eight identical layers over four 1f1b stages: stage k holds 4 - k micro-batches of 1000 B
  // per layer, so in 3500 B no split fits without recomputation, and the optimal one (two
  // layers each) recomputes on every stage but the last.
  ModelCosts model;
  model.name = "uniform";
  model.fingerprint = "sha256:u";
  model.input_bytes = 100;
  for (int i = 0; i < 8; ++i) {
    model.layers.push_back(Layer(i, 0, 1e12, 2e12, 1000, 100));
  }
  PartitionOptions o;
  o.pp = 4;
  o.micro_batches = 8;
  auto plan = Partition(model, Devices(4, 3500), o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<Recompute> want = {Recompute::kFull, Recompute::kFull, Recompute::kFull,
                                 Recompute::kNone};
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(plan->stages[k].recompute, want[k]) << k;
    EXPECT_EQ(plan->stages[k].end - plan->stages[k].begin, 2);
  }
  // Stage 0 with recomputation: 4 inputs of 100 B + one micro-batch's 2000 B.
  EXPECT_EQ(plan->stages[0].memory.activations, 4 * 100 + 2000);
  EXPECT_EQ(plan->stages[3].memory.activations, 2000);
  // Recomputation adds one forward to the backward.
  EXPECT_DOUBLE_EQ(plan->stages[0].backward_s, 4 + 2);
  EXPECT_DOUBLE_EQ(plan->stages[3].backward_s, 4);
  EXPECT_EQ(plan->predicted.bottleneck_stage, 0);

  o.allow_recompute = false;
  o.suggest = true;
  auto refused = Partition(model, Devices(4, 3500), o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("allowing activation recomputation"), std::string::npos)
      << refused.status();
}

TEST(Partition, NothingFitsNamesStageShortfallAndAlternatives) {
  ModelCosts model;
  model.name = "big";
  model.fingerprint = "sha256:b";
  model.input_bytes = 8;
  model.micro_batch_size = 4;
  for (int i = 0; i < 8; ++i) {
    model.layers.push_back(Layer(i, 1000, 1e12, 2e12, 40000, 400));
  }
  PartitionOptions o;
  o.pp = 2;
  o.dp = 1;
  o.schedule = ScheduleKind::kGpipe;
  o.micro_batches = 8;
  o.allow_recompute = false;
  // 4 layers: 64 KB of state + 8 micro-batches x 160 KB of activations.
  auto plan = Partition(model, Devices(2, 400000), o);
  ASSERT_FALSE(plan.ok());
  const std::string msg(plan.status().message());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(msg.find("stage 0 (layers [0, 4)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("short"), std::string::npos) << msg;
  EXPECT_NE(msg.find("would fit:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("PartitionOptions.schedule = 1f1b"), std::string::npos) << msg;
  EXPECT_NE(msg.find("allowing activation recomputation"), std::string::npos) << msg;

  // 1f1b holds two micro-batches on stage 0: the best split ([0, 3), [3, 8)) needs 288 KB;
  // halving the micro-batch fits in 280 KB.
  o.schedule = ScheduleKind::k1F1B;
  auto smaller = Partition(model, Devices(2, 280000), o);
  ASSERT_FALSE(smaller.ok());
  EXPECT_NE(smaller.status().message().find(
                "PartitionOptions.micro_batch_size = 2, PartitionOptions.micro_batches = 16"),
            std::string::npos)
      << smaller.status();
  o.schedule = ScheduleKind::kGpipe;

  // Weights alone too large: the message says how many stages the state needs.
  auto tiny = Partition(model, Devices(2, 1000), o);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("pipeline stages"), std::string::npos) << tiny.status();
}

TEST(Partition, BadRequestsAreClearErrors) {
  std::mt19937 rng(5);
  ModelCosts model = RandomModel(rng, 4);
  PartitionOptions o;
  o.pp = 8;
  auto too_deep = Partition(model, Devices(8, int64_t{1} << 40), o);
  ASSERT_FALSE(too_deep.ok());
  EXPECT_NE(too_deep.status().message().find("cannot split 4 layers into 8"), std::string::npos);
  o.pp = 2;
  o.dp = 2;
  auto wrong_count = Partition(model, Devices(8, int64_t{1} << 40), o);
  ASSERT_FALSE(wrong_count.ok());
  EXPECT_NE(wrong_count.status().message().find("there are 8 devices"), std::string::npos);
  o.dp = 1;
  o.schedule = ScheduleKind::kInterleaved;
  o.chunks = 2;
  o.micro_batches = 3;
  EXPECT_FALSE(Partition(model, Devices(2, int64_t{1} << 40), o).ok());  // m % p != 0
}

TEST(Partition, InterleavedAndZbVPlaceStagesAndFitPerRank) {
  std::mt19937 rng(8);
  ModelCosts model = RandomModel(rng, 16);
  for (ScheduleKind kind : {ScheduleKind::kInterleaved, ScheduleKind::kZbV}) {
    PartitionOptions o;
    o.pp = 4;
    o.schedule = kind;
    o.chunks = 2;
    o.micro_batches = 8;
    const int64_t memory = 400000;
    auto plan = Partition(model, Devices(4, memory), o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->stages.size(), 8u);
    std::vector<int64_t> per_rank(4, 0);
    for (const PlanStage& s : plan->stages) {
      EXPECT_EQ(s.rank, StageRank(plan->schedule, s.index));
      per_rank[s.rank] += s.memory.total;
    }
    for (int64_t r : per_rank) EXPECT_LE(r, memory);
    EXPECT_EQ(plan->predicted.peak_memory_bytes,
              *std::max_element(per_rank.begin(), per_rank.end()));
  }
}

TEST(Partition, PredictionAndLowerBound) {
  std::mt19937 rng(3);
  ModelCosts model = RandomModel(rng, 20);
  PartitionOptions o;
  o.pp = 4;
  o.dp = 2;
  o.micro_batches = 8;
  o.micro_batch_size = 2;
  auto plan = Partition(model, Devices(8, int64_t{1} << 40), o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const PlanPrediction& p = plan->predicted;
  EXPECT_GT(p.step_time_s, 0);
  EXPECT_GT(p.lower_bound_step_time_s, 0);
  EXPECT_LE(p.lower_bound_step_time_s, p.step_time_s);
  EXPECT_NEAR(p.lower_bound_gap, p.step_time_s / p.lower_bound_step_time_s - 1, 1e-12);
  EXPECT_GT(p.bubble_fraction, 0);
  EXPECT_LT(p.bubble_fraction, 1);
  EXPECT_EQ(plan->global_batch(), 2 * 8 * 2);
  EXPECT_NEAR(p.samples_per_s, 32 / p.step_time_s, 1e-9 * p.samples_per_s);
  // Micro-batch size 2 doubles every FLOP of the size-1 model.
  double fb = 0;
  for (const LayerCost& l : model.layers) fb += (l.forward_flops + l.backward_flops) / 1e12;
  double stages = 0;
  for (const PlanStage& s : plan->stages) stages += s.forward_s + s.backward_s;
  EXPECT_NEAR(stages, 2 * fb, 1e-9 * fb);
  // 1F1B over stages of equal cost: (m + p - 1) stage times plus reduce and optimizer.
  EXPECT_GE(p.step_time_s, (8 + 4 - 1) * Bottleneck(*plan) * 0.5);

  // Predict() on the same split reproduces the partitioner's numbers.
  Plan copy = *plan;
  copy.predicted = PlanPrediction();
  for (PlanStage& s : copy.stages) s.memory = StageMemory();
  ASSERT_TRUE(Predict(model, Devices(8, int64_t{1} << 40), Precision::kFp32, copy).ok());
  EXPECT_DOUBLE_EQ(copy.predicted.step_time_s, p.step_time_s);
  EXPECT_EQ(copy.predicted.peak_memory_bytes, p.peak_memory_bytes);
  EXPECT_EQ(copy.stages[1].memory.total, plan->stages[1].memory.total);
}

TEST(Partition, PrecisionAndLayerOverhead) {
  std::mt19937 rng(4);
  ModelCosts model = RandomModel(rng, 8);
  PartitionOptions o;
  o.pp = 2;
  o.micro_batches = 4;
  auto fp32 = Partition(model, Devices(2, int64_t{1} << 40), o);
  o.precision = Precision::kBf16;
  auto bf16 = Partition(model, Devices(2, int64_t{1} << 40), o);
  ASSERT_TRUE(fp32.ok() && bf16.ok());
  const StageMemory& a = fp32->stages[0].memory;
  const StageMemory& b = bf16->stages[0].memory;
  const int64_t params = a.params / 4;
  EXPECT_EQ(a.params + a.grads + a.optimizer, 16 * params);
  EXPECT_EQ(b.params + b.grads + b.optimizer, 18 * params);
  EXPECT_EQ(b.params, 2 * params);

  DeviceSpec slow = Devices(2, int64_t{1} << 40);
  slow.layer_overhead_s = 0.5;
  auto overhead = Partition(model, slow, o);
  ASSERT_TRUE(overhead.ok());
  double with = 0, without = 0;
  for (int k = 0; k < 2; ++k) {
    with += overhead->stages[k].forward_s + overhead->stages[k].backward_s;
    without += bf16->stages[k].forward_s + bf16->stages[k].backward_s;
  }
  EXPECT_NEAR(with - without, 8 * 2 * 0.5, 1e-9);  // every layer, forward and backward
}

TEST(Search, TriesEveryShapeAndRanksByStepTime) {
  std::mt19937 rng(11);
  ModelCosts model = RandomModel(rng, 24);
  SearchOptions o;
  o.global_batch = 16;
  auto r = SearchPlans(model, Devices(8, int64_t{1} << 40), o);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->best.size(), 5u);
  EXPECT_GT(r->candidates, 20);
  EXPECT_EQ(r->feasible, r->candidates);
  for (size_t i = 0; i < r->best.size(); ++i) {
    const Plan& p = r->best[i];
    EXPECT_EQ(p.pipeline_parallel * p.data_parallel, 8);
    EXPECT_EQ(p.global_batch(), 16);
    if (i > 0) {
      EXPECT_LE(r->best[i - 1].predicted.step_time_s, p.predicted.step_time_s);
    }
  }
  // Fixing pp, dp and the schedule leaves the micro-batch sizes and ZeRO 0, 1 and 2 to try
  // (dp >= 2), and fixing zero too only the micro-batch sizes.
  o.pp = 4;
  o.dp = 2;
  o.schedule = ScheduleKind::k1F1B;
  auto both = SearchPlans(model, Devices(8, int64_t{1} << 40), o);
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->candidates, 12);  // b in {1, 2, 4, 8} with dp * b | 16, zero in {0, 1, 2}
  o.zero = 1;
  o.pp = 8;
  o.dp.reset();
  auto no_replicas = SearchPlans(model, Devices(8, int64_t{1} << 40), o);
  ASSERT_FALSE(no_replicas.ok());
  EXPECT_NE(no_replicas.status().message().find("SearchOptions.zero = 1 needs dp >= 2"),
            std::string::npos)
      << no_replicas.status();
  o.pp = 4;
  o.dp = 2;
  o.zero = 0;
  auto fixed = SearchPlans(model, Devices(8, int64_t{1} << 40), o);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->candidates, 4);  // b in {1, 2, 4, 8} with dp * b | 16
  for (const Plan& p : fixed->best) {
    EXPECT_EQ(p.pipeline_parallel, 4);
    EXPECT_EQ(p.schedule.kind, ScheduleKind::k1F1B);
  }
}

TEST(Search, NoFitIsAnErrorWithTheClosestShortfall) {
  std::mt19937 rng(12);
  ModelCosts model = RandomModel(rng, 10);
  SearchOptions o;
  o.global_batch = 8;
  auto r = SearchPlans(model, Devices(4, 1000), o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("short"), std::string::npos) << r.status();
}

// The search partitions candidates on several threads and reads them back in order: the plans,
// the counts and, when nothing fits, the message are those of one thread.
TEST(Search, ThreadsDoNotChangeTheResult) {
  std::mt19937 rng(13);
  ModelCosts model = RandomModel(rng, 24);
  for (int64_t memory : {int64_t{1} << 40, int64_t{1} << 16}) {
    SearchOptions o;
    o.global_batch = 32;
    o.keep = 50;
    o.threads = 1;
    auto one = SearchPlans(model, Devices(8, memory), o);
    for (int threads : {2, 5}) {
      o.threads = threads;
      auto many = SearchPlans(model, Devices(8, memory), o);
      ASSERT_EQ(many.ok(), one.ok()) << threads;
      if (!one.ok()) {
        EXPECT_EQ(many.status(), one.status()) << threads;
        continue;
      }
      EXPECT_EQ(many->candidates, one->candidates);
      EXPECT_EQ(many->feasible, one->feasible);
      EXPECT_EQ(many->infeasible, one->infeasible);
      ASSERT_EQ(many->best.size(), one->best.size());
      for (size_t i = 0; i < one->best.size(); ++i) {
        EXPECT_EQ(PlanToJson(many->best[i]), PlanToJson(one->best[i])) << threads << " " << i;
      }
    }
  }
}

TEST(Partition, ThousandLayersOverSixtyFourStages) {
  // The benchmark (pipewright bench --suite partitioner) times this; here it must just work.
  std::mt19937 rng(21);
  ModelCosts model = RandomModel(rng, 1000);
  PartitionOptions o;
  o.pp = 64;
  o.micro_batches = 128;
  auto plan = Partition(model, Devices(64, int64_t{1} << 40), o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->stages.size(), 64u);
  double sum = 0, largest = 0;
  for (const LayerCost& l : model.layers) {
    const double t = (l.forward_flops + l.backward_flops) / 1e12;
    sum += t;
    largest = std::max(largest, t);
  }
  // Exact optimum is within one layer of the average.
  EXPECT_LE(Bottleneck(*plan), sum / 64 + largest);
  EXPECT_GE(Bottleneck(*plan), std::max(sum / 64, largest) * (1 - 1e-12));
}

}  // namespace
}  // namespace pipewright
