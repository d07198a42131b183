// The engine on CUDA against the CPU reference (gpt-tiny). Every test skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "pipewright/device.h"
#include "pipewright/engine.h"
#include "pipewright/train.h"
#include "runtime/generate.h"
#include "tests/runtime/engine_util.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

#define PW_NEED_GPUS(n)                                                        \
  do {                                                                         \
    if (CudaDeviceCount() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s)"; \
  } while (0)

using testing_util::EngineSetup;
using testing_util::MakeEngine;

EngineSetup Options(Device device, int pp, int dp, Precision precision) {
  EngineSetup o;
  o.micro_batches = 4;
  o.train.steps = 3;
  o.train.seed = 7;
  o.train.lr = 1e-2f;
  o.train.warmup_steps = 1;
  o.train.precision = precision;
  o.pp = pp;
  o.dp = dp;
  o.schedule = ScheduleKind::k1F1B;
  o.timeout = absl::Seconds(60);
  o.device = device;
  return o;
}

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
  int64_t peak_bytes = 0;
};

RunResult RunEngine(const EngineSetup& o, const std::string& preset = "gpt-tiny") {
  auto g = PresetModel(preset, 2);
  EXPECT_TRUE(g.ok());
  auto e = MakeEngine(*g, o);
  EXPECT_TRUE(e.ok()) << e.status();
  RunResult r;
  if (!e.ok()) return r;
  for (int i = 0; i < o.train.steps; ++i) {
    auto s = (*e)->Step();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) break;
    r.losses.push_back(s->result.loss);
  }
  for (auto& [name, t] : (*e)->Weights()) {
    EXPECT_TRUE(t.device().is_cpu()) << name;  // Weights() are host copies
    r.weights[name] = t.ToVector();
  }
  for (const RankTimes& t : (*e)->Summary().ranks) {
    r.peak_bytes = std::max(r.peak_bytes, t.peak_memory_bytes);
  }
  return r;
}

double MaxRelWeightDiff(const RunResult& a, const RunResult& b) {
  double worst = 0;
  for (const auto& [name, w] : a.weights) {
    const std::vector<float>& v = b.weights.at(name);
    double num = 0, den = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      num += (w[i] - v[i]) * (w[i] - v[i]);
      den += double(v[i]) * v[i];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

TEST(EngineCuda, Fp32MatchesTheCpu) {
  PW_NEED_GPUS(1);
  RunResult cpu = RunEngine(Options(Device::Cpu(), 1, 1, Precision::kFp32));
  RunResult gpu = RunEngine(Options(Device::Cuda(0), 1, 1, Precision::kFp32));
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-4 * cpu.losses[i]) << i;
  }
  EXPECT_LT(MaxRelWeightDiff(gpu, cpu), 1e-3);
  EXPECT_GT(gpu.peak_bytes, 0);  // the device allocator counted the rank's memory
}

// The Llama family's CUDA kernels (kernels/cuda/llama.cu) in a whole run: llama-tiny on the GPU
// trains as on the CPU, to fp32 rounding.
TEST(EngineCuda, LlamaMatchesTheCpu) {
  PW_NEED_GPUS(1);
  RunResult cpu = RunEngine(Options(Device::Cpu(), 1, 1, Precision::kFp32), "llama-tiny");
  RunResult gpu = RunEngine(Options(Device::Cuda(0), 1, 1, Precision::kFp32), "llama-tiny");
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-4 * cpu.losses[i]) << i;
  }
  EXPECT_LT(MaxRelWeightDiff(gpu, cpu), 1e-3);
}

TEST(EngineCuda, Bf16MatchesTheCpuBf16) {
  PW_NEED_GPUS(1);
  RunResult cpu = RunEngine(Options(Device::Cpu(), 1, 1, Precision::kBf16));
  RunResult gpu = RunEngine(Options(Device::Cuda(0), 1, 1, Precision::kBf16));
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-2 * cpu.losses[i]) << i;
  }
}

