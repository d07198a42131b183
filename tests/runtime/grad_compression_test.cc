// Gradient compression (--grad-compression, docs/runtime.md "Gradient compression"): the bf16
// codec of the bucketed all-reduce on its own, over a local world of threads, and in engine
// runs with several replicas.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
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
      Parameter a{"a", Tensor::Zeros({numel / 2}), Tensor::Zeros({numel / 2}), true};
      Parameter b{"b", Tensor::Zeros({numel - numel / 2}), Tensor::Zeros({numel - numel / 2}),
                  true};
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
  const auto sums = AppliedSums(kDp, kSteps, GradCompression::kBf16, kN, &bytes);
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
  for (const GradSyncBytes& b : bytes) {
    EXPECT_EQ(b.uncompressed, kN * 4);
    EXPECT_EQ(b.sent, kN * 2);
  }
}

TEST(GradCompressionNone, SendsFp32AndSumsExactly) {
  std::vector<GradSyncBytes> bytes;
  const auto sums = AppliedSums(2, 2, GradCompression::kNone, 10, &bytes);
  for (int64_t i = 0; i < 10; ++i) {
    const float exact = GradValue(0, static_cast<int>(i)) + GradValue(1, static_cast<int>(i));
    EXPECT_EQ(sums[1][i], 2.0 * exact);
  }
  EXPECT_EQ(bytes[0].sent, 40);
  EXPECT_EQ(bytes[0].uncompressed, 40);
}

LayerGraph Tiny() {
  auto g = PresetModel("gpt-tiny", 2);
  EXPECT_TRUE(g.ok()) << g.status();
  return *std::move(g);
}

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
  const TrainRun fp32 = Train(CompressionSetup(2, 2, GradCompression::kNone));
  const TrainRun bf16 = Train(CompressionSetup(2, 2, GradCompression::kBf16));
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
  const TrainRun a = Train(CompressionSetup(1, 2, GradCompression::kBf16));
  const TrainRun b = Train(CompressionSetup(1, 2, GradCompression::kBf16));
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.params, b.params);
}

TEST(GradCompression, BadCombinationsAreRefused) {
  auto one = MakeEngine(Tiny(), CompressionSetup(2, 1, GradCompression::kBf16));
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(one.status().message().find("dp >= 2"), std::string::npos) << one.status();

  EngineSetup fp16 = CompressionSetup(1, 2, GradCompression::kBf16);
  fp16.train.precision = Precision::kFp16;
  auto f = MakeEngine(Tiny(), fp16);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("fp16"), std::string::npos) << f.status();

  auto e = MakeEngine(Tiny(), CompressionSetup(1, 2, GradCompression::kBf16));
  ASSERT_TRUE(e.ok()) << e.status();
  const absl::Status save = (*e)->Save(::testing::TempDir() + "/gc_ckpt");
  EXPECT_EQ(save.code(), absl::StatusCode::kUnimplemented) << save;
  const absl::Status resume = (*e)->Resume(::testing::TempDir() + "/gc_ckpt");
  EXPECT_EQ(resume.code(), absl::StatusCode::kUnimplemented) << resume;

  EXPECT_FALSE(ParseGradCompression("fp8").ok());
  EXPECT_EQ(*ParseGradCompression("bf16"), GradCompression::kBf16);
}

}  // namespace
}  // namespace pipewright
