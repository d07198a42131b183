#include "pipewright/engine.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/checkpoint.h"
#include "pipewright/partitioner.h"
#include "pipewright/trace.h"
#include "pipewright/train.h"
#include "tests/runtime/engine_util.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

using testing_util::EngineSetup;
using testing_util::MakeEngine;

constexpr int64_t kMicroBatches = 8;
constexpr int kSteps = 3;

using testing_util::Tiny;

TrainOptions Train(int64_t steps = kSteps) { return testing_util::ParityTrainOptions(steps); }

using testing_util::ExpectSameRun;
using testing_util::RunResult;
using testing_util::ToMap;
using testing_util::WeightMap;

// The single-stage reference: a plain training loop that shares no scheduling code with the
// engine (engine_util.h).
RunResult Reference(int64_t micro_batches) {
  return testing_util::RunReference(Tiny(), micro_batches, Train(), kSteps);
}

EngineSetup Options(int pp, int dp, ScheduleKind kind, int chunks, Recompute rc,
                    int64_t micro_batches) {
  return testing_util::ParitySetup(pp, dp, kind, chunks, rc, micro_batches, kSteps);
}

RunResult RunEngine(const EngineSetup& o, const LayerGraph& g) {
  return testing_util::RunSteps(g, o, kSteps);
}

struct ParityCase {
  int pp;
  ScheduleKind kind;
  int chunks;
  Recompute recompute;
};

std::string CaseName(const testing::TestParamInfo<ParityCase>& info) {
  std::string k = ScheduleKindName(info.param.kind);
  for (char& c : k) {
    if (c == '-') c = '_';
  }
  return absl::StrCat("pp", info.param.pp, "_", k, "_v", info.param.chunks,
                      info.param.recompute == Recompute::kFull ? "_recompute" : "");
}

class EngineParityTest : public testing::TestWithParam<ParityCase> {};

// Same global batch, any depth / schedule / recompute: bit-identical losses and weights.
TEST_P(EngineParityTest, BitIdenticalToSingleStage) {
  static const RunResult* ref = new RunResult(Reference(kMicroBatches));
  ASSERT_EQ(ref->losses.size(), static_cast<size_t>(kSteps));
  const ParityCase& c = GetParam();
  RunResult got = RunEngine(Options(c.pp, 1, c.kind, c.chunks, c.recompute, kMicroBatches), Tiny());
  ASSERT_EQ(got.losses.size(), ref->losses.size());
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_EQ(got.losses[i], ref->losses[i]) << "step " << i;
  }
  ASSERT_EQ(got.weights.size(), ref->weights.size());
  for (const auto& [name, w] : ref->weights) {
    ASSERT_TRUE(got.weights.count(name)) << name;
    const std::vector<float>& v = got.weights.at(name);
    ASSERT_EQ(v.size(), w.size()) << name;
    EXPECT_EQ(std::memcmp(v.data(), w.data(), w.size() * sizeof(float)), 0) << name << " differs";
  }
  EXPECT_GT(ref->losses.front(), ref->losses.back());  // training moved the weights
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, EngineParityTest,
    testing::Values(ParityCase{1, ScheduleKind::k1F1B, 1, Recompute::kNone},
                    ParityCase{2, ScheduleKind::kGpipe, 1, Recompute::kNone},
                    ParityCase{4, ScheduleKind::kGpipe, 1, Recompute::kFull},
                    ParityCase{2, ScheduleKind::k1F1B, 1, Recompute::kNone},
                    ParityCase{4, ScheduleKind::k1F1B, 1, Recompute::kNone},
                    ParityCase{4, ScheduleKind::k1F1B, 1, Recompute::kFull},
                    ParityCase{2, ScheduleKind::kInterleaved, 2, Recompute::kNone},
                    ParityCase{4, ScheduleKind::kInterleaved, 2, Recompute::kFull},
                    ParityCase{2, ScheduleKind::kZbH1, 1, Recompute::kNone},
                    ParityCase{4, ScheduleKind::kZbH1, 1, Recompute::kFull},
                    ParityCase{2, ScheduleKind::kZbV, 2, Recompute::kNone},
                    ParityCase{4, ScheduleKind::kZbV, 2, Recompute::kFull},
                    ParityCase{2, ScheduleKind::kDualPipeV, 2, Recompute::kNone},
                    ParityCase{4, ScheduleKind::kDualPipeV, 2, Recompute::kFull}),
    CaseName);

