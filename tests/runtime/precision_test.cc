// Mixed precision on the CPU: 16-bit matrix-product inputs with fp32 accumulation and fp32
// master weights (bf16 and fp16), and fp16 dynamic loss scaling that skips overflowing steps on
// every rank, backs off and grows. Device-independent: the CUDA path keeps the same rules.
#include "pipewright/precision.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/checkpoint.h"
#include "pipewright/engine.h"
#include "pipewright/layer.h"
#include "pipewright/train.h"
#include "tests/runtime/engine_util.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

using WeightMap = std::map<std::string, std::vector<float>>;

using testing_util::Tiny;

constexpr int64_t kMicroBatches = 4;  // of the single-stage runs

TrainOptions Train(Precision p, int64_t steps = 4) {
  TrainOptions o;
  o.steps = steps;
  o.seed = 7;
  o.lr = 1e-2f;
  o.warmup_steps = 1;
  o.precision = p;
  return o;
}

std::vector<float> RandomVector(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double RelError(const std::vector<float>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

float Round(float x, DType d) {
  return d == DType::kBF16 ? cpu::Bf16ToFloat(cpu::FloatToBf16(x))
                           : cpu::HalfToFloat(cpu::FloatToHalf(x));
}

// ---- LossScaler ----

TEST(LossScaler, DisabledNeverSkipsAndKeepsScaleOne) {
  LossScaler s;
  EXPECT_FALSE(s.enabled());
  EXPECT_EQ(s.scale(), 1.0f);
  EXPECT_TRUE(s.Update(false));
  EXPECT_EQ(s.scale(), 1.0f);
}

TEST(LossScaler, BacksOffOnOverflowAndGrowsAfterTheWindow) {
  LossScaleOptions o;
  o.initial_scale = 1024;
  o.growth_interval = 3;
  o.min_scale = 256;
  o.max_scale = 4096;
  LossScaler s(o);
  EXPECT_FALSE(s.Update(false));
  EXPECT_EQ(s.scale(), 512);
  EXPECT_FALSE(s.Update(false));
  EXPECT_FALSE(s.Update(false));
  EXPECT_EQ(s.scale(), 256);  // clamped at min_scale
  EXPECT_EQ(s.skipped_steps(), 3);
  EXPECT_TRUE(s.Update(true));
  EXPECT_TRUE(s.Update(true));
  EXPECT_EQ(s.scale(), 256);
  EXPECT_TRUE(s.Update(true));  // the third finite step in a row
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.good_steps(), 0);
  for (int i = 0; i < 9; ++i) s.Update(true);
  EXPECT_EQ(s.scale(), 4096);  // clamped at max_scale
}

TEST(LossScaler, ValidateNamesTheBadField) {
  LossScaleOptions o;
  o.initial_scale = 0;
  EXPECT_NE(LossScaler::Validate(o).message().find("LossScaleOptions.initial_scale = 0"),
            std::string::npos);
  o = LossScaleOptions();
  o.growth_interval = 0;
  EXPECT_NE(LossScaler::Validate(o).message().find("LossScaleOptions.growth_interval = 0"),
            std::string::npos);
  o = LossScaleOptions();
  o.backoff_factor = 1.5f;
  EXPECT_FALSE(LossScaler::Validate(o).ok());
  EXPECT_TRUE(LossScaler::Validate(LossScaleOptions()).ok());
}

TEST(Precision, ParseAndNames) {
  EXPECT_EQ(*ParsePrecision("bf16"), Precision::kBf16);
  EXPECT_EQ(ComputeDType(Precision::kFp16), DType::kF16);
  EXPECT_EQ(ComputeDType(Precision::kFp32), DType::kF32);
  EXPECT_STREQ(PrecisionName(Precision::kBf16), "bf16");
  EXPECT_FALSE(ParsePrecision("fp8").ok());
}

// ---- Linear in 16 bits ----

class LinearMixedTest : public testing::TestWithParam<DType> {};

TEST_P(LinearMixedTest, RoundsInputsAccumulatesInFp32AndSavesHalfTheBytes) {
  const DType cd = GetParam();
  const int64_t rows = 37, in = 48, out = 29;
  InitContext init;
  init.seed = 3;
  init.name = "lin";
  auto layer = layers::Linear(in, out)->Create(init);
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<Parameter*> params = (*layer)->Parameters();
  const std::vector<float> xv = RandomVector(rows * in, 11), dyv = RandomVector(rows * out, 12);
  Tensor x = Tensor::FromVector({rows, in}, xv);
  Tensor dy = Tensor::FromVector({rows, out}, dyv);
  // Bias non-zero so its gradient and addition are exercised.
  std::vector<float> b = RandomVector(out, 13);
  std::copy(b.begin(), b.end(), params[1]->value.data<float>());
  const float* w = params[0]->value.data<float>();

  LayerContext ctx;
  ctx.compute_dtype = cd;
  Saved saved;
  auto y = (*layer)->Forward(x, ctx, &saved);
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_EQ(saved.tensors.size(), 1u);
  EXPECT_EQ(saved.tensors[0].dtype(), cd);
  EXPECT_EQ(saved.tensors[0].nbytes(), x.nbytes() / 2);

  // Reference: the same 16-bit-rounded operands, multiplied in double.
  std::vector<double> yref(rows * out), yexact(rows * out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b[o], exact = b[o];
      for (int64_t k = 0; k < in; ++k) {
        acc += double(Round(xv[r * in + k], cd)) * Round(w[o * in + k], cd);
        exact += double(xv[r * in + k]) * w[o * in + k];
      }
      yref[r * out + o] = acc;
      yexact[r * out + o] = exact;
    }
  }
  std::vector<float> yv = y->ToVector();
  EXPECT_LT(RelError(yv, yref), 1e-6);  // fp32 accumulation of exactly those operands
  const double vs_fp32 = RelError(yv, yexact);
  EXPECT_GT(vs_fp32, 1e-5);  // the rounding really happened
  EXPECT_LT(vs_fp32, cd == DType::kBF16 ? 1e-2 : 2e-3);

  auto dx = (*layer)->BackwardInput(dy, ctx, &saved);
  ASSERT_TRUE(dx.ok()) << dx.status();
  ASSERT_EQ(saved.tensors.size(), 2u);
  EXPECT_EQ(saved.tensors[1].dtype(), cd);
  std::vector<double> dxref(rows * in);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < in; ++k) {
      double acc = 0;
      for (int64_t o = 0; o < out; ++o) {
        acc += double(Round(dyv[r * out + o], cd)) * Round(w[o * in + k], cd);
      }
      dxref[r * in + k] = acc;
    }
  }
  EXPECT_LT(RelError(dx->ToVector(), dxref), 1e-6);

  // Weight gradients accumulate (+=) in fp32 onto what is there.
  params[0]->grad.Fill(0.5f);
  params[1]->grad.Fill(0.25f);
  ASSERT_TRUE((*layer)->BackwardWeight(ctx, &saved).ok());
  EXPECT_TRUE(saved.empty());
  std::vector<double> dwref(out * in), dbref(out);
  for (int64_t o = 0; o < out; ++o) {
    double bacc = 0.25;
    for (int64_t k = 0; k < in; ++k) {
      double acc = 0.5;
      for (int64_t r = 0; r < rows; ++r) {
        acc += double(Round(dyv[r * out + o], cd)) * Round(xv[r * in + k], cd);
      }
      dwref[o * in + k] = acc;
    }
    for (int64_t r = 0; r < rows; ++r) bacc += Round(dyv[r * out + o], cd);
    dbref[o] = bacc;
  }
  EXPECT_LT(RelError(params[0]->grad.ToVector(), dwref), 1e-6);
  EXPECT_LT(RelError(params[1]->grad.ToVector(), dbref), 1e-6);
  EXPECT_EQ(params[0]->value.dtype(), DType::kF32);  // master weights stay fp32
}

