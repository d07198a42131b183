// The CUDA device layer on a real GPU: device info, the stream-ordered allocator (counting and
// reuse), streams and events (ordering, timing), host<->device round trips through CopyTo, the
// pinned host allocator, Tensor::Clone/SetZero on the device, and the local backend moving
// CUDA tensors between rank threads that share one GPU. Every test skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/device.h"
#include "pipewright/tensor.h"

namespace pipewright {
namespace {

#define PW_NEED_GPU()                                              \
  do {                                                             \
    if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA GPU"; \
  } while (0)

#define PW_ASSERT_OK(expr)                             \
  do {                                                 \
    const absl::Status pw_s_ = (expr);                 \
    ASSERT_TRUE(pw_s_.ok()) << #expr << ": " << pw_s_; \
  } while (0)

constexpr absl::Duration kWait = absl::Seconds(30);

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A stream and a stream-ordered allocator on GPU 0.
struct Gpu {
  CudaStream stream;
  std::unique_ptr<Allocator> alloc;
};

Gpu MakeGpu(int device = 0) {
  Gpu g;
  auto stream = CudaStream::Create(Device::Cuda(device));
  EXPECT_TRUE(stream.ok()) << stream.status();
  if (!stream.ok()) return g;
  g.stream = *std::move(stream);
  auto alloc = CreateCudaAllocator(device, g.stream.get());
  EXPECT_TRUE(alloc.ok()) << alloc.status();
  if (alloc.ok()) g.alloc = *std::move(alloc);
  return g;
}

std::vector<float> ToHost(const Tensor& t) {
  auto h = t.CopyTo(nullptr);
  EXPECT_TRUE(h.ok()) << h.status();
  return h.ok() ? h->ToVector() : std::vector<float>();
}

TEST(CudaDeviceTest, DeviceInfo) {
  PW_NEED_GPU();
  auto info = GetCudaDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->name.empty());
  EXPECT_GE(info->compute_capability_major, 5);
  EXPECT_GT(info->sm_count, 0);
  EXPECT_GT(info->total_memory_bytes, 0);
  EXPECT_GT(info->free_memory_bytes, 0);
  EXPECT_LE(info->free_memory_bytes, info->total_memory_bytes);
  PW_ASSERT_OK(SetCudaDevice(0));
  EXPECT_EQ(GetCudaDeviceInfo(CudaDeviceCount()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaStream::Create(Device::Cpu()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaDeviceTest, AllocatorCountsCurrentAndPeak) {
  PW_NEED_GPU();
  Gpu g = MakeGpu();
  ASSERT_TRUE(g.alloc);
  EXPECT_EQ(g.alloc->device(), Device::Cuda(0));
  EXPECT_EQ(g.alloc->stream(), g.stream.get());
  {
    Tensor a = Tensor::Empty({1024}, DType::kF32, g.alloc.get());
    EXPECT_EQ(a.device(), Device::Cuda(0));
    EXPECT_EQ(a.stream(), g.stream.get());
    EXPECT_EQ(g.alloc->current_bytes(), 4096);
    {
      Tensor b = Tensor::Empty({2048}, DType::kF32, g.alloc.get());
      EXPECT_EQ(g.alloc->current_bytes(), 4096 + 8192);
    }
    EXPECT_EQ(g.alloc->current_bytes(), 4096);
    EXPECT_EQ(g.alloc->peak_bytes(), 4096 + 8192);
    g.alloc->ResetPeak();
    EXPECT_EQ(g.alloc->peak_bytes(), 4096);
  }
  EXPECT_EQ(g.alloc->current_bytes(), 0);
  // Out of memory is a status from TryAllocate / TryEmpty, and counts nothing.
  auto huge = g.alloc->TryAllocate(size_t{1} << 52);
  EXPECT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "cuda:0")) << huge.status();
  EXPECT_EQ(g.alloc->current_bytes(), 0);
  EXPECT_FALSE(Tensor::TryEmpty({int64_t{1} << 50}, DType::kF32, g.alloc.get()).ok());
  PW_ASSERT_OK(g.stream.Synchronize());
}

TEST(CudaDeviceTest, AllocatorReusesFreedMemory) {
  PW_NEED_GPU();
  Gpu g = MakeGpu();
  ASSERT_TRUE(g.alloc);
  cudaMemPool_t pool = nullptr;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  uint64_t threshold = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
            cudaSuccess);
  EXPECT_EQ(threshold, UINT64_MAX);
  constexpr int64_t kBytes = 64 << 20;
  { Tensor t = Tensor::Empty({kBytes / 4}, DType::kF32, g.alloc.get()); }
  PW_ASSERT_OK(g.stream.Synchronize());  // the default threshold would release it here
  uint64_t reserved_before = 0, reserved_after = 0;
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved_before),
            cudaSuccess);
  EXPECT_GE(reserved_before, static_cast<uint64_t>(kBytes));
  for (int i = 0; i < 5; ++i) {
    Tensor t = Tensor::Empty({kBytes / 4}, DType::kF32, g.alloc.get());
    t.SetZero();
  }
  PW_ASSERT_OK(g.stream.Synchronize());
  ASSERT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved_after),
            cudaSuccess);
  EXPECT_EQ(reserved_after, reserved_before);  // served from the pool, nothing new mapped
}