double RelDiff(double a, double b) { return std::abs(a - b) / std::max(1e-30, std::abs(b)); }

// dp = 2 with half the micro-batches sees the same global batch: fp32 rounding apart. The two
// sum the gradients in different orders, and AdamW divides each update by the gradient's own
// running magnitude, so an element whose gradient is nearly zero turns its last-bit difference
// into a visible fraction of the step (lr = 1e-2): across equally exact roundings of the
// attention forward the worst single weight differed by 1.7e-5 to 1.3e-4, always in the same
// few weights, while the RMS difference over all 234,880 weights stayed near 3e-7. So the RMS
// is held tightly and the worst element only below a tenth of one step.
TEST(EngineDataParallel, MatchesSingleReplicaWithinRounding) {
  RunResult one = RunEngine(Options(1, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 8), Tiny());
  for (int pp : {1, 2}) {
    EngineSetup o = Options(pp, 2, ScheduleKind::k1F1B, 1, Recompute::kNone, 4);
    o.train.bucket_bytes = 16 << 10;  // several buckets per stage
    RunResult two = RunEngine(o, Tiny());
    ASSERT_EQ(two.losses.size(), one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) {
      EXPECT_LT(RelDiff(two.losses[i], one.losses[i]), 1e-5) << "pp " << pp << " step " << i;
    }
    double worst = 0, squares = 0;
    size_t count = 0;
    for (const auto& [name, w] : one.weights) {
      const std::vector<float>& v = two.weights.at(name);
      for (size_t k = 0; k < w.size(); ++k, ++count) {
        const double d = std::abs(double(v[k]) - w[k]);
        worst = std::max(worst, d);
        squares += d * d;
      }
    }
    ASSERT_GT(count, 0u);
    EXPECT_LT(std::sqrt(squares / static_cast<double>(count)), 2e-6) << "pp " << pp;
    EXPECT_LT(worst, 1e-3) << "pp " << pp;
  }
}

// A plan's per-stage recomputation and explicit boundaries: still bit-identical to one stage,
// and only the recomputing rank's activation peak drops.
TEST(EnginePlanLayout, PerStageRecomputeAndBoundaries) {
  static const RunResult* ref = new RunResult(Reference(kMicroBatches));
  EngineSetup o = Options(2, 1, ScheduleKind::kGpipe, 1, Recompute::kNone, kMicroBatches);
  o.stage_boundaries = {0, 2, Tiny().num_layers()};
  RunResult plain = RunEngine(o, Tiny());
  o.stage_recompute = {Recompute::kFull, Recompute::kNone};
  RunResult mixed = RunEngine(o, Tiny());
  EXPECT_EQ(plain.losses, ref->losses);
  EXPECT_EQ(mixed.losses, ref->losses);
  EXPECT_EQ(mixed.weights, ref->weights);

  auto peaks = [&](const EngineSetup& opts) {
    auto e = MakeEngine(Tiny(), opts);
    EXPECT_TRUE(e.ok()) << e.status();
    std::vector<int64_t> out(2, 0);
    if (!e.ok()) return out;
    auto s = (*e)->Step();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return out;
    for (const RankTimes& t : s->ranks) out[t.pipeline_rank] = t.peak_activation_bytes;
    return out;
  };
  std::vector<int64_t> with = peaks(o);
  o.stage_recompute.clear();
  std::vector<int64_t> without = peaks(o);
  EXPECT_LT(with[0] * 2, without[0]);
  EXPECT_EQ(with[1], without[1]);

  o.stage_recompute = {Recompute::kFull};  // one entry for two stages
  auto bad = MakeEngine(Tiny(), o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("per-stage recompute"), std::string::npos);
}

// dp runs are bit-stable run to run (the all-reduce sums in a fixed order).
TEST(EngineDataParallel, BitStableAcrossRuns) {
  EngineSetup o = Options(2, 2, ScheduleKind::kZbH1, 1, Recompute::kNone, 4);
  RunResult a = RunEngine(o, Tiny()), b = RunEngine(o, Tiny());
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.weights, b.weights);
}