INSTANTIATE_TEST_SUITE_P(HalfTypes, LinearMixedTest, testing::Values(DType::kBF16, DType::kF16),
                         [](const testing::TestParamInfo<DType>& i) {
                           return std::string(DTypeName(i.param));
                         });

// ---- whole training runs ----

std::vector<StepResult> RunTrainer(const TrainOptions& o, WeightMap* weights = nullptr) {
  auto t = Trainer::Create(Tiny(), kMicroBatches, o);
  EXPECT_TRUE(t.ok()) << t.status();
  std::vector<StepResult> out;
  if (!t.ok()) return out;
  for (int i = 0; i < o.steps; ++i) {
    auto s = (*t)->Step();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) break;
    out.push_back(*s);
  }
  if (weights != nullptr) {
    for (Parameter* p : (*t)->Parameters()) (*weights)[p->name] = p->value.ToVector();
  }
  return out;
}

TEST(MixedPrecisionTraining, Bf16AndFp16TrackFp32Closely) {
  std::vector<StepResult> ref = RunTrainer(Train(Precision::kFp32));
  ASSERT_EQ(ref.size(), 4u);
  for (Precision p : {Precision::kBf16, Precision::kFp16}) {
    std::vector<StepResult> run = RunTrainer(Train(p));
    ASSERT_EQ(run.size(), ref.size()) << PrecisionName(p);
    bool differs = false;
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_NEAR(run[i].loss, ref[i].loss, 0.01 * ref[i].loss) << PrecisionName(p) << " " << i;
      EXPECT_FALSE(run[i].skipped);
      differs |= run[i].loss != ref[i].loss;
    }
    EXPECT_TRUE(differs) << PrecisionName(p) << " ran in fp32";
    EXPECT_LT(run.back().loss, run.front().loss) << PrecisionName(p) << " does not learn";
  }
}