TEST(CudaDeviceTest, StreamEventOrderingAndElapsedTime) {
  PW_NEED_GPU();
  Gpu producer = MakeGpu(), consumer = MakeGpu();
  ASSERT_TRUE(producer.alloc && consumer.alloc);
  constexpr size_t kBytes = 256 << 20;
  Tensor big = Tensor::Empty({static_cast<int64_t>(kBytes / 4)}, DType::kF32, producer.alloc.get());
  auto start = CudaEvent::Create(Device::Cuda(0));
  auto end = CudaEvent::Create(Device::Cuda(0));
  ASSERT_TRUE(start.ok() && end.ok());
  PW_ASSERT_OK(start->Record(producer.stream.get()));
  for (int i = 0; i < 8; ++i) {
    PW_ASSERT_OK(MemsetBytes(big.raw(), big.device(), i + 1, kBytes, producer.stream.get()));
  }
  PW_ASSERT_OK(end->Record(producer.stream.get()));
  // The consumer stream waits for the producer's memsets, then reads the result.
  PW_ASSERT_OK(end->MakeStreamWait(consumer.stream.get()));
  std::vector<uint8_t> host(kBytes);
  PW_ASSERT_OK(CopyBytes(host.data(), Device::Cpu(), big.raw(), big.device(), kBytes,
                         consumer.stream.get()));
  PW_ASSERT_OK(consumer.stream.Synchronize());
  EXPECT_EQ(host.front(), 8);
  EXPECT_EQ(host[kBytes / 2], 8);
  EXPECT_EQ(host.back(), 8);
  auto done = end->Query();
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  PW_ASSERT_OK(end->Synchronize());
  auto seconds = end->ElapsedSeconds(*start);
  ASSERT_TRUE(seconds.ok()) << seconds.status();
  EXPECT_GT(*seconds, 0.0);
  EXPECT_LT(*seconds, 10.0);
  // A timing-free event orders but does not time.
  auto light = CudaEvent::Create(Device::Cuda(0), /*timing=*/false);
  ASSERT_TRUE(light.ok());
  PW_ASSERT_OK(light->Record(producer.stream.get()));
  PW_ASSERT_OK(light->Synchronize());
  EXPECT_FALSE(light->ElapsedSeconds(*start).ok());
  EXPECT_FALSE(light->Record(Stream{}).ok());  // not on a CPU stream
  PW_ASSERT_OK(producer.stream.Synchronize());
}

TEST(CudaDeviceTest, RoundTripRandomDataThroughCopyTo) {
  PW_NEED_GPU();
  Gpu g = MakeGpu();
  ASSERT_TRUE(g.alloc);
  const std::vector<float> values = RandomFloats(1 << 20, 42);
  Tensor host = Tensor::FromVector({1024, 1024}, values);
  auto dev = host.CopyTo(g.alloc.get());
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ(dev->device(), Device::Cuda(0));
  EXPECT_EQ(dev->shape(), host.shape());
  host.Fill(0.0f);  // the copy is complete on return: the source may change at once
  auto back = dev->CopyTo(nullptr);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->device().is_cpu());
  EXPECT_TRUE(BitEqual(back->ToVector(), values));

  // Other dtypes move as bytes.
  std::vector<int32_t> ints(1000);
  for (int i = 0; i < 1000; ++i) ints[i] = i * 7919 - 3000000;
  Tensor hi = Tensor::FromVectorI32({1000}, ints);
  auto di = hi.CopyTo(g.alloc.get());
  ASSERT_TRUE(di.ok());
  auto bi = di->CopyTo(nullptr);
  ASSERT_TRUE(bi.ok());
  EXPECT_EQ(std::memcmp(bi->raw(), ints.data(), ints.size() * 4), 0);

  // FromVector straight onto the device, and device-to-device across streams.
  Gpu other = MakeGpu();
  Tensor direct = Tensor::FromVector({1024, 1024}, values, g.alloc.get());
  auto moved = direct.CopyTo(other.alloc.get());
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->stream(), other.stream.get());
  direct = Tensor();  // freed on g's stream, after the copy (the stream waits for it)
  EXPECT_TRUE(BitEqual(ToHost(*moved), values));
}