// Tensor and sequence parallelism under the thread sanitizer (this binary is labelled tsan): the
// layers' collectives run on the rank threads of tp 2 x pp 2 x dp 2, bit-identical to pp 1
// (tests/runtime/tensor_parallel_test.cc has the rest).
TEST(EngineTensorParallel, RankThreadsOfEveryDimensionAgree) {
  EngineSetup flat = Options(1, 2, ScheduleKind::k1F1B, 1, Recompute::kNone, 2);
  flat.tp = 2;
  flat.sequence_parallel = true;
  EngineSetup deep = flat;
  deep.pp = 2;
  RunResult a = RunEngine(flat, Tiny()), b = RunEngine(deep, Tiny());
  ASSERT_EQ(a.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.weights, b.weights);
}

// A GPT whose matrix products are big enough to be cut over a rank's threads (512 tokens per
// micro-batch: 512 x 768 x 256 and up; Note [GEMM split] in kernels/cpu/gemm.cc).
LayerGraph Wide() {
  auto g = GptModel("wide", {.layers = 1, .hidden = 256, .heads = 4, .seq = 64, .vocab = 256}, 8);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

EngineSetup WithThreads(int pp, int threads) {
  EngineSetup o = Options(pp, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 2);
  o.train.threads_per_rank = threads;
  return o;
}

// docs/runtime.md, "Threads per rank": pp = 2 with 2 threads per rank is pp = 1 with 2 threads
// per rank, bit for bit; and no result depends on the thread count at all.
TEST(EngineThreads, BitIdenticalAcrossDepthAndThreadCounts) {
  const LayerGraph g = Wide();
  const RunResult want = RunEngine(WithThreads(1, 2), g);
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_GT(want.losses.front(), want.losses.back());
  ExpectSameRun(RunEngine(WithThreads(2, 2), g), want, "pp=2, 2 threads per rank");
  ExpectSameRun(RunEngine(WithThreads(1, 1), g), want, "pp=1, 1 thread");
  ExpectSameRun(RunEngine(WithThreads(2, 1), g), want, "pp=2, 1 thread per rank");
  ExpectSameRun(RunEngine(WithThreads(1, 3), g), want, "pp=1, 3 threads");
}

TEST(EngineThreads, AutomaticSharesTheCoresAndIsReported) {
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = CPU_COUNT(&set);
  for (int pp : {1, 2}) {
    auto e = MakeEngine(Tiny(), WithThreads(pp, 0));
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ((*e)->threads_per_rank(), std::max(1, cores / pp)) << "pp " << pp;
    auto s = (*e)->Step();
    ASSERT_TRUE(s.ok()) << s.status();
    for (const RankTimes& t : s->ranks) EXPECT_EQ(t.threads, (*e)->threads_per_rank());
    for (const RankTimes& t : (*e)->Summary().ranks) EXPECT_EQ(t.threads, (*e)->threads_per_rank());
  }
  auto three = MakeEngine(Tiny(), WithThreads(2, 3));
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ((*three)->threads_per_rank(), 3);
  for (int bad : {-1, 256}) {
    auto e = MakeEngine(Tiny(), WithThreads(1, bad));
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find("TrainOptions.threads_per_rank = "), std::string::npos)
        << e.status();
  }
}

// GPipe holds all 8 micro-batches' activations; recomputation keeps only their stage inputs.
TEST(EngineMemory, RecomputeLowersPeakActivations) {
  auto peak = [](Recompute rc) {
    auto e = MakeEngine(Tiny(), Options(2, 1, ScheduleKind::kGpipe, 1, rc, 8));
    EXPECT_TRUE(e.ok()) << e.status();
    int64_t worst = 0;
    if (!e.ok()) return worst;
    auto s = (*e)->Step();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return worst;
    for (const RankTimes& t : s->ranks) worst = std::max(worst, t.peak_activation_bytes);
    return worst;
  };
  int64_t keep = peak(Recompute::kNone), recompute = peak(Recompute::kFull);
  EXPECT_GT(keep, 0);
  EXPECT_LT(recompute * 3, keep) << "recompute " << recompute << " vs " << keep;
}

// --- Faults ---------------------------------------------------------------------------------

enum class Fault { kNone, kError, kThrow, kStall, kNan };

