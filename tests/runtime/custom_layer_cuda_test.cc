// The custom layer of tests/install/residual_linear.h (public headers only) on a CUDA tensor:
// the same code runs on the GPU through pipewright/ops.h and matches its CPU run. Skips without
// a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "pipewright/device.h"
#include "pipewright/layer.h"
#include "pipewright/tensor.h"
#include "tests/install/residual_linear.h"

namespace pipewright {
namespace {

constexpr int64_t kRows = 6, kD = 16;

std::unique_ptr<Layer> Make() {
  auto r =
      residual_example::MakeResidualLinear(kD, 0.5f)->Create(InitContext{5, 2, "res", 1, nullptr});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *std::move(r) : nullptr;
}

std::vector<float> ToHost(const Tensor& t) {
  auto h = t.CopyTo(nullptr);
  EXPECT_TRUE(h.ok()) << h.status();
  return h.ok() ? h->ToVector() : std::vector<float>();
}

void ExpectNear(const std::vector<float>& cpu, const std::vector<float>& gpu, float tol) {
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_NEAR(gpu[i], cpu[i], tol * std::max(1.0f, std::fabs(cpu[i]))) << "[" << i << "]";
  }
}

TEST(CustomLayerCudaTest, MatchesTheCpuInFp32AndBf16) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA GPU";
  auto stream = CudaStream::Create(Device::Cuda(0));
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto alloc = CreateCudaAllocator(0, stream->get());
  ASSERT_TRUE(alloc.ok()) << alloc.status();

  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> xv(kRows * kD), pv(kRows * kD);
  for (float& v : xv) v = d(rng);
  for (float& v : pv) v = d(rng);
  const Tensor x = Tensor::FromVector({kRows, kD}, xv), probe = Tensor::FromVector({kRows, kD}, pv);

  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    auto cpu = Make(), gpu = Make();
    // As the engine does: initialised on the host, then moved to the device.
    for (Parameter* p : gpu->Parameters()) {
      auto v = p->value.CopyTo(alloc->get());
      ASSERT_TRUE(v.ok()) << v.status();
      p->value = *std::move(v);
      p->grad = Tensor::Zeros(p->value.shape(), DType::kF32, alloc->get());
    }
    LayerContext on_cpu, on_gpu;
    on_cpu.compute_dtype = on_gpu.compute_dtype = dtype;
    on_gpu.allocator = alloc->get();
    Saved sc, sg;
    auto yc = cpu->Forward(x, on_cpu, &sc);
    auto xd = x.CopyTo(alloc->get()), pd = probe.CopyTo(alloc->get());
    ASSERT_TRUE(yc.ok() && xd.ok() && pd.ok());
    auto yg = gpu->Forward(*xd, on_gpu, &sg);
    ASSERT_TRUE(yg.ok()) << yg.status();
    EXPECT_TRUE(yg->device().is_cuda());
    const float tol = dtype == DType::kF32 ? 1e-4f : 1e-2f;
    ExpectNear(yc->ToVector(), ToHost(*yg), tol);
    auto dxc = cpu->Backward(probe, on_cpu, &sc);
    auto dxg = gpu->Backward(*pd, on_gpu, &sg);
    ASSERT_TRUE(dxc.ok() && dxg.ok()) << dxg.status();
    ExpectNear(dxc->ToVector(), ToHost(*dxg), tol);
    for (size_t i = 0; i < cpu->Parameters().size(); ++i) {
      ExpectNear(cpu->Parameters()[i]->grad.ToVector(), ToHost(gpu->Parameters()[i]->grad), tol);
    }
    // A host input on the GPU's context is refused, not read.
    Saved bad;
    EXPECT_EQ(gpu->Forward(x, on_gpu, &bad).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace pipewright
