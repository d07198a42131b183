// Gradient compression (--grad-compression, docs/runtime.md "Gradient compression"): the bf16
// codec of the bucketed all-reduce on its own, over a local world of threads, and in engine
// runs with several replicas.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pipewright/comm.h"
#include "pipewright/engine.h"
#include "pipewright/train.h"
#include "runtime/grad_sync/grad_sync.h"
#include "tests/runtime/engine_util.h"

namespace pipewright {
namespace {

using internal::GradSyncBytes;
using testing_util::EngineSetup;
using testing_util::MakeEngine;

// Replica r's gradient: values with more mantissa bits than bf16 keeps, different per replica.
float GradValue(int r, int i) { return 0.3f + 0.01f * static_cast<float>(i) + 0.1234567f * r; }

// `steps` synchronizations of the same gradients over `dp` replicas (one thread each); returns
// every replica's sum of the gradients Finish left, over the steps.
std::vector<std::vector<double>> AppliedSums(int dp, int steps, GradCompression compression,
                                             int64_t numel, std::vector<GradSyncBytes>* bytes) {
  std::vector<std::unique_ptr<Communicator>> comms = CreateLocalWorld(dp);
  std::vector<std::vector<double>> sums(dp, std::vector<double>(numel, 0.0));
  bytes->assign(dp, {});
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(dp);
  for (int r = 0; r < dp; ++r) {
    threads.emplace_back([&, r] {
      // Two layers of one parameter each, so the step has two buckets.
      Parameter a{"a", Tensor::Zeros({numel / 2}), Tensor::Zeros({numel / 2}), true, "", {}};
      Parameter b{
          "b", Tensor::Zeros({numel - numel / 2}), Tensor::Zeros({numel - numel / 2}), true, "",
          {}};
      internal::GradSyncContext ctx;
      ctx.dp = comms[r].get();
      ctx.alloc = DefaultCpuAllocator();
      ctx.wait = [](Work& w, const std::string&) { return w.Wait(absl::Seconds(30)); };
      ctx.sync_device = [] { return absl::OkStatus(); };
      std::unique_ptr<internal::GradSync> sync = internal::CreateBucketedAllReduce(
          ctx, {internal::GradSyncStage{0, {{&a}, {&b}}}}, /*bucket_bytes=*/1, compression);
      for (int s = 0; s < steps && status[r].ok(); ++s) {
        sync->BeginStep();
        float* ga = a.grad.data<float>();
        float* gb = b.grad.data<float>();
        for (int64_t i = 0; i < numel; ++i) {
          (i < numel / 2 ? ga[i] : gb[i - numel / 2]) = GradValue(r, static_cast<int>(i));
        }
        status[r] = sync->LayerReady(0, 1);
        if (status[r].ok()) status[r] = sync->LayerReady(0, 0);
        if (status[r].ok()) status[r] = sync->Finish();
        for (int64_t i = 0; i < numel; ++i) {
          sums[r][i] += i < numel / 2 ? ga[i] : gb[i - numel / 2];
        }
        (*bytes)[r] = sync->StepBytes();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < dp; ++r) EXPECT_TRUE(status[r].ok()) << status[r];
  return sums;
}

// Error feedback: what the replicas apply over many steps tracks the exact fp32 sum to within
// one step's rounding, where rounding every step afresh would drift by `steps` roundings.
TEST(GradCompressionBf16, ErrorFeedbackKeepsTheSumOverStepsExact) {
  constexpr int kDp = 3, kSteps = 64;
  constexpr int64_t kN = 40;
  std::vector<GradSyncBytes> bytes;
  const auto sums = AppliedSums(kDp, kSteps, GradCompression::Bf16(), kN, &bytes);
  double worst_fed = 0, worst_naive = 0;
  for (int64_t i = 0; i < kN; ++i) {
    double exact = 0, naive = 0;
    for (int r = 0; r < kDp; ++r) {
      const float g = GradValue(r, static_cast<int>(i));
      exact += g;
      uint32_t bits;  // bf16 round to nearest even, as the codec's cast does
      std::memcpy(&bits, &g, 4);
      bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
      float q;
      std::memcpy(&q, &bits, 4);
      naive += q;
    }
    const double err = std::abs(sums[0][i] - kSteps * exact) / (kSteps * exact);
    worst_fed = std::max(worst_fed, err);
    worst_naive =
        std::max(worst_naive, std::abs(kSteps * naive - kSteps * exact) / (kSteps * exact));
    for (int r = 1; r < kDp; ++r)
      EXPECT_EQ(sums[r][i], sums[0][i]) << "replica " << r << " i " << i;
  }
  // One bf16 rounding of a single step's sum is ~2^-9 of it; spread over 64 steps, ~6e-5.
  EXPECT_LT(worst_fed, 1e-4);
  EXPECT_GT(worst_naive, 10 * worst_fed) << "the test's gradients round too exactly to tell";
  // Wire bytes of two buckets of kN / 2: an fp32 all-reduce would send 2 (dp - 1) / dp of each;
  // the bf16 all-gather sends each replica's half-size bucket to the dp - 1 others.
  for (const GradSyncBytes& b : bytes) {
    EXPECT_EQ(b.uncompressed, 2 * internal::RingAllReduceBytes(kN / 2 * 4, kDp));
    EXPECT_EQ(b.sent, 2 * internal::RingAllGatherBytes(kN / 2 * 2, kDp));
    EXPECT_EQ(b.sent, (kDp - 1) * kN * 2);
  }
}

TEST(GradCompressionNone, SendsFp32AndSumsExactly) {
  std::vector<GradSyncBytes> bytes;
  const auto sums = AppliedSums(2, 2, GradCompression::None(), 10, &bytes);
  for (int64_t i = 0; i < 10; ++i) {
    const float exact = GradValue(0, static_cast<int>(i)) + GradValue(1, static_cast<int>(i));
    EXPECT_EQ(sums[1][i], 2.0 * exact);
  }
  EXPECT_EQ(bytes[0].sent, 40);
  EXPECT_EQ(bytes[0].uncompressed, 40);
}

using testing_util::Tiny;

EngineSetup CompressionSetup(int pp, int dp, GradCompression c) {
  EngineSetup o;
  o.train.steps = 6;
  o.train.seed = 7;
  o.train.lr = 1e-2f;
  o.train.warmup_steps = 1;
  o.train.bucket_bytes = 16 << 10;  // several buckets per stage
  o.train.grad_compression = c;
  o.micro_batches = 4;
  o.pp = pp;
  o.dp = dp;
  o.schedule = ScheduleKind::k1F1B;
  o.timeout = absl::Seconds(30);
  return o;
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<std::vector<RankTimes>> ranks;            // per step
  std::vector<std::vector<std::vector<float>>> params;  // per global rank
};

TrainRun Train(const EngineSetup& o) {
  TrainRun out;
  auto e = MakeEngine(Tiny(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return out;
  for (int64_t i = 0; i < o.train.steps; ++i) {
    auto s = (*e)->Step();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) break;
    out.losses.push_back(s->result.loss);
    out.ranks.push_back(s->ranks);
  }
  for (int g = 0; g < o.pp * o.dp; ++g) {
    std::vector<std::vector<float>> ps;
    for (Parameter* p : (*e)->RankParameters(g)) ps.push_back(p->value.ToVector());
    out.params.push_back(std::move(ps));
  }
  return out;
}

// Every replica applies the same sums, so the replicas' weights stay bit-identical; the loss
// falls and stays within bf16 rounding of the uncompressed run's; half the bytes go out.
TEST(GradCompressionBf16, ReplicasStayIdenticalAndTrainLikeFp32) {
  const TrainRun fp32 = Train(CompressionSetup(2, 2, GradCompression::None()));
  const TrainRun bf16 = Train(CompressionSetup(2, 2, GradCompression::Bf16()));
  ASSERT_EQ(bf16.losses.size(), fp32.losses.size());
  ASSERT_EQ(bf16.params.size(), 4u);
  for (int pipe = 0; pipe < 2; ++pipe) {
    // Global rank = replica * pp + pipeline rank.
    EXPECT_EQ(bf16.params[pipe], bf16.params[2 + pipe]) << "pipeline rank " << pipe;
  }
  EXPECT_LT(bf16.losses.back(), bf16.losses.front());
  for (size_t i = 0; i < fp32.losses.size(); ++i) {
    EXPECT_NEAR(bf16.losses[i], fp32.losses[i], 0.01 * fp32.losses[i]) << "step " << i;
  }
  EXPECT_NE(bf16.losses, fp32.losses) << "the gradients were not compressed";
  for (size_t s = 0; s < bf16.ranks.size(); ++s) {
    for (size_t r = 0; r < bf16.ranks[s].size(); ++r) {
      const RankTimes& c = bf16.ranks[s][r];
      const RankTimes& u = fp32.ranks[s][r];
      EXPECT_GT(c.grad_bytes_sent, 0);
      EXPECT_EQ(c.grad_bytes_uncompressed, 2 * c.grad_bytes_sent);
      EXPECT_EQ(u.grad_bytes_sent, u.grad_bytes_uncompressed);
      EXPECT_EQ(u.grad_bytes_uncompressed, c.grad_bytes_uncompressed);
    }
  }
}

TEST(GradCompressionBf16, BitStableAcrossRuns) {
  const TrainRun a = Train(CompressionSetup(1, 2, GradCompression::Bf16()));
  const TrainRun b = Train(CompressionSetup(1, 2, GradCompression::Bf16()));
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.params, b.params);
}

TEST(GradCompression, BadCombinationsAreRefused) {
  auto one = MakeEngine(Tiny(), CompressionSetup(2, 1, GradCompression::Bf16()));
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(one.status().message().find("RunSpec.data_parallel >= 2"), std::string::npos)
      << one.status();

  EngineSetup fp16 = CompressionSetup(1, 2, GradCompression::Bf16());
  fp16.train.precision = Precision::kFp16;
  auto f = MakeEngine(Tiny(), fp16);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("fp16"), std::string::npos) << f.status();

  EXPECT_FALSE(ParseGradCompression("fp8").ok());
  EXPECT_EQ(*ParseGradCompression("bf16"), GradCompression::Bf16());
}

// ---- checkpoints of the compression state ----

// Six steps straight against three, a checkpoint, a new engine resuming it and three more: the
// same losses and weights bit for bit, because every replica's error buffers (and PowerSGD's Q)
// are in the checkpoint.
void ExpectResumeIsBitIdentical(GradCompression c) {
  const std::string dir = ::testing::TempDir() + "/gc_resume_" + GradCompressionName(c) + "_" +
                          std::to_string(getpid());
  EngineSetup setup = CompressionSetup(2, 2, c);
  const TrainRun straight = Train(setup);
  ASSERT_EQ(straight.losses.size(), 6u);
  std::vector<double> losses;
  {
    auto e = MakeEngine(Tiny(), setup);
    ASSERT_TRUE(e.ok()) << e.status();
    for (int i = 0; i < 3; ++i) {
      auto s = (*e)->Step();
      ASSERT_TRUE(s.ok()) << s.status();
      losses.push_back(s->result.loss);
    }
    ASSERT_TRUE((*e)->Save(dir).ok());
  }
  auto e = MakeEngine(Tiny(), setup);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE((*e)->Resume(dir).ok());
  for (int i = 0; i < 3; ++i) {
    auto s = (*e)->Step();
    ASSERT_TRUE(s.ok()) << s.status();
    losses.push_back(s->result.loss);
  }
  EXPECT_EQ(losses, straight.losses) << GradCompressionName(c);
  for (int g = 0; g < 4; ++g) {
    std::vector<std::vector<float>> ps;
    for (Parameter* p : (*e)->RankParameters(g)) ps.push_back(p->value.ToVector());
    EXPECT_EQ(ps, straight.params[g]) << GradCompressionName(c) << " rank " << g;
  }
  std::filesystem::remove_all(dir);
}

TEST(GradCompressionCheckpoint, Bf16ResumesBitIdentically) {
  ExpectResumeIsBitIdentical(GradCompression::Bf16());
}

TEST(GradCompressionCheckpoint, PowerSgdResumesBitIdentically) {
  ExpectResumeIsBitIdentical(GradCompression::PowerSgd(2));
}

// The state resumes only into the same compression and dp (anything else would drop it); an
// uncompressed checkpoint starts a compressed run from fresh state.
TEST(GradCompressionCheckpoint, StateResumesOnlyIntoTheSameSettings) {
  const std::string dir = ::testing::TempDir() + "/gc_mismatch_" + std::to_string(getpid());
  {
    auto e = MakeEngine(Tiny(), CompressionSetup(1, 2, GradCompression::PowerSgd(2)));
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE((*e)->Step().ok());
    ASSERT_TRUE((*e)->Save(dir).ok());
  }
  for (GradCompression other :
       {GradCompression::None(), GradCompression::Bf16(), GradCompression::PowerSgd(4)}) {
    auto e = MakeEngine(Tiny(), CompressionSetup(1, 2, other));
    ASSERT_TRUE(e.ok()) << e.status();
    const absl::Status s = (*e)->Resume(dir);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("powersgd:2"), std::string::npos) << s;
  }
  const std::string plain = ::testing::TempDir() + "/gc_plain_" + std::to_string(getpid());
  {
    auto e = MakeEngine(Tiny(), CompressionSetup(1, 2, GradCompression::None()));
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE((*e)->Step().ok());
    ASSERT_TRUE((*e)->Save(plain).ok());
  }
  auto e = MakeEngine(Tiny(), CompressionSetup(1, 2, GradCompression::PowerSgd(2)));
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE((*e)->Resume(plain).ok());
  EXPECT_TRUE((*e)->Step().ok());
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(plain);
}

// ---- PowerSGD ----

TEST(PowerSgdOrthonormalize, MakesOrthonormalColumnsAndZeroesDependentOnes) {
  // 5 x 3: columns 0 and 1 independent, column 2 = column 0 + 2 column 1.
  std::vector<float> p = {1, 2, 5, 0, 1, 2, 3, 0, 3, 1, 1, 3, 2, 5, 12};
  internal::OrthonormalizeColumns(p.data(), 5, 3);
  auto dot = [&](int a, int b) {
    double s = 0;
    for (int i = 0; i < 5; ++i) s += double{p[i * 3 + a]} * p[i * 3 + b];
    return s;
  };
  EXPECT_NEAR(dot(0, 0), 1.0, 1e-6);
  EXPECT_NEAR(dot(1, 1), 1.0, 1e-6);
  EXPECT_NEAR(dot(0, 1), 0.0, 1e-6);
  EXPECT_EQ(dot(2, 2), 0.0) << "a dependent column must become zero, not amplified noise";
  // The first column keeps its direction.
  EXPECT_GT(p[0], 0.0f);
  EXPECT_NEAR(p[6] / p[0], 3.0, 1e-5);
}

struct PowerSgdRun {
  std::vector<std::vector<std::vector<float>>> applied;  // per replica, per step: w's gradient
  std::vector<std::vector<float>> bias;                  // per replica: the last step's bias grad
  std::vector<GradSyncBytes> bytes;
};

// `steps` PowerSGD synchronizations over `dp` replicas of a rows x cols matrix `w` (gradient
// grad(r, step) on replica r) and a 1-D `bias` in another layer.
PowerSgdRun RunPowerSgd(int dp, int rank, int steps, int64_t rows, int64_t cols,
                        const std::function<std::vector<float>(int, int)>& grad) {
  std::vector<std::unique_ptr<Communicator>> comms = CreateLocalWorld(dp);
  PowerSgdRun out;
  out.applied.resize(dp);
  out.bias.resize(dp);
  out.bytes.resize(dp);
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(dp);
  for (int r = 0; r < dp; ++r) {
    threads.emplace_back([&, r] {
      Parameter w{"w", Tensor::Zeros({rows, cols}), Tensor::Zeros({rows, cols}), true, "", {}};
      Parameter bias{"b", Tensor::Zeros({cols}), Tensor::Zeros({cols}), true, "", {}};
      internal::GradSyncContext ctx;
      ctx.dp = comms[r].get();
      ctx.alloc = DefaultCpuAllocator();
      ctx.wait = [](Work& w, const std::string&) { return w.Wait(absl::Seconds(30)); };
      ctx.sync_device = [] { return absl::OkStatus(); };
      std::unique_ptr<internal::GradSync> sync = internal::CreatePowerSgd(
          ctx, {internal::GradSyncStage{0, {{&w}, {&bias}}}}, /*bucket_bytes=*/1, rank);
      for (int s = 0; s < steps && status[r].ok(); ++s) {
        sync->BeginStep();
        const std::vector<float> g = grad(r, s);
        std::copy(g.begin(), g.end(), w.grad.data<float>());
        for (int64_t j = 0; j < cols; ++j) bias.grad.data<float>()[j] = GradValue(r, j);
        status[r] = sync->LayerReady(0, 1);
        if (status[r].ok()) status[r] = sync->LayerReady(0, 0);
        if (status[r].ok()) status[r] = sync->Finish();
        out.applied[r].push_back(w.grad.ToVector());
        out.bias[r] = bias.grad.ToVector();
        out.bytes[r] = sync->StepBytes();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < dp; ++r) EXPECT_TRUE(status[r].ok()) << status[r];
  return out;
}

double RelativeError(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

// A sum of gradients of rank <= R is recovered in one step (one power iteration from any Q not
// orthogonal to it is exact), identically on every replica; the 1-D gradient is summed exactly;
// the bytes are the factors plus the uncompressed bias.
TEST(PowerSgd, RecoversALowRankSumExactlyOnEveryReplica) {
  constexpr int kDp = 3, kRank = 2;
  constexpr int64_t kRows = 12, kCols = 10;
  // Replica r: u_r v^T + x_r y^T, a rank-2 sum over the replicas.
  auto grad = [](int r, int) {
    std::vector<float> g(kRows * kCols);
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < kCols; ++j) {
        g[i * kCols + j] = (0.5f + 0.1f * i + r) * (1.0f - 0.2f * j) +
                           (0.3f * ((i + r) % 4) - 0.4f) * (0.05f * j * j - 0.3f);
      }
    }
    return g;
  };
  const PowerSgdRun run = RunPowerSgd(kDp, kRank, 1, kRows, kCols, grad);
  std::vector<double> exact(kRows * kCols, 0.0);
  for (int r = 0; r < kDp; ++r) {
    const std::vector<float> g = grad(r, 0);
    for (size_t i = 0; i < exact.size(); ++i) exact[i] += g[i];
  }
  EXPECT_LT(RelativeError(run.applied[0][0], exact), 1e-5);
  for (int r = 1; r < kDp; ++r) {
    EXPECT_EQ(run.applied[r], run.applied[0]) << "replica " << r;
    EXPECT_EQ(run.bias[r], run.bias[0]) << "replica " << r;
  }
  for (int64_t j = 0; j < kCols; ++j) {
    EXPECT_FLOAT_EQ(run.bias[0][j], GradValue(0, j) + GradValue(1, j) + GradValue(2, j));
  }
  // Wire bytes: the bias all-reduced, the factors P and Q all-gathered.
  for (const GradSyncBytes& b : run.bytes) {
    EXPECT_EQ(b.uncompressed, internal::RingAllReduceBytes(kRows * kCols * 4, kDp) +
                                  internal::RingAllReduceBytes(kCols * 4, kDp));
    EXPECT_EQ(b.sent, internal::RingAllReduceBytes(kCols * 4, kDp) +
                          internal::RingAllGatherBytes(kRank * kRows * 4, kDp) +
                          internal::RingAllGatherBytes(kRank * kCols * 4, kDp));
  }
}

// Error feedback: with a full-rank gradient and rank 1, one step sends a poor approximation, but
// what the replicas apply over many steps converges to the true sum (the dropped part is carried
// and sent later), where without feedback the same direction would be dropped every step.
TEST(PowerSgd, ErrorFeedbackDeliversAFullRankSumOverSteps) {
  constexpr int kDp = 2, kSteps = 64;
  constexpr int64_t kRows = 8, kCols = 6;
  auto grad = [](int r, int) {
    std::vector<float> g(kRows * kCols);
    for (int64_t i = 0; i < kRows * kCols; ++i) g[i] = GradValue(r, static_cast<int>(i * 37 % 48));
    for (int64_t i = 0; i < kRows; ++i) g[i * kCols + i % kCols] += 2.0f * (r + 1);
    return g;
  };
  const PowerSgdRun run = RunPowerSgd(kDp, 1, kSteps, kRows, kCols, grad);
  std::vector<double> exact(kRows * kCols, 0.0);
  for (int r = 0; r < kDp; ++r) {
    const std::vector<float> g = grad(r, 0);
    for (size_t i = 0; i < exact.size(); ++i) exact[i] += g[i];
  }
  const double first = RelativeError(run.applied[0][0], exact);
  std::vector<float> mean(exact.size(), 0.0f);
  for (const auto& step : run.applied[0]) {
    for (size_t i = 0; i < mean.size(); ++i) mean[i] += step[i] / kSteps;
  }
  const double averaged = RelativeError(mean, exact);
  EXPECT_GT(first, 0.1) << "the test's gradient is too close to rank 1 to tell";
  EXPECT_LT(averaged, 0.1 * first) << "first step " << first << ", average " << averaged;
  EXPECT_EQ(run.applied[1], run.applied[0]);
}

TEST(PowerSgd, ReplicasStayIdenticalTrainAndAreBitStable) {
  const TrainRun fp32 = Train(CompressionSetup(2, 2, GradCompression::None()));
  const TrainRun a = Train(CompressionSetup(2, 2, GradCompression::PowerSgd(2)));
  const TrainRun b = Train(CompressionSetup(2, 2, GradCompression::PowerSgd(2)));
  ASSERT_EQ(a.params.size(), 4u);
  for (int pipe = 0; pipe < 2; ++pipe) {
    EXPECT_EQ(a.params[pipe], a.params[2 + pipe]) << "pipeline rank " << pipe;
  }
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.params, b.params);
  // The same at another pipeline depth: each matrix's Q starts from its name, not its stage.
  EXPECT_EQ(Train(CompressionSetup(1, 2, GradCompression::PowerSgd(2))).losses, a.losses);
  EXPECT_LT(a.losses.back(), a.losses.front());
  EXPECT_NE(a.losses, fp32.losses) << "the gradients were not compressed";
  for (const auto& step : a.ranks) {
    for (const RankTimes& r : step) {
      EXPECT_GT(r.grad_bytes_sent, 0);
      EXPECT_GT(r.grad_bytes_uncompressed, 4 * r.grad_bytes_sent);
    }
  }
}

// Note [Bucket spans]: a compressed bucket's collectives are spans like an fp32 one's — bf16 one
// all-gather per bucket; PowerSGD per bucket the all-reduce of its 1-D gradients and, for its
// matrices, the P all-gather (during the backward) and the Q all-gather (in Finish).
TEST(GradCompressionSpans, EachBucketsCollectivesAreReported) {
  for (const GradCompression c : {GradCompression::Bf16(), GradCompression::PowerSgd(2)}) {
    auto e = MakeEngine(testing_util::Tiny(), CompressionSetup(2, 2, c));
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE((*e)->Step().ok());
    for (const std::vector<RankEvent>& events : (*e)->Events()) {
      std::map<std::pair<int64_t, BucketCollective>, int> count;
      int64_t buckets = 0;
      for (const RankEvent& ev : events) {
        if (ev.kind != EventKind::kBucket) continue;
        ++count[{ev.tag, ev.collective}];
        buckets = std::max(buckets, ev.tag + 1);
      }
      ASSERT_GE(buckets, 2) << GradCompressionName(c);
      // Among the other events by start, the Q all-gathers posted in Finish too.
      EXPECT_TRUE(
          std::is_sorted(events.begin(), events.end(),
                         [](const RankEvent& a, const RankEvent& b) { return a.start < b.start; }));
      int gathers = 0, reduces = 0;
      for (int64_t b = 0; b < buckets; ++b) {
        const int g = count[{b, BucketCollective::kAllGather}];
        const int r = count[{b, BucketCollective::kAllReduce}];
        if (c.kind == GradCompression::Kind::kBf16) {
          EXPECT_EQ(g, 1) << "bucket " << b;
          EXPECT_EQ(r, 0) << "bucket " << b;
        } else {
          EXPECT_TRUE(g == 0 || g == 2) << "bucket " << b << ": " << g << " all-gathers";
          EXPECT_LE(r, 1) << "bucket " << b;
          EXPECT_GT(g + r, 0) << "bucket " << b;
        }
        gathers += g;
        reduces += r;
      }
      EXPECT_GT(gathers, 0);
      if (c.kind == GradCompression::Kind::kPowerSgd) {
        EXPECT_GT(reduces, 0);
      }
    }
  }
}

TEST(PowerSgd, ParsesItsRank) {
  auto c = ParseGradCompression("powersgd:4");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, GradCompression::PowerSgd(4));
  EXPECT_EQ(GradCompressionName(*c), "powersgd:4");
  for (const char* bad : {"powersgd", "powersgd:", "powersgd:0", "powersgd:-1", "powersgd:x",
                          "powersgd:4x", "powersgd:2000"}) {
    auto r = ParseGradCompression(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    }
  }
}

}  // namespace
}  // namespace pipewright