// Several stages share one GPU through the local backend with device buffers; the numerics
// promise (any depth = the single stage, bit for bit) holds on the GPU too.
TEST(EngineCuda, WholePipelineOnOneGpuIsBitIdenticalToOneStage) {
  PW_NEED_GPUS(1);
  EngineSetup one = Options(Device::Cuda(0), 1, 1, Precision::kFp32);
  one.cuda_devices = {0};
  EngineSetup four = Options(Device::Cuda(0), 4, 1, Precision::kFp32);
  four.cuda_devices = {0};
  RunResult a = RunEngine(one);
  RunResult b = RunEngine(four);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.weights, b.weights);
  EngineSetup dp = Options(Device::Cuda(0), 2, 2, Precision::kFp32);
  dp.cuda_devices = {0};
  dp.micro_batches = 2;
  RunResult c = RunEngine(dp);
  ASSERT_EQ(c.losses.size(), a.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(c.losses[i], a.losses[i], 1e-5);
}

TEST(EngineCuda, NcclAcrossGpusMatchesOneGpu) {
  PW_NEED_GPUS(2);
  RunResult a = RunEngine(Options(Device::Cuda(0), 1, 1, Precision::kFp32));
  EngineSetup o = Options(Device::Cuda(0), 2, 1, Precision::kFp32);
  o.comm = CommBackend::kNccl;
  RunResult b = RunEngine(o);
  EXPECT_EQ(a.losses, b.losses);  // P2P moves bits; no reduction is involved with dp = 1
  EngineSetup d = Options(Device::Cuda(0), 1, 2, Precision::kFp32);
  d.comm = CommBackend::kNccl;
  d.micro_batches = 2;
  RunResult c = RunEngine(d);
  ASSERT_EQ(c.losses.size(), a.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(c.losses[i], a.losses[i], 1e-5);
}

// Tensor parallelism on GPUs (docs/runtime.md, "Tensor parallelism"): tp 2 (and with sequence
// parallelism) on one GPU through the local backend, and on two over NCCL, matches the CPU's
// tp 2 within the GPU's rounding; pipeline depth changes no bit at tp 2 on the GPU.
TEST(EngineCuda, TensorParallelMatchesTheCpu) {
  PW_NEED_GPUS(1);
  // gpt-tiny and a Llama (grouped-query qkv split in unequal sections, vocab-parallel token
  // embedding without positions).
  for (const char* model : {"gpt-tiny", "llama-tiny"})
    for (bool sp : {false, true}) {
      SCOPED_TRACE(model);
      EngineSetup cpu = Options(Device::Cpu(), 1, 1, Precision::kFp32);
      cpu.tp = 2;
      cpu.sequence_parallel = sp;
      EngineSetup gpu = cpu;
      gpu.device = Device::Cuda(0);
      gpu.cuda_devices = {0};
      const RunResult want = RunEngine(cpu, model), got = RunEngine(gpu, model);
      ASSERT_EQ(got.losses.size(), want.losses.size()) << sp;
      for (size_t i = 0; i < want.losses.size(); ++i) {
        EXPECT_NEAR(got.losses[i], want.losses[i], 1e-4 * want.losses[i]) << sp << " " << i;
      }
      EXPECT_LT(MaxRelWeightDiff(got, want), 1e-3) << sp;
      EngineSetup deep = gpu;
      deep.pp = 2;
      deep.cuda_devices = {0};
      const RunResult pp2 = RunEngine(deep, model);
      EXPECT_EQ(pp2.losses, got.losses) << sp;
      if (CudaDeviceCount() >= 2) {
        EngineSetup nccl = gpu;
        nccl.comm = CommBackend::kNccl;
        nccl.cuda_devices = {0, 1};
        const RunResult n = RunEngine(nccl, model);
        ASSERT_EQ(n.losses.size(), want.losses.size()) << sp;
        for (size_t i = 0; i < want.losses.size(); ++i) {
          EXPECT_NEAR(n.losses[i], want.losses[i], 1e-4 * want.losses[i]) << sp << " " << i;
        }
      }
    }
}

class EngineCudaCheckpoint : public testing_util::ScratchDirTest {};

// A checkpoint written from the GPU resumes on the CPU (global names, host tensors).
TEST_F(EngineCudaCheckpoint, GpuCheckpointResumesOnTheCpu) {
  PW_NEED_GPUS(1);
  auto g = PresetModel("gpt-tiny", 2);
  ASSERT_TRUE(g.ok());
  EngineSetup o = Options(Device::Cuda(0), 2, 1, Precision::kFp32);
  o.cuda_devices = {0};
  auto e = MakeEngine(*g, o);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE((*e)->Step().ok());
  ASSERT_TRUE((*e)->Save(Path("ck")).ok());
  auto next_gpu = (*e)->Step();
  ASSERT_TRUE(next_gpu.ok());
  auto c = MakeEngine(*g, Options(Device::Cpu(), 1, 1, Precision::kFp32));
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Resume(Path("ck")).ok());
  auto next_cpu = (*c)->Step();
  ASSERT_TRUE(next_cpu.ok());
  EXPECT_NEAR(next_cpu->result.loss, next_gpu->result.loss, 1e-4 * next_gpu->result.loss);
}