TEST(CudaDeviceTest, PinnedHostAllocator) {
  PW_NEED_GPU();
  auto pinned = CreatePinnedHostAllocator();
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  Gpu g = MakeGpu();
  ASSERT_TRUE(g.alloc);
  const std::vector<float> values = RandomFloats(4096, 7);
  {
    Tensor h = Tensor::FromVector({4096}, values, pinned->get());
    EXPECT_TRUE(h.device().is_cpu());
    EXPECT_EQ((*pinned)->current_bytes(), 4096 * 4);
    cudaPointerAttributes attrs;
    ASSERT_EQ(cudaPointerGetAttributes(&attrs, h.raw()), cudaSuccess);
    EXPECT_EQ(attrs.type, cudaMemoryTypeHost);
    auto d = h.CopyTo(g.alloc.get());
    ASSERT_TRUE(d.ok());
    auto back = d->CopyTo(pinned->get());
    ASSERT_TRUE(back.ok());
    EXPECT_TRUE(BitEqual(back->ToVector(), values));
    // Asynchronous copies from pinned memory with CopyBytes.
    Tensor d2 = Tensor::Empty({4096}, DType::kF32, g.alloc.get());
    PW_ASSERT_OK(
        CopyBytes(d2.raw(), d2.device(), h.raw(), Device::Cpu(), h.nbytes(), g.stream.get()));
    PW_ASSERT_OK(
        CopyBytes(back->raw(), Device::Cpu(), d2.raw(), d2.device(), h.nbytes(), g.stream.get()));
    PW_ASSERT_OK(g.stream.Synchronize());
    EXPECT_TRUE(BitEqual(back->ToVector(), values));
  }
  EXPECT_EQ((*pinned)->current_bytes(), 0);
  EXPECT_GT((*pinned)->peak_bytes(), 0);
}

TEST(CudaDeviceTest, CloneAndSetZeroOnTheDevice) {
  PW_NEED_GPU();
  Gpu g = MakeGpu();
  ASSERT_TRUE(g.alloc);
  const std::vector<float> values = RandomFloats(1000, 3);
  Tensor t = Tensor::FromVector({10, 100}, values, g.alloc.get());
  Tensor c = t.Clone();
  EXPECT_NE(c.raw(), t.raw());
  EXPECT_EQ(c.device(), Device::Cuda(0));
  t.SetZero();
  EXPECT_TRUE(BitEqual(ToHost(c), values));
  EXPECT_EQ(ToHost(t), std::vector<float>(1000, 0.0f));
  Tensor z = Tensor::Zeros({3, 3}, DType::kF32, g.alloc.get());
  EXPECT_EQ(ToHost(z), std::vector<float>(9, 0.0f));
  Tensor on_host = c.Clone(DefaultCpuAllocator());  // Clone to another device
  EXPECT_TRUE(on_host.device().is_cpu());
  EXPECT_TRUE(BitEqual(on_host.ToVector(), values));
  // CPU-stream copies and memsets are synchronous.
  std::vector<float> host(1000);
  PW_ASSERT_OK(g.stream.Synchronize());
  PW_ASSERT_OK(MemsetBytes(c.raw(), c.device(), 0, c.nbytes(), Stream{}));
  PW_ASSERT_OK(CopyBytes(host.data(), Device::Cpu(), c.raw(), c.device(), c.nbytes(), Stream{}));
  EXPECT_EQ(host, std::vector<float>(1000, 0.0f));
}