using testing_util::EngineSetup;
using testing_util::MakeEngine;

// The single-stage runs' global batch over pp x dp ranks.
EngineSetup Layout(const TrainOptions& t, int pp, int dp, ScheduleKind kind) {
  EngineSetup o;
  o.train = t;
  o.micro_batches = kMicroBatches / dp;
  o.pp = pp;
  o.dp = dp;
  o.schedule = kind;
  o.timeout = absl::Seconds(30);
  return o;
}

std::vector<StepResult> RunEngine(const EngineSetup& o, WeightMap* weights = nullptr) {
  auto e = MakeEngine(Tiny(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  std::vector<StepResult> out;
  if (!e.ok()) return out;
  for (int i = 0; i < o.train.steps; ++i) {
    auto s = (*e)->Step();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) break;
    out.push_back(s->result);
  }
  if (weights != nullptr) {
    for (auto& [name, t] : (*e)->Weights()) (*weights)[name] = t.ToVector();
  }
  return out;
}

// The numerics promise holds in mixed precision too: any depth and schedule gives the
// single-stage run's losses and weights bit for bit.
TEST(MixedPrecisionTraining, PipelineIsBitIdenticalToSingleStageInBf16) {
  const TrainOptions t = Train(Precision::kBf16, 3);
  WeightMap ref_w, w;
  std::vector<StepResult> ref = RunTrainer(t, &ref_w);
  for (auto [pp, kind] : {std::pair{4, ScheduleKind::k1F1B}, std::pair{2, ScheduleKind::kZbH1}}) {
    std::vector<StepResult> run = RunEngine(Layout(t, pp, 1, kind), &w);
    ASSERT_EQ(run.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(run[i].loss, ref[i].loss) << pp << " " << i;
    EXPECT_EQ(w, ref_w) << "pp=" << pp;
  }
}

// Note [16-bit weights once a step]: the engine's per-step 16-bit copies give the bits of a cast
// at every use, over several steps (so a copy outliving its step's update would show), at pp 2
// with two replicas and with a zero-bubble schedule; and they are made once a step. (An
// asynchronous replica's pull comes before RunStep's BeginStep, which drops the copies; its runs
// are not bit-reproducible, so they are not compared here.)
TEST(MixedPrecisionTraining, HalfWeightsOnceAStepGiveTheBitsOfEveryUse) {
  const TrainOptions t = Train(Precision::kBf16, 4);
  for (auto [pp, dp, kind] :
       {std::tuple{2, 2, ScheduleKind::k1F1B}, std::tuple{2, 1, ScheduleKind::kZbH1},
        std::tuple{1, 2, ScheduleKind::k1F1B}}) {
    {
      EngineSetup cached = Layout(t, pp, dp, kind);
      EngineSetup every = cached;
      every.hooks.half_weights_every_use = true;
      WeightMap w_cached, w_every;
      const std::vector<StepResult> a = RunEngine(cached, &w_cached);
      const std::vector<StepResult> b = RunEngine(every, &w_every);
      ASSERT_EQ(a.size(), b.size());
      ASSERT_EQ(a.size(), 4u);
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].loss, b[i].loss) << "pp " << pp << " dp " << dp << " step " << i;
      }
      EXPECT_EQ(w_cached, w_every) << "pp " << pp << " dp " << dp;
    }
  }
  HalfWeightCache cache;
  const Tensor master = Tensor::Zeros({4}, DType::kF32);
  int made = 0;
  auto make = [&]() -> absl::StatusOr<Tensor> {
    ++made;
    return Tensor::Zeros({4}, DType::kBF16);
  };
  ASSERT_TRUE(cache.GetOrMake(master, DType::kBF16, make).ok());
  ASSERT_TRUE(cache.GetOrMake(master, DType::kBF16, make).ok());
  EXPECT_EQ(made, 1);
  EXPECT_EQ(cache.size(), 1);
  cache.Clear();
  ASSERT_TRUE(cache.GetOrMake(master, DType::kBF16, make).ok());
  EXPECT_EQ(made, 2);
}