// Generation on a GPU (generate --device cuda): gpt-tiny with noisy weights, decoded with the KV
// cache on the GPU (its prefill, decode steps and window refills) and recomputed there, gives the
// CPU's greedy text; every sampled row of logits agrees with the CPU's to fp32 rounding.
TEST(GenerateCuda, GreedyTextAndLogitsAreTheCpus) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const char* preset : {"gpt-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    auto graph = PresetModel(preset, 1);
    ASSERT_TRUE(graph.ok());
    auto cpu = graph->Instantiate(0, graph->num_layers(), 7);
    ASSERT_TRUE(cpu.ok());
    std::mt19937 rng(7);
    std::normal_distribution<float> noise(0.0f, 0.1f);
    for (Parameter* p : (*cpu)->Parameters()) {
      for (int64_t i = 0; i < p->value.numel(); ++i) p->value.data<float>()[i] += noise(rng);
    }
    ASSERT_TRUE(SetCudaDevice(0).ok());
    auto stream = CudaStream::Create(Device::Cuda(0));
    ASSERT_TRUE(stream.ok());
    auto alloc = CreateCudaAllocator(0, stream->get());
    ASSERT_TRUE(alloc.ok());
    {
      auto gpu = graph->Instantiate(0, graph->num_layers(), 7, alloc->get());
      ASSERT_TRUE(gpu.ok());
      const auto from = (*cpu)->Parameters(), to = (*gpu)->Parameters();
      ASSERT_EQ(from.size(), to.size());
      for (size_t i = 0; i < from.size(); ++i)
        ASSERT_TRUE(to[i]->value.CopyFrom(from[i]->value).ok());
      const int L = graph->num_layers() - 1;
      const int64_t T = graph->shape().seq_len;
      for (bool cache : {true, false}) {
        GenerateOptions o;
        o.prompt = "ROMEO:";
        o.tokens = 2 * T + 5;  // past the window: refills
        o.temperature = 0;
        o.kv_cache = cache;
        std::vector<std::vector<float>> rows_cpu, rows_gpu;
        auto keep = [](std::vector<std::vector<float>>* rows) {
          return [rows](const std::vector<int32_t>&, const float* logits, int64_t v) {
            rows->emplace_back(logits, logits + v);
          };
        };
        GenerateResult a, b;
        ASSERT_TRUE(internal::Generate(**cpu, L, T, 256, o, nullptr, &a, keep(&rows_cpu)).ok());
        absl::Status s =
            internal::Generate(**gpu, L, T, 256, o, nullptr, &b, keep(&rows_gpu), alloc->get());
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_EQ(b.text, a.text) << "kv cache " << cache;
        ASSERT_EQ(rows_gpu.size(), rows_cpu.size());
        double worst = 0;
        for (size_t r = 0; r < rows_cpu.size(); ++r) {
          for (size_t k = 0; k < rows_cpu[r].size(); ++k) {
            worst = std::max(worst, std::abs(static_cast<double>(rows_gpu[r][k]) - rows_cpu[r][k]) /
                                        (1.0 + std::abs(rows_cpu[r][k])));
          }
        }
        EXPECT_LT(worst, 1e-4) << "kv cache " << cache;
      }
    }
  }
}

}  // namespace
}  // namespace pipewright
