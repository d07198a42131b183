// The device layer's host paths and its failure modes, on every machine: host copies, CPU
// streams, Tensor::CopyTo/CopyFrom/TryEmpty, and, where no GPU is visible (or CUDA was not
// built), clear errors from every CUDA and NCCL entry point instead of a crash.
#include "pipewright/device.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/tensor.h"

namespace pipewright {
namespace {

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(DeviceLayerTest, HostCopiesAndMemsetsNeedNoGpu) {
  std::vector<int32_t> src = {1, 2, 3, 4}, dst(4, 0);
  ASSERT_TRUE(CopyBytes(dst.data(), Device::Cpu(), src.data(), Device::Cpu(), 16, Stream{}).ok());
  EXPECT_EQ(dst, src);
  ASSERT_TRUE(MemsetBytes(dst.data(), Device::Cpu(), 0, 16, Stream{}).ok());
  EXPECT_EQ(dst, (std::vector<int32_t>{0, 0, 0, 0}));
  // Zero bytes is a no-op whatever the devices.
  EXPECT_TRUE(CopyBytes(nullptr, Device::Cuda(0), nullptr, Device::Cpu(), 0, Stream{}).ok());
  EXPECT_TRUE(SynchronizeStream(Stream{}).ok());
}

TEST(DeviceLayerTest, HostTensorsHaveACpuStream) {
  Tensor t = Tensor::FromVector({2}, {1, 2});
  EXPECT_TRUE(t.stream().is_cpu());
  EXPECT_EQ(t.stream().handle, nullptr);
  EXPECT_EQ(t.allocator(), DefaultCpuAllocator());
  EXPECT_EQ(Tensor().allocator(), nullptr);
  CpuAllocator a;
  EXPECT_TRUE(a.stream().is_cpu());
}

TEST(DeviceLayerTest, CopyToAndCopyFromOnTheHost) {
  CpuAllocator alloc;
  Tensor src = Tensor::FromVector({2, 3}, {1, 2, 3, 4, 5, 6});
  auto copy = src.CopyTo(&alloc);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_NE(copy->raw(), src.raw());
  EXPECT_EQ(copy->shape(), src.shape());
  EXPECT_EQ(copy->ToVector(), src.ToVector());
  EXPECT_EQ(alloc.current_bytes(), 24);
  auto to_default = src.CopyTo(nullptr);
  ASSERT_TRUE(to_default.ok());
  EXPECT_EQ(to_default->allocator(), DefaultCpuAllocator());

  Tensor flat = Tensor::Zeros({6});
  ASSERT_TRUE(flat.CopyFrom(src).ok());  // shapes may differ, bytes must not
  EXPECT_EQ(flat.ToVector(), src.ToVector());
  Tensor small = Tensor::Zeros({5});
  absl::Status s = small.CopyFrom(src);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "24 bytes")) << s;
}

TEST(DeviceLayerTest, TryAllocateReportsInsteadOfAborting) {
  CpuAllocator alloc;
  auto zero = alloc.TryAllocate(0);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(*zero, nullptr);
  auto huge = alloc.TryAllocate(size_t{1} << 62);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_EQ(alloc.current_bytes(), 0);
  auto t = Tensor::TryEmpty({4, 4}, DType::kF32, &alloc);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(alloc.current_bytes(), 64);
  EXPECT_EQ(Tensor::TryEmpty({-1}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceLayerTest, EmptyOwnersAreHarmless) {
  CudaStream stream;
  EXPECT_FALSE(stream.valid());
  EXPECT_TRUE(stream.get().is_cpu());
  EXPECT_TRUE(stream.Synchronize().ok());
  CudaStream moved = std::move(stream);
  EXPECT_FALSE(moved.valid());
  CudaEvent event;
  EXPECT_FALSE(event.valid());
  EXPECT_FALSE(event.Query().ok());
  CudaEvent moved_event = std::move(event);
  EXPECT_FALSE(moved_event.valid());
}

TEST(DeviceLayerTest, LocalGroupsAreNoOps) {
  auto comms = CreateLocalWorld(2);
  comms[0]->GroupStart();
  Tensor t = Tensor::FromVector({1}, {3});
  auto send = comms[0]->Send(t, 1, 0);
  EXPECT_TRUE(comms[0]->GroupEnd().ok());
  EXPECT_TRUE(send->Wait(absl::Seconds(1)).ok());
  Tensor r = Tensor::Zeros({1});
  EXPECT_TRUE(comms[1]->Recv(r, 0, 0)->Wait(absl::Seconds(1)).ok());
  EXPECT_EQ(r.ToVector(), (std::vector<float>{3}));
}

// Without a GPU (no driver, no device, or a build without CUDA), every CUDA entry point fails
// with a status that says so, and nothing crashes.
TEST(DeviceLayerTest, CudaEntryPointsFailClearlyWithoutAGpu) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is visible; tests/runtime/cuda_device_test.cc";
  auto alloc = CreateCudaAllocator(0, Stream{});
  ASSERT_FALSE(alloc.ok());
  EXPECT_TRUE(absl::StrContains(Message(alloc.status()), "CUDA")) << alloc.status();
  EXPECT_TRUE(absl::StrContains(Message(alloc.status()), "GPU") ||
              absl::StrContains(Message(alloc.status()), "built without"))
      << alloc.status();

  EXPECT_FALSE(CudaStream::Create(Device::Cuda(0)).ok());
  EXPECT_FALSE(CudaStream::Create(Device::Cpu()).ok());
  EXPECT_FALSE(CudaEvent::Create(Device::Cuda(0)).ok());
  auto info = GetCudaDeviceInfo(0);
  ASSERT_FALSE(info.ok());
  EXPECT_TRUE(absl::StrContains(Message(info.status()), "CUDA")) << info.status();
  EXPECT_FALSE(SetCudaDevice(0).ok());
  EXPECT_FALSE(CreatePinnedHostAllocator().ok());

  std::vector<float> host(4, 1.0f), other(4, 0.0f);
  EXPECT_FALSE(
      CopyBytes(other.data(), Device::Cuda(0), host.data(), Device::Cpu(), 16, Stream{}).ok());
  EXPECT_FALSE(MemsetBytes(other.data(), Device::Cuda(0), 0, 16, Stream{}).ok());
  EXPECT_FALSE(SynchronizeStream(Stream{Device::Cuda(0), nullptr}).ok());

  auto world = CreateNcclWorld({0}, absl::Seconds(5));
  ASSERT_FALSE(world.ok());
  EXPECT_TRUE(absl::StrContains(Message(world.status()), "CUDA") ||
              absl::StrContains(Message(world.status()), "NCCL"))
      << world.status();
  EXPECT_FALSE(CreateNcclCommunicator(std::string(128, '\0'), 0, 1, 0, absl::Seconds(5)).ok());
  EXPECT_FALSE(CreateNcclWorld({}, absl::Seconds(5)).ok());
}

}  // namespace
}  // namespace pipewright