// Identity on [B, T, C] that misbehaves on its `trigger`-th forward call (counting from 1).
class FaultLayer final : public Layer {
 public:
  FaultLayer(Fault fault, int trigger, std::shared_ptr<std::atomic<int>> calls)
      : fault_(fault), trigger_(trigger), calls_(std::move(calls)) {}
  absl::string_view kind() const override { return "fault"; }
  absl::StatusOr<Tensor> Forward(const Tensor& x, const LayerContext& ctx, Saved*) override {
    Tensor y = x.Clone(ctx.allocator);
    if (++*calls_ != trigger_) return y;
    switch (fault_) {
      case Fault::kError:
        return absl::InternalError("injected layer failure");
      case Fault::kThrow:
        throw std::runtime_error("injected exception");
      case Fault::kStall:
        std::this_thread::sleep_for(std::chrono::milliseconds(5000));
        return y;
      case Fault::kNan:
        y.data<float>()[0] = std::nanf("");
        return y;
      case Fault::kNone:
        break;
    }
    return y;
  }
  absl::StatusOr<Tensor> BackwardInput(const Tensor& dy, const LayerContext& ctx, Saved*) override {
    return dy.Clone(ctx.allocator);
  }
  absl::Status BackwardWeight(const LayerContext&, Saved*) override { return absl::OkStatus(); }

 private:
  Fault fault_;
  int trigger_;
  std::shared_ptr<std::atomic<int>> calls_;
};

class FaultSpec final : public LayerSpec {
 public:
  FaultSpec(Fault fault, int trigger) : fault_(fault), trigger_(trigger) {}
  std::string kind() const override { return "fault"; }
  Cost GetCost(const MicroBatchShape&, int64_t input_bytes) const override {
    Cost c;
    c.output_bytes = input_bytes;
    return c;
  }
  absl::StatusOr<std::unique_ptr<Layer>> Create(const InitContext&) const override {
    return std::unique_ptr<Layer>(new FaultLayer(fault_, trigger_, calls_));
  }
  std::string Config() const override { return "test"; }

 private:
  Fault fault_;
  int trigger_;
  // Shared by every instance: counts calls over all replicas.
  std::shared_ptr<std::atomic<int>> calls_ = std::make_shared<std::atomic<int>>(0);
};

// gpt-tiny-like model with a fault layer after block 1 (layer 3 of 9: stage 1 of pp=3).
LayerGraph FaultyModel(Fault fault, int trigger) {
  ModelBuilder b("faulty", {.batch = 2, .seq_len = 16});
  b.Add("embed", layers::Embedding(256, 16, 32));
  b.Add("blocks.0", layers::TransformerBlock(32, 4));
  b.Add("blocks.1", layers::TransformerBlock(32, 4));
  b.Add("fault", std::make_shared<FaultSpec>(fault, trigger));
  b.Add("blocks.2", layers::TransformerBlock(32, 4));
  b.Add("ln_f", layers::LayerNorm(32));
  b.Add("lm_head", layers::LmHead(32, 256));
  b.Add("loss", layers::CrossEntropyLoss());
  auto g = b.Build();
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

struct FaultRun {
  absl::Status status;
  WeightMap before, after;
  double seconds = 0;
};

// Step 0 succeeds; the fault fires during step 1 (forward call 4 + 1 of the stage's 4 per step).
FaultRun RunFault(Fault fault, absl::Duration timeout) {
  LayerGraph g = FaultyModel(fault, 6);
  EngineSetup o = Options(3, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 4);
  o.stage_boundaries = {0, 3, 5, 8};
  o.timeout = timeout;
  auto e = MakeEngine(g, o);
  EXPECT_TRUE(e.ok()) << e.status();
  FaultRun r;
  auto first = (*e)->Step();
  EXPECT_TRUE(first.ok()) << first.status();
  r.before = ToMap((*e)->Weights());
  auto t0 = std::chrono::steady_clock::now();
  auto second = (*e)->Step();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.status = second.status();
  r.after = ToMap((*e)->Weights());
  auto third = (*e)->Step();  // a failed engine refuses to continue
  EXPECT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kFailedPrecondition);
  return r;
}