// Two rank threads on one GPU, each with its own stream and allocator, through the local
// backend: point-to-point device copies (and one to a host buffer), then an all-reduce, a
// reduce-scatter (into a device output on rank 0, a host one on rank 1) and a broadcast staged
// through the host, bit-identical to the host backend's rank-order sum.
TEST(CudaDeviceTest, LocalBackendMovesCudaTensorsOnOneGpu) {
  PW_NEED_GPU();
  auto comms = CreateLocalWorld(2);
  constexpr int64_t kN = 1 << 16;
  const std::vector<float> x0 = RandomFloats(kN, 100), x1 = RandomFloats(kN, 101);
  std::vector<float> expected_sum(kN);
  for (int64_t i = 0; i < kN; ++i) expected_sum[i] = x0[i] + x1[i];
  std::vector<std::vector<float>> received(2), reduced(2), scattered(2), broadcast(2);
  std::vector<float> host_received;
  std::vector<int64_t> leftover(2, -1);

  auto rank_main = [&](int r) {
    ASSERT_TRUE(SetCudaDevice(0).ok());
    Gpu g = MakeGpu();
    ASSERT_TRUE(g.alloc);
    Communicator& c = *comms[r];
    const int peer = 1 - r;
    {
      const std::vector<float>& mine = r == 0 ? x0 : x1;
      Tensor t = Tensor::FromVector({kN}, mine, g.alloc.get());
      // Each rank sends its vector to the other and receives the other's.
      auto send = c.Send(t, peer, 7);
      Tensor in = Tensor::Empty({kN}, DType::kF32, g.alloc.get());
      ASSERT_TRUE(c.Recv(in, peer, 7)->Wait(kWait).ok());
      ASSERT_TRUE(send->Wait(kWait).ok());
      t.SetZero();  // the message was copied: overwriting the source is safe
      received[r] = ToHost(in);
      // Device -> host buffer of the other rank.
      if (r == 0) {
        ASSERT_TRUE(c.Send(in, 1, 8)->Wait(kWait).ok());
      } else {
        Tensor h = Tensor::Zeros({kN});
        ASSERT_TRUE(c.Recv(h, 0, 8)->Wait(kWait).ok());
        host_received = h.ToVector();
      }
      Tensor acc = Tensor::FromVector({kN}, mine, g.alloc.get());
      ASSERT_TRUE(c.AllReduce(acc)->Wait(kWait).ok());
      reduced[r] = ToHost(acc);
      const Tensor rs_in = Tensor::FromVector({kN}, mine, g.alloc.get());
      Tensor rs_out =
          r == 0 ? Tensor::Zeros({kN / 2}, DType::kF32, g.alloc.get()) : Tensor::Zeros({kN / 2});
      ASSERT_TRUE(c.ReduceScatter(rs_in, rs_out)->Wait(kWait).ok());
      scattered[r] = ToHost(rs_out);
      Tensor b = r == 1 ? Tensor::FromVector({kN}, x1, g.alloc.get())
                        : Tensor::Zeros({kN}, DType::kF32, g.alloc.get());
      ASSERT_TRUE(c.Broadcast(b, 1)->Wait(kWait).ok());
      broadcast[r] = ToHost(b);
      ASSERT_TRUE(c.Barrier()->Wait(kWait).ok());
    }
    ASSERT_TRUE(g.stream.Synchronize().ok());
    leftover[r] = g.alloc->current_bytes();
  };
  std::thread t0(rank_main, 0), t1(rank_main, 1);
  t0.join();
  t1.join();
  EXPECT_TRUE(BitEqual(received[0], x1));
  EXPECT_TRUE(BitEqual(received[1], x0));
  EXPECT_TRUE(BitEqual(host_received, x1));  // rank 0 forwarded what it got from rank 1
  EXPECT_TRUE(BitEqual(reduced[0], expected_sum));
  EXPECT_TRUE(BitEqual(reduced[1], expected_sum));
  for (int r = 0; r < 2; ++r) {
    const auto chunk = expected_sum.begin() + r * (kN / 2);
    EXPECT_TRUE(BitEqual(scattered[r], std::vector<float>(chunk, chunk + kN / 2))) << r;
  }
  EXPECT_TRUE(BitEqual(broadcast[0], x1));
  EXPECT_TRUE(BitEqual(broadcast[1], x1));
  EXPECT_EQ(leftover, (std::vector<int64_t>{0, 0}));

  // The same all-reduce on host tensors gives the same bits.
  auto host_comms = CreateLocalWorld(2);
  std::vector<float> host_sum;
  std::thread h0([&] {
    Tensor t = Tensor::FromVector({kN}, x0);
    ASSERT_TRUE(host_comms[0]->AllReduce(t)->Wait(kWait).ok());
    host_sum = t.ToVector();
  });
  std::thread h1([&] {
    Tensor t = Tensor::FromVector({kN}, x1);
    ASSERT_TRUE(host_comms[1]->AllReduce(t)->Wait(kWait).ok());
  });
  h0.join();
  h1.join();
  EXPECT_TRUE(BitEqual(host_sum, expected_sum));
}

}  // namespace
}  // namespace pipewright