TrainOptions Overflowing(int64_t steps) {
  TrainOptions t = Train(Precision::kFp16, steps);
  t.loss_scale.initial_scale = 16777216.0f;  // 2^24: the scaled loss gradient overflows fp16
  t.loss_scale.growth_interval = 2;
  return t;
}

TEST(LossScaling, OverflowSkipsTheStepBacksOffThenTrainsAndGrows) {
  WeightMap initial, after;
  TrainOptions zero = Overflowing(0);
  RunTrainer(zero, &initial);
  std::vector<StepResult> one = RunTrainer(Overflowing(1), &after);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_TRUE(one[0].skipped);
  EXPECT_EQ(one[0].loss_scale, 16777216.0f);
  EXPECT_EQ(after, initial) << "a skipped step changed the weights";

  std::vector<StepResult> run = RunTrainer(Overflowing(8));
  ASSERT_EQ(run.size(), 8u);
  int first_applied = -1;
  for (int i = 0; i < 8; ++i) {
    if (!run[i].skipped) {
      first_applied = i;
      break;
    }
    if (i > 0) {
      EXPECT_EQ(run[i].loss_scale, run[i - 1].loss_scale / 2);
    }
  }
  ASSERT_GT(first_applied, 0) << "never overflowed or never recovered";
  // Two finite steps in a row double the scale (growth_interval = 2) unless it overflows again.
  ASSERT_LT(first_applied + 2, 8);
  if (!run[first_applied + 1].skipped) {
    EXPECT_EQ(run[first_applied + 2].loss_scale, 2 * run[first_applied].loss_scale);
  }
  EXPECT_LT(run.back().loss, run[first_applied].loss);
}

// The overflow decision is agreed across ranks: ranks that saw only finite gradients skip
// too, and every rank keeps the same scale, so pp x dp matches the single-stage run.
TEST(LossScaling, EveryRankSkipsTogetherAndMatchesSingleStage) {
  TrainOptions t = Overflowing(6);
  WeightMap ref_w, w;
  std::vector<StepResult> ref = RunTrainer(Overflowing(6), &ref_w);
  std::vector<StepResult> run = RunEngine(Layout(t, 2, 2, ScheduleKind::k1F1B), &w);
  ASSERT_EQ(run.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_EQ(run[i].skipped, ref[i].skipped) << i;
    EXPECT_EQ(run[i].loss_scale, ref[i].loss_scale) << i;
    EXPECT_NEAR(run[i].loss, ref[i].loss, 1e-5 * ref[i].loss) << i;
  }
  EXPECT_TRUE(run[0].skipped);
}

class LossScaleCheckpointTest : public testing_util::ScratchDirTest {};

TEST_F(LossScaleCheckpointTest, ResumeRestoresTheScaleAndContinuesBitIdentically) {
  TrainOptions t = Overflowing(7);
  std::vector<StepResult> whole = RunEngine(Layout(t, 2, 1, ScheduleKind::k1F1B));
  ASSERT_EQ(whole.size(), 7u);

  auto a = MakeEngine(Tiny(), Layout(t, 2, 1, ScheduleKind::k1F1B));
  ASSERT_TRUE(a.ok()) << a.status();
  for (int i = 0; i < 4; ++i) ASSERT_TRUE((*a)->Step().ok());
  ASSERT_TRUE((*a)->Save(Path("ck")).ok());
  // Resumed into another layout (the single-stage Trainer): the scale comes from the manifest.
  auto b = Trainer::Create(Tiny(), kMicroBatches, t);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*b)->Resume(Path("ck")).ok());
  for (int i = 4; i < 7; ++i) {
    auto s = (*b)->Step();
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->loss_scale, whole[i].loss_scale) << i;
    EXPECT_EQ(s->skipped, whole[i].skipped) << i;
    EXPECT_EQ(s->loss, whole[i].loss) << i;
  }
}

TEST(LossScaling, BadOptionsAreRejectedAtCreate) {
  TrainOptions t = Train(Precision::kFp16);
  t.loss_scale.growth_interval = 0;
  auto e = MakeEngine(Tiny(), Layout(t, 2, 1, ScheduleKind::k1F1B));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("LossScaleOptions.growth_interval"), std::string::npos);
  EXPECT_FALSE(Trainer::Create(Tiny(), kMicroBatches, t).ok());
}

}  // namespace
}  // namespace pipewright
