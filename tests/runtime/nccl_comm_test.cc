// The NCCL communicator over every visible GPU (one rank thread per GPU): send/recv, all-reduce
// and reduce-scatter of random data against a host sum, all-gather, broadcast, barrier, split, a
// Wait timeout on a receive with no sender, and abort unblocking it. Skips without a GPU or without
// NCCL; the multi-rank cases skip with fewer than 2 GPUs (a 1-GPU machine still runs the size-1
// world).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
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

using Comms = std::vector<std::unique_ptr<Communicator>>;
constexpr absl::Duration kWait = absl::Seconds(60);

#define PW_NEED_GPUS(n)                                                        \
  do {                                                                         \
    if (CudaDeviceCount() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s)"; \
  } while (0)

// What each rank thread owns: its GPU's compute stream and allocator.
struct Rank {
  int device = 0;
  CudaStream stream;
  std::unique_ptr<Allocator> alloc;
};

// The ranks' resources outlive the communicators (declared first, destroyed last): an operation
// still in flight keeps its tensors, and so their allocator, until its communicator goes.
struct World {
  std::vector<Rank> ranks;
  Comms comms;
};

// A world over GPUs 0..n-1, or skips the test when NCCL was not built.
#define PW_MAKE_WORLD(w, n, timeout)                                                        \
  World w;                                                                                  \
  do {                                                                                      \
    std::vector<int> pw_devs_;                                                              \
    for (int pw_d_ = 0; pw_d_ < (n); ++pw_d_) pw_devs_.push_back(pw_d_);                    \
    auto pw_world_ = CreateNcclWorld(pw_devs_, (timeout));                                  \
    if (!pw_world_.ok() && absl::StrContains(pw_world_.status().message(), "without NCCL")) \
      GTEST_SKIP() << pw_world_.status();                                                   \
    ASSERT_TRUE(pw_world_.ok()) << pw_world_.status();                                      \
    w.comms = *std::move(pw_world_);                                                        \
    w.ranks.resize(w.comms.size());                                                         \
  } while (0)

bool MakeRank(int device, Rank* r) {
  r->device = device;
  if (!SetCudaDevice(device).ok()) return false;
  auto s = CudaStream::Create(Device::Cuda(device));
  if (!s.ok()) return false;
  r->stream = *std::move(s);
  auto a = CreateCudaAllocator(device, r->stream.get());
  if (!a.ok()) return false;
  r->alloc = *std::move(a);
  return true;
}

// Runs fn(rank, comm, resources) on one thread per communicator; rank r uses GPU r.
void RunRanks(World& w, const std::function<void(int, Communicator&, Rank&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < static_cast<int>(w.comms.size()); ++r) {
    threads.emplace_back([&, r] {
      Rank& res = w.ranks[r];
      if (!res.alloc) {
        ASSERT_TRUE(MakeRank(r, &res));
      }
      ASSERT_TRUE(SetCudaDevice(r).ok());
      fn(r, *w.comms[r], res);
      ASSERT_TRUE(res.stream.Synchronize().ok());
    });
  }
  for (std::thread& t : threads) t.join();
}

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<float> ToHost(const Tensor& t) {
  auto h = t.CopyTo(nullptr);
  EXPECT_TRUE(h.ok()) << h.status();
  return h.ok() ? h->ToVector() : std::vector<float>();
}

TEST(NcclCommTest, SizeOneWorld) {
  PW_NEED_GPUS(1);
  PW_MAKE_WORLD(w, 1, kWait);
  ASSERT_EQ(w.comms.size(), 1u);
  EXPECT_EQ(w.comms[0]->kind(), CommBackend::kNccl);
  const CommCapabilities caps = w.comms[0]->capabilities();
  EXPECT_FALSE(caps.tagged_p2p);
  EXPECT_FALSE(caps.eager_send);
  EXPECT_FALSE(caps.host_memory);
  EXPECT_TRUE(caps.device_memory);
  EXPECT_TRUE(caps.stream_ordered);
  EXPECT_TRUE(caps.grouped_p2p);
  EXPECT_FALSE(caps.rank_order_sum);
  EXPECT_EQ(w.comms[0]->rank(), 0);
  EXPECT_EQ(w.comms[0]->size(), 1);
  RunRanks(w, [](int, Communicator& c, Rank& res) {
    const std::vector<float> v = RandomFloats(1000, 1);
    Tensor t = Tensor::FromVector({1000}, v, res.alloc.get());
    ASSERT_TRUE(c.AllReduce(t)->Wait(kWait).ok());
    EXPECT_EQ(ToHost(t), v);  // the sum over one rank
    ASSERT_TRUE(c.Broadcast(t, 0)->Wait(kWait).ok());
    EXPECT_EQ(ToHost(t), v);
    ASSERT_TRUE(c.Barrier()->Wait(kWait).ok());
    Tensor gathered = Tensor::Zeros({1000}, DType::kF32, res.alloc.get());
    ASSERT_TRUE(c.AllGather(t, gathered)->Wait(kWait).ok());
    EXPECT_EQ(ToHost(gathered), v);  // the one block
    Tensor scattered = Tensor::Zeros({1000}, DType::kF32, res.alloc.get());
    ASSERT_TRUE(c.ReduceScatter(t, scattered)->Wait(kWait).ok());
    EXPECT_EQ(ToHost(scattered), v);  // the one chunk of the sum over one rank
    // In place.
    ASSERT_TRUE(c.ReduceScatter(t, t)->Wait(kWait).ok());
    EXPECT_EQ(ToHost(t), v);
    // Send to and receive from itself in one group.
    Tensor in = Tensor::Zeros({1000}, DType::kF32, res.alloc.get());
    c.GroupStart();
    auto send = c.Send(t, 0, 1);
    auto recv = c.Recv(in, 0, 1);
    ASSERT_TRUE(c.GroupEnd().ok());
    ASSERT_TRUE(recv->Wait(kWait).ok());
    ASSERT_TRUE(send->Wait(kWait).ok());
    EXPECT_EQ(ToHost(in), v);
    // Wrong arguments fail as statuses.
    Tensor host = Tensor::FromVector({2}, {1, 2});
    absl::Status bad = c.AllReduce(host)->Wait(kWait);
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(bad.message(), "cuda:0")) << bad;
    EXPECT_EQ(c.Send(t, 1, 0)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
    Tensor half = Tensor::Zeros({4}, DType::kBF16, res.alloc.get());
    EXPECT_EQ(c.AllReduce(half)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
    Tensor too_big = Tensor::Zeros({1001}, DType::kF32, res.alloc.get());
    absl::Status gather = c.AllGather(t, too_big)->Wait(kWait);
    EXPECT_EQ(gather.code(), absl::StatusCode::kInvalidArgument) << gather;
    EXPECT_TRUE(absl::StrContains(gather.message(), "AllGather")) << gather;
    EXPECT_EQ(c.AllGather(t, host)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
    for (Tensor* out : {&too_big, &host}) {
      absl::Status scatter = c.ReduceScatter(t, *out)->Wait(kWait);
      EXPECT_EQ(scatter.code(), absl::StatusCode::kInvalidArgument) << scatter;
      EXPECT_TRUE(absl::StrContains(scatter.message(), "ReduceScatter")) << scatter;
    }
    Tensor half_out = Tensor::Zeros({4}, DType::kBF16, res.alloc.get());
    absl::Status scatter_bf16 = c.ReduceScatter(half, half_out)->Wait(kWait);
    EXPECT_EQ(scatter_bf16.code(), absl::StatusCode::kInvalidArgument) << scatter_bf16;
    EXPECT_TRUE(absl::StrContains(scatter_bf16.message(), "ReduceScatter supports"))
        << scatter_bf16;
    // Abort ends every later operation with its status.
    c.Abort(absl::UnavailableError("test abort"));
    EXPECT_EQ(c.abort_status().code(), absl::StatusCode::kUnavailable);
    absl::Status after = c.Barrier()->Wait(kWait);
    EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable) << after;
  });
}

TEST(NcclCommTest, SendRecvRing) {
  PW_NEED_GPUS(2);
  const int n = CudaDeviceCount();
  PW_MAKE_WORLD(w, n, kWait);
  std::vector<std::vector<float>> got(n);
  RunRanks(w, [&](int r, Communicator& c, Rank& res) {
    Tensor out = Tensor::FromVector({4096}, RandomFloats(4096, 10 + r), res.alloc.get());
    Tensor in = Tensor::Empty({4096}, DType::kF32, res.alloc.get());
    // Everyone sends right and receives from the left in one group (no deadlock).
    c.GroupStart();
    auto send = c.Send(out, (r + 1) % n, 3);
    auto recv = c.Recv(in, (r + n - 1) % n, 3);
    ASSERT_TRUE(c.GroupEnd().ok());
    ASSERT_TRUE(recv->Wait(kWait).ok());
    ASSERT_TRUE(send->Wait(kWait).ok());
    got[r] = ToHost(in);
    // Then an ungrouped exchange in a fixed order: even ranks send first.
    Tensor again = Tensor::Zeros({4096}, DType::kF32, res.alloc.get());
    if (r == 0) {
      ASSERT_TRUE(c.Send(out, 1, 4)->Wait(kWait).ok());
    } else if (r == 1) {
      ASSERT_TRUE(c.Recv(again, 0, 4)->Wait(kWait).ok());
      EXPECT_EQ(ToHost(again), RandomFloats(4096, 10));
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(got[r], RandomFloats(4096, 10 + (r + n - 1) % n)) << r;
}

TEST(NcclCommTest, AllReduceMatchesAHostSum) {
  PW_NEED_GPUS(2);
  const int n = CudaDeviceCount();
  PW_MAKE_WORLD(w, n, kWait);
  constexpr int64_t kN = 1 << 20;
  std::vector<double> host_sum(kN, 0.0);
  for (int r = 0; r < n; ++r) {
    const std::vector<float> v = RandomFloats(kN, 50 + r);
    for (int64_t i = 0; i < kN; ++i) host_sum[i] += v[i];
  }
  std::vector<std::vector<float>> results(n);
  std::vector<std::vector<int32_t>> ints(n);
  RunRanks(w, [&](int r, Communicator& c, Rank& res) {
    Tensor t = Tensor::FromVector({kN}, RandomFloats(kN, 50 + r), res.alloc.get());
    ASSERT_TRUE(c.AllReduce(t)->Wait(kWait).ok());
    results[r] = ToHost(t);
    Tensor i = Tensor::FromVectorI32({3}, {r, 1, -2 * r}, res.alloc.get());
    ASSERT_TRUE(c.AllReduce(i)->Wait(kWait).ok());
    auto hi = i.CopyTo(nullptr);
    ASSERT_TRUE(hi.ok());
    ints[r].assign(hi->data<int32_t>(), hi->data<int32_t>() + 3);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(results[r].size(), static_cast<size_t>(kN));
    // NCCL's result is the same on every rank.
    EXPECT_EQ(std::memcmp(results[r].data(), results[0].data(), kN * sizeof(float)), 0) << r;
    double worst = 0;
    for (int64_t i = 0; i < kN; ++i)
      worst = std::max(worst, std::fabs(results[r][i] - host_sum[i]));
    EXPECT_LT(worst, 1e-5 * n) << r;
    const int32_t rank_sum = n * (n - 1) / 2;
    EXPECT_EQ(ints[r], (std::vector<int32_t>{rank_sum, n, -2 * rank_sum})) << r;
  }
}

// NCCL's sum, not the rank-order one (comm.h): each rank's chunk is checked against a host sum
// with a tolerance, and against the same chunk of an all-reduce of the same inputs (identical
// on every rank, but not necessarily bit for bit to the reduce-scatter).
TEST(NcclCommTest, ReduceScatterMatchesAHostSumChunk) {
  PW_NEED_GPUS(2);
  const int n = CudaDeviceCount();
  PW_MAKE_WORLD(w, n, kWait);
  constexpr int64_t kN = (1 << 18) + 3;  // per rank
  std::vector<double> host_sum(n * kN, 0.0);
  for (int r = 0; r < n; ++r) {
    const std::vector<float> v = RandomFloats(n * kN, 90 + r);
    for (int64_t i = 0; i < n * kN; ++i) host_sum[i] += v[i];
  }
  std::vector<std::vector<float>> chunks(n), reduced(n);
  std::vector<std::vector<int32_t>> ints(n);
  RunRanks(w, [&](int r, Communicator& c, Rank& res) {
    const std::vector<float> v = RandomFloats(n * kN, 90 + r);
    const Tensor in = Tensor::FromVector({n * kN}, v, res.alloc.get());
    Tensor out = Tensor::Empty({kN}, DType::kF32, res.alloc.get());
    Tensor all = Tensor::FromVector({n * kN}, v, res.alloc.get());
    auto scatter = c.ReduceScatter(in, out);
    auto reduce = c.AllReduce(all);
    ASSERT_TRUE(reduce->Wait(kWait).ok());
    ASSERT_TRUE(scatter->Wait(kWait).ok());
    chunks[r] = ToHost(out);
    reduced[r] = ToHost(all);
    std::vector<int32_t> iv;
    for (int k = 0; k < n; ++k) iv.insert(iv.end(), {r, k, -2 * r});
    const Tensor ii = Tensor::FromVectorI32({3 * n}, iv, res.alloc.get());
    Tensor io = Tensor::Empty({3}, DType::kI32, res.alloc.get());
    ASSERT_TRUE(c.ReduceScatter(ii, io)->Wait(kWait).ok());
    auto hi = io.CopyTo(nullptr);
    ASSERT_TRUE(hi.ok()) << hi.status();
    ints[r].assign(hi->data<int32_t>(), hi->data<int32_t>() + 3);
  });
  const int32_t rank_sum = n * (n - 1) / 2;
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(chunks[r].size(), static_cast<size_t>(kN));
    double worst = 0, worst_vs_all_reduce = 0;
    for (int64_t i = 0; i < kN; ++i) {
      worst = std::max(worst, std::fabs(chunks[r][i] - host_sum[r * kN + i]));
      worst_vs_all_reduce =
          std::max(worst_vs_all_reduce, double{std::fabs(chunks[r][i] - reduced[r][r * kN + i])});
    }
    EXPECT_LT(worst, 1e-5 * n) << r;
    EXPECT_LT(worst_vs_all_reduce, 1e-5 * n) << r;
    EXPECT_EQ(ints[r], (std::vector<int32_t>{rank_sum, n * r, -2 * rank_sum})) << r;
  }
}

TEST(NcclCommTest, AllGatherConcatenatesInRankOrder) {
  PW_NEED_GPUS(2);
  const int n = CudaDeviceCount();
  PW_MAKE_WORLD(w, n, kWait);
  constexpr int64_t kN = 4099;
  std::vector<std::vector<float>> f32(n);
  std::vector<std::vector<int32_t>> i32(n);
  RunRanks(w, [&](int r, Communicator& c, Rank& res) {
    Tensor in = Tensor::FromVector({kN}, RandomFloats(kN, 70 + r), res.alloc.get());
    Tensor out = Tensor::Empty({n, kN}, DType::kF32, res.alloc.get());
    ASSERT_TRUE(c.AllGather(in, out)->Wait(kWait).ok());
    f32[r] = ToHost(out);
    Tensor ii = Tensor::FromVectorI32({2}, {r, -r}, res.alloc.get());
    Tensor io = Tensor::Empty({2 * n}, DType::kI32, res.alloc.get());
    ASSERT_TRUE(c.AllGather(ii, io)->Wait(kWait).ok());
    auto host = io.CopyTo(nullptr);
    ASSERT_TRUE(host.ok()) << host.status();
    i32[r].assign(host->data<int32_t>(), host->data<int32_t>() + 2 * n);
  });
  std::vector<float> expected;
  std::vector<int32_t> expected_i32;
  for (int r = 0; r < n; ++r) {
    const std::vector<float> v = RandomFloats(kN, 70 + r);
    expected.insert(expected.end(), v.begin(), v.end());
    expected_i32.push_back(r);
    expected_i32.push_back(-r);
  }
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(f32[r], expected) << r;  // bytes moved, nothing summed: exact
    EXPECT_EQ(i32[r], expected_i32) << r;
  }
}

TEST(NcclCommTest, BroadcastBarrierAndSplit) {
  PW_NEED_GPUS(2);
  const int n = CudaDeviceCount();
  PW_MAKE_WORLD(w, n, kWait);
  const std::vector<float> from_last = RandomFloats(777, 99);
  RunRanks(w, [&](int r, Communicator& c, Rank& res) {
    Tensor t = r == n - 1 ? Tensor::FromVector({777}, from_last, res.alloc.get())
                          : Tensor::Zeros({777}, DType::kF32, res.alloc.get());
    ASSERT_TRUE(c.Broadcast(t, n - 1)->Wait(kWait).ok());
    EXPECT_EQ(ToHost(t), from_last) << r;
    ASSERT_TRUE(c.Barrier()->Wait(kWait).ok());
    // Everyone but rank 0, in reverse order.
    auto sub = c.Split(r == 0 ? -1 : 0, -r, kWait);
    ASSERT_TRUE(sub.ok()) << sub.status();
    if (r == 0) {
      EXPECT_EQ(*sub, nullptr);
      return;
    }
    ASSERT_NE(*sub, nullptr);
    EXPECT_EQ((*sub)->size(), n - 1);
    EXPECT_EQ((*sub)->rank(), n - 1 - r);
    Tensor one = Tensor::FromVector({1}, {1.0f}, res.alloc.get());
    ASSERT_TRUE((*sub)->AllReduce(one)->Wait(kWait).ok());
    EXPECT_EQ(ToHost(one), (std::vector<float>{static_cast<float>(n - 1)}));
  });
}

TEST(NcclCommTest, WaitTimesOutAndAbortUnblocks) {
  PW_NEED_GPUS(2);
  PW_MAKE_WORLD(w, 2, kWait);
  RunRanks(w, [&](int r, Communicator& c, Rank& res) {
    Tensor t = Tensor::Zeros({256}, DType::kF32, res.alloc.get());
    // Connect the pair first (NCCL connects lazily on the first send/recv).
    if (r == 0) {
      ASSERT_TRUE(c.Send(t, 1, 0)->Wait(kWait).ok());
    } else {
      ASSERT_TRUE(c.Recv(t, 0, 0)->Wait(kWait).ok());
    }
    ASSERT_TRUE(c.Barrier()->Wait(kWait).ok());
    if (r == 0) return;  // rank 0 never sends the second message
    auto recv = c.Recv(t, 0, 1);
    absl::Status s = recv->Wait(absl::Milliseconds(300));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "Recv from rank 0")) << s;
    EXPECT_FALSE(recv->Done());
    const auto start = std::chrono::steady_clock::now();
    c.Abort(absl::AbortedError("rank 1 gave up"));
    absl::Status aborted = recv->Wait(kWait);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(aborted.code(), absl::StatusCode::kAborted) << aborted;
    EXPECT_LT(seconds, 10.0);
    EXPECT_TRUE(recv->Done());
  });
  // Every communicator of the world sees the abort.
  EXPECT_EQ(w.comms[0]->abort_status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(w.comms[0]->Barrier()->Wait(kWait).code(), absl::StatusCode::kAborted);
}

TEST(NcclCommTest, RejectsBadDeviceLists) {
  PW_NEED_GPUS(1);
  auto dup = CreateNcclWorld({0, 0}, kWait);
  if (!dup.ok() && absl::StrContains(dup.status().message(), "without NCCL")) GTEST_SKIP();
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument) << dup.status();
  EXPECT_EQ(CreateNcclWorld({CudaDeviceCount()}, kWait).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateNcclCommunicator("short", 0, 1, 0, kWait).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto id = NcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->size(), 128u);
}

}  // namespace
}  // namespace pipewright