TEST(EngineFaults, LayerErrorStopsEveryRankAndNamesIt) {
  FaultRun r = RunFault(Fault::kError, absl::Seconds(30));
  ASSERT_FALSE(r.status.ok());
  std::string msg(r.status.message());
  EXPECT_NE(msg.find("injected layer failure"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("F1@s1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("layer 3 (fault)"), std::string::npos) << msg;
  EXPECT_EQ(r.before, r.after) << "a failed step must not be applied on any rank";
}

TEST(EngineFaults, ExceptionBecomesAnError) {
  FaultRun r = RunFault(Fault::kThrow, absl::Seconds(30));
  ASSERT_FALSE(r.status.ok());
  EXPECT_NE(std::string(r.status.message()).find("injected exception"), std::string::npos)
      << r.status;
  EXPECT_EQ(r.before, r.after);
}

TEST(EngineFaults, NonFiniteLossStopsTheStep) {
  FaultRun r = RunFault(Fault::kNan, absl::Seconds(30));
  ASSERT_FALSE(r.status.ok());
  std::string msg(r.status.message());
  EXPECT_NE(msg.find("non-finite loss"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 2"), std::string::npos) << msg;  // the last stage detects it
  EXPECT_EQ(r.before, r.after);
}

TEST(EngineFaults, StalledRankTimesOutTheOthers) {
  // The timeout leaves the healthy first step room on a loaded machine or under TSan (0.3 s did
  // not, with the suite running in parallel under TSan); the stall outlasts it by 3x.
  FaultRun r = RunFault(Fault::kStall, absl::Milliseconds(1500));
  ASSERT_FALSE(r.status.ok());
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
  std::string msg(r.status.message());
  EXPECT_NE(msg.find("timed out"), std::string::npos) << msg;
  EXPECT_NE(msg.find("from rank 1"), std::string::npos) << msg;  // waiting on the stalled rank
  EXPECT_EQ(r.before, r.after);
}

// --- Options, summary, trace, checkpoints -----------------------------------------------------

TEST(EngineSetupTest, RejectsBadShapesClearly) {
  EngineSetup o = Options(16, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 8);
  auto e = MakeEngine(Tiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(std::string(e.status().message()).find("non-empty stages"), std::string::npos)
      << e.status();
  o = Options(2, 1, ScheduleKind::kInterleaved, 2, Recompute::kNone, 3);
  e = MakeEngine(Tiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(std::string(e.status().message()).find("multiple"), std::string::npos) << e.status();
  o = Options(2, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 8);
  o.stage_boundaries = {0, 5, 5};
  e = MakeEngine(Tiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(std::string(e.status().message()).find("boundaries"), std::string::npos) << e.status();
}

TEST(EngineSetupTest, RejectsNonFiniteOrOutOfRangeTrainOptionsByField) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    const char* field;  // as the message names it
    std::function<void(TrainOptions&)> set;
  };
  std::vector<Case> cases;
  for (float v : {nan, inf, -inf, -1.0f}) {
    cases.push_back({"TrainOptions.clip_norm", [v](TrainOptions& o) { o.clip_norm = v; }});
    cases.push_back({"TrainOptions.optimizer.weight_decay",
                     [v](TrainOptions& o) { o.optimizer.weight_decay = v; }});
  }
  for (float v : {nan, inf, -0.5f, 1.5f}) {
    cases.push_back({"TrainOptions.min_lr_ratio", [v](TrainOptions& o) { o.min_lr_ratio = v; }});
  }
  cases.push_back({"TrainOptions.warmup_steps", [](TrainOptions& o) { o.warmup_steps = -1; }});
  cases.push_back({"TrainOptions.base_batch", [](TrainOptions& o) { o.base_batch = 0; }});
  for (const Case& c : cases) {
    EngineSetup o = Options(1, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 2);
    c.set(o.train);
    auto e = MakeEngine(Tiny(), o);
    ASSERT_FALSE(e.ok()) << c.field;
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
    EXPECT_NE(std::string(e.status().message()).find(c.field), std::string::npos) << e.status();
  }
  // The edges of the ranges are accepted: no clipping, no decay, a constant or a decayed lr.
  EngineSetup o = Options(1, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 2);
  o.train.clip_norm = 0;
  o.train.optimizer.weight_decay = 0;
  o.train.min_lr_ratio = 1;
  EXPECT_TRUE(MakeEngine(Tiny(), o).ok());
  o.train.min_lr_ratio = 0;
  EXPECT_TRUE(MakeEngine(Tiny(), o).ok());
}

TEST(EngineBoundaries, BalancedSplitIsContiguousAndMinimisesTheMax) {
  LayerGraph g = Tiny();
  for (int stages = 1; stages <= g.num_layers(); ++stages) {
    auto b = BalancedBoundaries(ToModelCosts(g), stages);
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(b->size(), static_cast<size_t>(stages + 1));
    EXPECT_EQ(b->front(), 0);
    EXPECT_EQ(b->back(), g.num_layers());
    for (int s = 0; s < stages; ++s) EXPECT_LT((*b)[s], (*b)[s + 1]);
  }
  // Brute force over every 3-way split.
  auto cost = [&](int i) {
    return std::max(1.0, g.node(i).cost.forward_flops + g.node(i).cost.backward_flops);
  };
  auto range = [&](int a, int b) {
    double s = 0;
    for (int i = a; i < b; ++i) s += cost(i);
    return s;
  };
  double best = 1e300;
  const int n = g.num_layers();
  for (int x = 1; x < n; ++x) {
    for (int y = x + 1; y < n; ++y) {
      best = std::min(best, std::max({range(0, x), range(x, y), range(y, n)}));
    }
  }
  auto b = BalancedBoundaries(ToModelCosts(g), 3);
  ASSERT_TRUE(b.ok());
  EXPECT_DOUBLE_EQ(std::max({range(0, (*b)[1]), range((*b)[1], (*b)[2]), range((*b)[2], n)}), best);
}

TEST(EngineReport, SummaryAndTraceDescribeEveryRank) {
  EngineSetup o = Options(2, 2, ScheduleKind::k1F1B, 1, Recompute::kNone, 4);
  auto e = MakeEngine(Tiny(), o);
  ASSERT_TRUE(e.ok()) << e.status();
  for (int i = 0; i < 2; ++i) ASSERT_TRUE((*e)->Step().ok());
  RunSummary s = (*e)->Summary();
  ASSERT_EQ(s.ranks.size(), 4u);
  EXPECT_EQ(s.steps, 2);
  for (const RankTimes& t : s.ranks) {
    EXPECT_GT(t.compute, 0);
    EXPECT_GT(t.wall, 0);
    EXPECT_GT(t.peak_memory_bytes, t.static_memory_bytes);
    EXPECT_EQ(t.stage_f.size(), 1u);
    EXPECT_GT(t.stage_f[0], 0);
  }
  // The measured bubble is what the rank times say: 1 - busy / wall, summed over ranks.
  double busy = 0, wall = 0;
  for (const RankTimes& t : s.ranks) {
    busy += t.compute + t.recompute + t.optimizer;
    wall += t.wall;
  }
  EXPECT_NEAR(s.measured_bubble, 1 - busy / wall, 1e-12);
  EXPECT_GT(s.measured_bubble, 0);  // pp = 2 always idles in fill and drain
  EXPECT_LT(s.measured_bubble, 1);
  EXPECT_GT(s.predicted_step_s, 0);
  EXPECT_FALSE(s.bottleneck_reason.empty());

  std::string trace = EngineChromeTrace((*e)->topology(), (*e)->Events());
  auto j = nlohmann::json::parse(trace, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  int starts = 0, finishes = 0, slices = 0;
  std::map<int, int> pids;
  for (const auto& ev : j["traceEvents"]) {
    std::string ph = ev["ph"];
    if (ph == "s") ++starts;
    if (ph == "f") ++finishes;
    if (ph == "X") {
      ++slices;
      ++pids[ev["pid"].get<int>()];
    }
  }
  // 2 steps x 2 replicas x 4 micro-batches x (activation + gradient) messages.
  EXPECT_EQ(starts, 2 * 2 * 4 * 2);
  EXPECT_EQ(finishes, starts);
  EXPECT_EQ(pids.size(), 2u);
  EXPECT_GT(slices, 0);

  SimResult tl = MeasuredTimeline((*e)->schedule(), (*e)->topology(), (*e)->Events(), 1, 0);
  EXPECT_EQ(tl.timeline.size(), 2u * 4u * 2u);  // 2 ranks x 4 micro-batches x (F, B)
  EXPECT_GT(tl.makespan, 0);
  EXPECT_NE(ToSvg((*e)->schedule(), tl).find("<svg"), std::string::npos);
}

// Note [Receives posted ahead] (rank_p2p.cc): a RECV only posts; its wait happens at the action
// that reads the buffer. Rank 1's program is changed to post micro-batch 1's activation receive
// before the forward of micro-batch 0, so the wait for it must come after that forward.
TEST(EngineReceives, PostedAheadAndWaitedForAtTheirConsumer) {
  auto schedule = GenerateSchedule({ScheduleKind::kGpipe, 2, 2, 1});
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  ASSERT_TRUE(LowerComm(*schedule).ok());
  std::vector<Action>& prog = schedule->programs[1].actions;
  const Action recv1{ActionKind::kRecvF, 1, 1}, f0{ActionKind::kF, 1, 0};
  auto at = [&](const Action& a) { return std::find(prog.begin(), prog.end(), a); };
  ASSERT_NE(at(recv1), prog.end());
  ASSERT_LT(at(f0), at(recv1));  // the generator receives right before the forward
  prog.erase(at(recv1));
  prog.insert(at(f0), recv1);
  const LayerGraph graph = Tiny();
  auto run = RunSpecFromSchedule(graph, *std::move(schedule), 1);
  ASSERT_TRUE(run.ok()) << run.status();
  auto world = World::InProcess(WorldOptions{});
  ASSERT_TRUE(world.ok()) << world.status();
  auto data = OpenDataset("synthetic", graph.shape().seq_len, 1);
  ASSERT_TRUE(data.ok()) << data.status();
  auto e =
      Engine::Create(graph, *std::move(run), TrainOptions{}, *std::move(data), *std::move(world));
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE((*e)->Step().ok());
  const std::vector<RankEvent> events = (*e)->Events()[1];  // a copy: Events() is a temporary
  const RankEvent* wait = nullptr;
  const RankEvent* forward = nullptr;
  for (const RankEvent& ev : events) {
    if (ev.kind == EventKind::kRecvWait && ev.action == recv1) wait = &ev;
    if (ev.kind == EventKind::kCompute && ev.action == f0) forward = &ev;
  }
  ASSERT_NE(wait, nullptr);
  ASSERT_NE(forward, nullptr);
  EXPECT_GE(wait->start, forward->end);
}

class EngineCheckpointTest : public testing_util::ScratchDirTest {};

// A checkpoint saved by a pp=2 run resumes under pp=4 zb-h1 bit-identically to a run that was
// never interrupted.
TEST_F(EngineCheckpointTest, ResumesUnderAnotherPlan) {
  LayerGraph g = Tiny();
  EngineSetup o = Options(2, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 8);
  o.train.steps = 4;
  RunResult whole;
  {
    auto e = MakeEngine(g, o);
    ASSERT_TRUE(e.ok()) << e.status();
    for (int i = 0; i < 4; ++i) {
      auto s = (*e)->Step();
      ASSERT_TRUE(s.ok()) << s.status();
      whole.losses.push_back(s->result.loss);
    }
    whole.weights = ToMap((*e)->Weights());
  }
  {
    auto e = MakeEngine(g, o);
    ASSERT_TRUE(e.ok());
    for (int i = 0; i < 2; ++i) ASSERT_TRUE((*e)->Step().ok());
    ASSERT_TRUE((*e)->Save(Path("ck")).ok());
  }
  EngineSetup o4 = Options(4, 1, ScheduleKind::kZbH1, 1, Recompute::kNone, 8);
  o4.train.steps = 4;
  auto e = MakeEngine(g, o4);
  ASSERT_TRUE(e.ok()) << e.status();
  absl::Status rs = (*e)->Resume(Path("ck"));
  ASSERT_TRUE(rs.ok()) << rs;
  EXPECT_EQ((*e)->step(), 2);
  for (int i = 2; i < 4; ++i) {
    auto s = (*e)->Step();
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->result.loss, whole.losses[i]) << "step " << i;
  }
  EXPECT_EQ(ToMap((*e)->Weights()), whole.weights);
  // The single-stage trainer reads it too.
  auto t = Trainer::Create(g, o.micro_batches, o.train);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE((*t)->Resume(Path("ck")).ok());
}

}  // namespace
}  // namespace pipewright

namespace pipewright {
namespace {

TEST(EngineDevice, CudaWithoutAGpuFailsClearlyAtCreate) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  EngineSetup o = Options(2, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 4);
  o.device = Device::Cuda(0);
  auto e = MakeEngine(Tiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(e.status().message().find("no CUDA GPU"), std::string::npos) << e.status();
}

TEST(EngineDevice, NcclNeedsOneGpuPerRank) {
  EngineSetup o = Options(2, 1, ScheduleKind::k1F1B, 1, Recompute::kNone, 4);
  o.comm = CommBackend::kNccl;  // on the CPU
  auto e = MakeEngine(Tiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("NCCL"), std::string::npos) << e.status();
  o.comm = CommBackend::kMpi;  // connects processes, not threads
  e = MakeEngine(Tiny(), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("launcher"), std::string::npos) << e.status();
}

}  // namespace
}  // namespace pipewright
