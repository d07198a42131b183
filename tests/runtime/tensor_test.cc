#include "pipewright/tensor.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <thread>
#include <unordered_set>
#include <vector>

#include "pipewright/device.h"

namespace pipewright {
namespace {

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_STREQ(DTypeName(DType::kF32), "f32");
  EXPECT_STREQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_STREQ(DTypeName(DType::kF16), "f16");
  EXPECT_STREQ(DTypeName(DType::kI32), "i32");
  EXPECT_STREQ(DTypeSafetensorsName(DType::kF32), "F32");
  EXPECT_STREQ(DTypeSafetensorsName(DType::kBF16), "BF16");
  EXPECT_STREQ(DTypeSafetensorsName(DType::kF16), "F16");
  EXPECT_STREQ(DTypeSafetensorsName(DType::kI32), "I32");
}

TEST(DTypeTest, ParseBothSpellingsRoundTrip) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kF64}) {
    auto a = ParseDType(DTypeName(d));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(*a, d);
    auto b = ParseDType(DTypeSafetensorsName(d));
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(*b, d);
  }
  EXPECT_EQ(DTypeSize(DType::kF64), 8u);
  EXPECT_FALSE(ParseDType("f8").ok());
  EXPECT_FALSE(ParseDType("").ok());
  EXPECT_EQ(ParseDType("int8").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorTest, EmptyZerosFromVector) {
  Tensor e = Tensor::Empty({2, 3, 4});
  EXPECT_TRUE(e.defined());
  EXPECT_EQ(e.rank(), 3);
  EXPECT_EQ(e.numel(), 24);
  EXPECT_EQ(e.nbytes(), 96u);
  EXPECT_EQ(e.dim(-1), 4);
  EXPECT_EQ(e.dim(0), 2);
  EXPECT_EQ(e.dtype(), DType::kF32);
  EXPECT_TRUE(e.device().is_cpu());
  EXPECT_NE(e.raw(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(e.raw()) % 64, 0u);

  Tensor z = Tensor::Zeros({5}, DType::kI32);
  EXPECT_EQ(z.dtype(), DType::kI32);
  EXPECT_EQ(z.nbytes(), 20u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(z.data<int32_t>()[i], 0);

  Tensor h = Tensor::Zeros({3}, DType::kBF16);
  EXPECT_EQ(h.nbytes(), 6u);

  Tensor f = Tensor::FromVector({2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(f.ToVector(), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(f.ShapeString(), "[2, 2] f32");
  f.Fill(7.5f);
  EXPECT_EQ(f.ToVector(), (std::vector<float>(4, 7.5f)));
  f.SetZero();
  EXPECT_EQ(f.ToVector(), (std::vector<float>(4, 0.0f)));

  Tensor i = Tensor::FromVectorI32({3}, {7, -1, 9});
  EXPECT_EQ(i.dtype(), DType::kI32);
  EXPECT_EQ(i.data<int32_t>()[1], -1);
  EXPECT_EQ(i.ShapeString(), "[3] i32");

  Tensor undefined;
  EXPECT_FALSE(undefined.defined());
  EXPECT_EQ(undefined.raw(), nullptr);
  EXPECT_EQ(NumElements({2, 3, 7}), 42);
  EXPECT_EQ(NumElements({}), 1);
}

TEST(TensorTest, ReshapeSharesStorage) {
  Tensor t = Tensor::FromVector({2, 3}, {0, 1, 2, 3, 4, 5});
  auto r = t.Reshape({3, 2});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(r->raw(), t.raw());
  r->data<float>()[0] = 42.0f;
  EXPECT_EQ(t.data<float>()[0], 42.0f);
  auto flat = t.Reshape({6});
  ASSERT_TRUE(flat.ok());
  EXPECT_EQ(flat->numel(), 6);
  EXPECT_EQ(t.shape(), (std::vector<int64_t>{2, 3}));  // original unchanged

  auto bad = t.Reshape({4, 2});
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(t.Reshape({-2, -3}).ok());
}

// A shape whose element or byte count overflows 64 bits is an error (TryEmpty, Reshape) or a
// fatal one naming it (Empty), never a wrapped small allocation; memory the system cannot give
// is ResourceExhausted from TryEmpty.
TEST(TensorTest, OverflowingShapesAndHugeAllocationsAreErrors) {
  const int64_t big = int64_t{1} << 40;
  absl::StatusOr<Tensor> elements = Tensor::TryEmpty({big, big});
  ASSERT_FALSE(elements.ok());
  EXPECT_EQ(elements.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(elements.status().message().find("more than 2^63 elements"), std::string::npos)
      << elements.status();
  absl::StatusOr<Tensor> bytes = Tensor::TryEmpty({int64_t{1} << 62}, DType::kF32);
  ASSERT_FALSE(bytes.ok());
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bytes.status().message().find("more than 2^63 bytes"), std::string::npos)
      << bytes.status();
  // 2^61 bytes fit the count but no machine: the allocator says so.
  absl::StatusOr<Tensor> huge = Tensor::TryEmpty({int64_t{1} << 59}, DType::kF32);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  Tensor t = Tensor::Empty({2, 3});
  EXPECT_FALSE(t.Reshape({big, big, 0, big}).ok());  // 0 elements, but the product overflows
  EXPECT_DEATH(Tensor::Empty({big, big}), "more than 2\\^63 elements");
}

TEST(TensorTest, CopiesShareCloneIsDeep) {
  Tensor a = Tensor::FromVector({3}, {1, 2, 3});
  Tensor shallow = a;
  EXPECT_EQ(shallow.raw(), a.raw());
  Tensor deep = a.Clone();
  EXPECT_NE(deep.raw(), a.raw());
  EXPECT_EQ(deep.shape(), a.shape());
  EXPECT_EQ(deep.ToVector(), a.ToVector());
  a.data<float>()[1] = -5.0f;
  EXPECT_EQ(shallow.data<float>()[1], -5.0f);
  EXPECT_EQ(deep.data<float>()[1], 2.0f);

  Tensor ints = Tensor::FromVectorI32({2}, {4, 5});
  Tensor ic = ints.Clone();
  EXPECT_EQ(ic.dtype(), DType::kI32);
  ints.data<int32_t>()[0] = 0;
  EXPECT_EQ(ic.data<int32_t>()[0], 4);
}

TEST(AllocatorTest, CurrentAndPeakAccounting) {
  CpuAllocator alloc;
  EXPECT_EQ(alloc.current_bytes(), 0);
  EXPECT_EQ(alloc.peak_bytes(), 0);
  EXPECT_EQ(alloc.device(), Device::Cpu());
  {
    Tensor a = Tensor::Empty({100}, DType::kF32, &alloc);  // 400 bytes
    EXPECT_EQ(a.device(), Device::Cpu());
    EXPECT_EQ(alloc.current_bytes(), 400);
    {
      Tensor b = Tensor::Zeros({50}, DType::kF16, &alloc);  // 100 bytes
      Tensor alias = b;                                     // shares storage: no new allocation
      EXPECT_EQ(alloc.current_bytes(), 500);
      EXPECT_EQ(alloc.peak_bytes(), 500);
    }
    EXPECT_EQ(alloc.current_bytes(), 400);
    EXPECT_EQ(alloc.peak_bytes(), 500);
    Tensor c = a.Clone();  // clones into the source's allocator
    EXPECT_EQ(alloc.current_bytes(), 800);
    EXPECT_EQ(alloc.peak_bytes(), 800);
  }
  EXPECT_EQ(alloc.current_bytes(), 0);
  EXPECT_EQ(alloc.peak_bytes(), 800);

  Tensor d = Tensor::Empty({10}, DType::kF32, &alloc);
  EXPECT_EQ(alloc.peak_bytes(), 800);
  alloc.ResetPeak();
  EXPECT_EQ(alloc.peak_bytes(), 40);
  d = Tensor();
  EXPECT_EQ(alloc.current_bytes(), 0);
  EXPECT_EQ(alloc.peak_bytes(), 40);
  alloc.ResetPeak();
  EXPECT_EQ(alloc.peak_bytes(), 0);
}

TEST(AllocatorTest, CloneIntoAnotherAllocator) {
  CpuAllocator a, b;
  Tensor t = Tensor::FromVector({4}, {1, 2, 3, 4}, &a);
  Tensor u = t.Clone(&b);
  EXPECT_EQ(a.current_bytes(), 16);
  EXPECT_EQ(b.current_bytes(), 16);
  EXPECT_EQ(u.ToVector(), t.ToVector());
  t = Tensor();
  EXPECT_EQ(a.current_bytes(), 0);
  EXPECT_EQ(b.current_bytes(), 16);
}

TEST(AllocatorTest, ZeroByteAllocationsAreNull) {
  CpuAllocator alloc;
  EXPECT_EQ(alloc.Allocate(0), nullptr);
  Tensor t = Tensor::Empty({0, 3}, DType::kF32, &alloc);
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(alloc.current_bytes(), 0);
  EXPECT_TRUE(t.ToVector().empty());
}

// Freed blocks are kept per size and handed back: a repeated pattern of allocations (a
// training step) reaches the system allocator only the first time; the accounting of bytes in
// use is unchanged by the cache.
TEST(AllocatorTest, CachesFreedBlocksBySize) {
  CpuAllocator alloc;
  void* first = nullptr;
  {
    Tensor a = Tensor::Empty({1000}, DType::kF32, &alloc);
    first = a.raw();
  }
  EXPECT_EQ(alloc.current_bytes(), 0);
  EXPECT_EQ(alloc.cached_bytes(), 4032);  // 4000 rounded up to 64 bytes
  EXPECT_EQ(alloc.system_allocations(), 1);
  Tensor again = Tensor::Empty({1000}, DType::kF32, &alloc);
  EXPECT_EQ(again.raw(), first);  // the same block
  EXPECT_EQ(alloc.cached_bytes(), 0);
  EXPECT_EQ(alloc.current_bytes(), 4000);
  EXPECT_EQ(alloc.system_allocations(), 1);
  Tensor other = Tensor::Empty({10}, DType::kF32, &alloc);  // another size: a new block
  EXPECT_EQ(alloc.system_allocations(), 2);
  for (int step = 0; step < 5; ++step) {
    std::vector<Tensor> live;
    for (int64_t n : {7, 300, 300, 4096, 7})
      live.push_back(Tensor::Empty({n}, DType::kF32, &alloc));
  }
  EXPECT_EQ(alloc.system_allocations(), 2 + 5);  // 7, 300, 300, 4096, 7 once each
  EXPECT_EQ(alloc.peak_bytes(), 4000 + 40 + 4 * (7 + 300 + 300 + 4096 + 7));
  again = Tensor();
  other = Tensor();
  EXPECT_GT(alloc.cached_bytes(), 0);
  alloc.Trim();
  EXPECT_EQ(alloc.cached_bytes(), 0);
  EXPECT_EQ(alloc.current_bytes(), 0);
}

// Blocks freed on other threads return to the cache safely (ranks free each other's messages).
TEST(AllocatorTest, FreeFromOtherThreads) {
  CpuAllocator alloc;
  std::vector<Tensor> made;
  for (int i = 0; i < 64; ++i) made.push_back(Tensor::Empty({256}, DType::kF32, &alloc));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < 64; i += 4) made[i] = Tensor();
      for (int i = 0; i < 16; ++i) Tensor::Empty({256}, DType::kF32, &alloc);
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(alloc.current_bytes(), 0);
  EXPECT_EQ(alloc.cached_bytes(), 64 * 1024);
  EXPECT_EQ(alloc.system_allocations(), 64);
}

TEST(DeviceTest, Parse) {
  auto cpu = Device::Parse("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(*cpu, Device::Cpu());
  EXPECT_TRUE(cpu->is_cpu());
  EXPECT_EQ(cpu->index, 0);

  auto cuda1 = Device::Parse("cuda:1");
  ASSERT_TRUE(cuda1.ok()) << cuda1.status();
  EXPECT_TRUE(cuda1->is_cuda());
  EXPECT_EQ(cuda1->index, 1);
  EXPECT_EQ(*cuda1, Device::Cuda(1));

  auto cuda = Device::Parse("cuda");
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(*cuda, Device::Cuda(0));
  auto cpu2 = Device::Parse("cpu:2");
  ASSERT_TRUE(cpu2.ok());
  EXPECT_EQ(*cpu2, Device::Cpu(2));

  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:1:2", "CUDA:0", "tpu:0"}) {
    auto r = Device::Parse(bad);
    EXPECT_FALSE(r.ok()) << "'" << bad << "' parsed as " << r->ToString();
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    }
  }
}

TEST(DeviceTest, ToStringRoundTrips) {
  for (Device d : {Device::Cpu(), Device::Cpu(3), Device::Cuda(0), Device::Cuda(7)}) {
    auto r = Device::Parse(d.ToString());
    ASSERT_TRUE(r.ok()) << d.ToString();
    EXPECT_EQ(*r, d);
  }
  EXPECT_EQ(Device::Cuda(1).ToString(), "cuda:1");
}

TEST(DeviceTest, EqualityAndHash) {
  EXPECT_EQ(Device::Cuda(1), Device::Cuda(1));
  EXPECT_NE(Device::Cuda(1), Device::Cuda(0));
  EXPECT_NE(Device::Cpu(0), Device::Cuda(0));
  std::hash<Device> h;
  EXPECT_EQ(h(Device::Cuda(2)), h(Device::Cuda(2)));
  EXPECT_NE(h(Device::Cpu(0)), h(Device::Cuda(0)));
  std::unordered_set<Device> set{Device::Cpu(), Device::Cuda(0), Device::Cuda(1), Device::Cuda(1)};
  EXPECT_EQ(set.size(), 3u);
  EXPECT_TRUE(set.contains(Device::Cuda(1)));
  EXPECT_FALSE(set.contains(Device::Cpu(1)));
}

}  // namespace
}  // namespace pipewright
