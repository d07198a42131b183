// Tests of the MPI backend's collectives (runtime/comm/mpi_collectives.cc): AllReduce,
// ReduceScatter, AllGather and Broadcast across processes, bit for bit against the rank-order sum
// and the local backend, and their argument checks on every rank. Part of mpi_comm_test (see
// mpi_comm_test.cc for how it runs).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/tensor.h"
#include "runtime/comm/mpi.h"
#include "tests/runtime/mpi_test_util.h"

namespace pipewright::mpi_test {
namespace {

TEST_F(MpiCommTest, AllReduceIsBitIdenticalToRankOrderSumAndLocalBackend) {
  for (int64_t n : {int64_t{4099}, int64_t{1}, int64_t{3}, int64_t{1} << 18}) {
    std::vector<Tensor> inputs;
    for (int r = 0; r < size_; ++r) inputs.push_back(MixedMagnitudeInput(r, n, 1234));
    const Tensor expected = SequentialSum(inputs);
    if (n == 4099 && size_ > 2) {
      // The check can fail: another order gives other bits somewhere.
      std::vector<Tensor> reversed(inputs.rbegin(), inputs.rend());
      ASSERT_FALSE(BitEqual(SequentialSum(reversed), expected));
    }
    EXPECT_TRUE(BitEqual(LocalAllReduce(inputs, kWait), expected));
    for (int run = 0; run < 3; ++run) {
      Tensor mine = inputs[rank_].Clone();
      absl::Status s = world_->AllReduce(mine)->Wait(kWait);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_TRUE(BitEqual(mine, expected)) << "n " << n << " run " << run;
    }
  }
}

TEST_F(MpiCommTest, AllReduceF64AndI32) {
  Tensor d = Tensor::Empty({2}, DType::kF64);
  d.data<double>()[0] = 0.1 * (rank_ + 1);
  d.data<double>()[1] = 1e300 * (rank_ == 1 ? -1 : 1);
  Tensor i = Tensor::FromVectorI32({3}, {rank_, -10 * rank_, 2147483647});
  auto wd = world_->AllReduce(d);
  auto wi = world_->AllReduce(i);
  ASSERT_TRUE(wi->Wait(kWait).ok());  // out of call order
  ASSERT_TRUE(wd->Wait(kWait).ok());
  double e0 = 0.1, e1 = 1e300;
  int32_t s0 = 0, s1 = 0;
  uint32_t s2 = 2147483647u;
  for (int r = 1; r < size_; ++r) {
    e0 = e0 + 0.1 * (r + 1);
    e1 = e1 + 1e300 * (r == 1 ? -1 : 1);
    s0 += r;
    s1 += -10 * r;
    s2 += 2147483647u;  // wraps around
  }
  EXPECT_EQ(d.data<double>()[0], e0);
  EXPECT_EQ(d.data<double>()[1], e1);
  EXPECT_EQ(i.data<int32_t>()[0], s0);
  EXPECT_EQ(i.data<int32_t>()[1], s1);
  EXPECT_EQ(i.data<int32_t>()[2], static_cast<int32_t>(s2));
}

TEST_F(MpiCommTest, ManyCollectivesInFlight) {
  // Bucketed gradients: several AllReduces started before any is waited for, mixed with a
  // Broadcast and a Barrier, waited for in reverse order.
  std::vector<Tensor> bufs;
  std::vector<std::unique_ptr<Work>> works;
  for (int b = 0; b < 6; ++b) {
    bufs.push_back(Tensor::FromVector({b + 1}, std::vector<float>(b + 1, float(rank_ + b))));
    works.push_back(world_->AllReduce(bufs.back()));
  }
  Tensor bc = Scalar1(static_cast<float>(rank_));
  works.push_back(world_->Broadcast(bc, size_ - 1));
  works.push_back(world_->Barrier());
  for (auto it = works.rbegin(); it != works.rend(); ++it) {
    absl::Status s = (*it)->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
  }
  for (int b = 0; b < 6; ++b) {
    float e = 0;
    for (int r = 0; r < size_; ++r) e += static_cast<float>(r + b);
    EXPECT_EQ(bufs[b].ToVector(), std::vector<float>(b + 1, e)) << "bucket " << b;
  }
  EXPECT_EQ(bc.ToVector()[0], static_cast<float>(size_ - 1));
}

TEST_F(MpiCommTest, AllReduceRejectsOtherDtypesForEveryRank) {
  Tensor a = Tensor::Zeros({4}, DType::kBF16);
  absl::Status s = world_->AllReduce(a)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "bf16")) << s;
  // The failed collective still counted: the next ones match.
  Tensor x = Scalar1(static_cast<float>(rank_ + 1));
  s = world_->AllReduce(x)->Wait(kWait);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(x.ToVector()[0], static_cast<float>(size_ * (size_ + 1) / 2));
}

TEST_F(MpiCommTest, OneRanksBadArgumentsFailEveryRank) {
  // Only the last rank passes bf16: it fails at once, every other rank learns it.
  Tensor a = Tensor::Zeros({4}, rank_ == size_ - 1 ? DType::kBF16 : DType::kF32);
  absl::Status s = world_->AllReduce(a)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "bf16")) << s;
  Tensor x = Scalar1(1);
  ASSERT_TRUE(world_->AllReduce(x)->Wait(kWait).ok());
  EXPECT_EQ(x.ToVector()[0], static_cast<float>(size_));
}

TEST_F(MpiCommTest, AllReduceMismatchFailsEveryParticipant) {
  Tensor t = Tensor::Zeros({rank_ == 1 ? 5 : 4});
  absl::Status s = world_->AllReduce(t)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "[5] f32")) << s;
  EXPECT_TRUE(Contains(s, "[4] f32")) << s;
  // Mismatched kinds too.
  std::unique_ptr<Work> w;
  Tensor d = Scalar1(0);
  if (rank_ == 0) {
    w = world_->AllReduce(d);
  } else {
    w = world_->Barrier();
  }
  s = w->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "Barrier")) << s;
  EXPECT_TRUE(Contains(s, "AllReduce")) << s;
  // Disagreeing Broadcast roots.
  s = world_->Broadcast(d, rank_ == 0 ? 0 : size_ - 1)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "root")) << s;
  // And the communicator is still in step.
  Tensor x = Scalar1(2);
  ASSERT_TRUE(world_->AllReduce(x)->Wait(kWait).ok());
  EXPECT_EQ(x.ToVector()[0], 2.0f * size_);
}

TEST_F(MpiCommTest, ReduceScatterIsAllReduceChunkBitForBit) {
  // 1e8 + 1 rounds back to 1e8 in f32, so with 3 or more ranks the order of these terms decides
  // the result (with 4: ((1e8 + 1) + -1e8) + 1 = 1 in rank order, 2 in others).
  const float terms[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  float rank_order = terms[0];
  for (int r = 1; r < size_; ++r) rank_order = rank_order + terms[r % 4];
  if (size_ == 4) {
    ASSERT_EQ(rank_order, 1.0f);
  }
  Tensor t = Tensor::FromVector({size_}, std::vector<float>(size_, terms[rank_ % 4]));
  Tensor one = Tensor::Zeros({1});
  absl::Status s = world_->ReduceScatter(t, one)->Wait(kWait);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(one.ToVector()[0], rank_order);
  // Mixed magnitudes against the rank-order sum, this backend's AllReduce and the local
  // backend's, ranks arriving staggered; the last size through derived datatypes of 1000-byte
  // blocks.
  SleepMs(10 * ((rank_ * 3) % size_));
  for (int64_t n : {int64_t{1025}, int64_t{1}, int64_t{1} << 16, int64_t{100003}}) {
    if (n == 100003) {
      MpiWorldOptions o;
      o.max_block_bytes = 1000;
      Create(o);
    }
    std::vector<Tensor> inputs;
    for (int r = 0; r < size_; ++r) inputs.push_back(MixedMagnitudeInput(r, size_ * n, 4321));
    const Tensor expected = SequentialSum(inputs);
    EXPECT_TRUE(BitEqual(LocalAllReduce(inputs, kWait), expected));
    Tensor reduced = inputs[rank_].Clone(), out = Tensor::Zeros({n});
    auto wr = world_->AllReduce(reduced);
    auto ws = world_->ReduceScatter(inputs[rank_], out);
    ASSERT_TRUE(ws->Wait(kWait).ok());  // out of call order
    ASSERT_TRUE(wr->Wait(kWait).ok());
    EXPECT_TRUE(BitEqual(reduced, expected)) << "n " << n;
    EXPECT_TRUE(BitEqual(out, ChunkOf(expected, rank_ * n, n))) << "n " << n;
    // The input was only read.
    EXPECT_TRUE(BitEqual(inputs[rank_], MixedMagnitudeInput(rank_, size_ * n, 4321)));
  }
}

TEST_F(MpiCommTest, ReduceScatterF64AndI32MatchAllReduce) {
  CheckF64AndI32ReduceScatter(*world_, kWait);
}

TEST_F(MpiCommTest, ReduceScatterInAGroupOfOne) {
  // Every rank alone in its own group: `out` may be `in` itself.
  absl::StatusOr<std::unique_ptr<Communicator>> alone = world_->Split(rank_, 0, kWait);
  ASSERT_TRUE(alone.ok()) << alone.status();
  ASSERT_EQ((*alone)->size(), 1);
  Tensor t = Tensor::FromVector({2}, {1.0f * rank_, 2}), copy = Tensor::Zeros({2});
  ASSERT_TRUE((*alone)->ReduceScatter(t, t)->Wait(kWait).ok());
  ASSERT_TRUE((*alone)->ReduceScatter(t, copy)->Wait(kWait).ok());
  EXPECT_EQ(t.ToVector(), (std::vector<float>{1.0f * rank_, 2}));
  EXPECT_EQ(copy.ToVector(), (std::vector<float>{1.0f * rank_, 2}));
}

TEST_F(MpiCommTest, ReduceScatterBadOrDisagreeingArgumentsFailEveryRank) {
  // Only the last rank's input is one element short: it fails at once, every other rank learns it.
  Tensor out = Tensor::Zeros({3});
  Tensor in = Tensor::Zeros({rank_ == size_ - 1 ? 3 * size_ - 1 : 3 * size_});
  ExpectInvalidArgument(
      world_->ReduceScatter(in, out)->Wait(kWait),
      {"ReduceScatter (collective #0)", absl::StrCat("must have ", 3 * size_, " elements")});
  // bf16 on rank 0 only.
  const DType dtype = rank_ == 0 ? DType::kBF16 : DType::kF32;
  Tensor h = Tensor::Zeros({3 * size_}, dtype), h_out = Tensor::Zeros({3}, dtype);
  ExpectInvalidArgument(world_->ReduceScatter(h, h_out)->Wait(kWait),
                        {"ReduceScatter supports f32, f64 and i32, got bf16"});
  // Inputs that disagree between ranks (each one consistent with its own output).
  const int64_t n = rank_ == 1 ? 5 : 4;
  Tensor mine = Tensor::Zeros({n * size_}), chunk = Tensor::Zeros({n});
  ExpectInvalidArgument(world_->ReduceScatter(mine, chunk)->Wait(kWait),
                        {absl::StrCat("ReduceScatter (collective #2): rank 1 passed [", 5 * size_,
                                      "] f32 but rank 0 passed [", 4 * size_, "] f32")});
  // ReduceScatter against an AllReduce.
  Tensor full = Tensor::Zeros({3 * size_});
  ExpectInvalidArgument(
      (rank_ == 0 ? world_->ReduceScatter(full, out) : world_->AllReduce(full))->Wait(kWait),
      {"called AllReduce but rank 0 called ReduceScatter"});
  // The communicator is still in step, and nothing was aborted.
  EXPECT_TRUE(world_->abort_status().ok());
  Tensor ones = Tensor::FromVector({2 * size_}, std::vector<float>(2 * size_, 1.0f));
  Tensor two = Tensor::Zeros({2});
  ASSERT_TRUE(world_->ReduceScatter(ones, two)->Wait(kWait).ok());
  EXPECT_EQ(two.ToVector(), std::vector<float>(2, static_cast<float>(size_)));
}

// Element i of rank r's AllGather input, exact in every dtype used (bf16 is set by its bits).
template <typename T>
T GatherValue(int rank, int64_t i) {
  if constexpr (std::is_same_v<T, uint16_t>) return static_cast<T>(0x3f80 + rank * 64 + i % 64);
  return static_cast<T>(1000.0 * (rank + 1) + static_cast<double>(i % 1000));
}

// Gathers a rank-tagged input of n elements (element type T, stored as `dtype`) over the world
// and checks every block, bit for bit.
template <typename T>
void CheckAllGather(Communicator& world, DType dtype, int64_t n) {
  const int rank = world.rank(), size = world.size();
  Tensor in = Tensor::Empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) in.data<T>()[i] = GatherValue<T>(rank, i);
  Tensor out = Tensor::Zeros({size, n}, dtype);
  absl::Status s = world.AllGather(in, out)->Wait(kWait);
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < size; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(out.data<T>()[r * n + i], GatherValue<T>(r, i))
          << DTypeName(dtype) << " n " << n << " block " << r << " element " << i;
    }
  }
}

TEST_F(MpiCommTest, AllGatherConcatenatesInRankOrder) {
  // Ranks arrive staggered, so every rank's messages come in another order.
  SleepMs(10 * ((rank_ * 3) % size_));
  CheckAllGather<float>(*world_, DType::kF32, 1001);
  CheckAllGather<int32_t>(*world_, DType::kI32, 7);
  CheckAllGather<double>(*world_, DType::kF64, 1);
  CheckAllGather<uint16_t>(*world_, DType::kBF16, 129);
  CheckAllGather<float>(*world_, DType::kF32, 0);
  // Large inputs (rendezvous protocol), and through derived datatypes of 1000-byte blocks.
  CheckAllGather<float>(*world_, DType::kF32, int64_t{1} << 20);
  MpiWorldOptions o;
  o.max_block_bytes = 1000;
  Create(o);
  CheckAllGather<float>(*world_, DType::kF32, 300007);
  // Several in flight, mixed with an AllReduce, waited for in reverse order.
  Tensor a = Scalar1(static_cast<float>(rank_)), b = Scalar1(1), c = Scalar1(-2.0f * rank_);
  Tensor ga = Tensor::Zeros({size_}), gc = Tensor::Zeros({size_});
  auto wa = world_->AllGather(a, ga);
  auto wb = world_->AllReduce(b);
  auto wc = world_->AllGather(c, gc);
  for (Work* w : {wc.get(), wb.get(), wa.get()}) ASSERT_TRUE(w->Wait(kWait).ok());
  EXPECT_EQ(b.ToVector()[0], static_cast<float>(size_));
  for (int r = 0; r < size_; ++r) {
    EXPECT_EQ(ga.ToVector()[r], static_cast<float>(r));
    EXPECT_EQ(gc.ToVector()[r], -2.0f * r);
  }
}

TEST_F(MpiCommTest, AllGatherMismatchFailsEveryRank) {
  // Only the last rank's output is too small: it fails at once, every other rank learns it.
  Tensor in = Tensor::Zeros({3});
  Tensor out = Tensor::Zeros({rank_ == size_ - 1 ? 3 * size_ - 1 : 3 * size_});
  absl::Status s = world_->AllGather(in, out)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "AllGather (collective #0)")) << s;
  EXPECT_TRUE(Contains(s, absl::StrCat("must have ", 3 * size_, " elements"))) << s;
  // An output of another dtype, on rank 0 only.
  Tensor typed = Tensor::Zeros({3 * size_}, rank_ == 0 ? DType::kI32 : DType::kF32);
  s = world_->AllGather(in, typed)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "i32")) << s;
  // Inputs that disagree between ranks (each one consistent with its own output).
  const int64_t n = rank_ == 1 ? 5 : 4;
  Tensor mine = Tensor::Zeros({n}), all = Tensor::Zeros({n * size_});
  s = world_->AllGather(mine, all)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s,
                       "AllGather (collective #2): rank 1 passed [5] f32 but rank 0 passed "
                       "[4] f32"))
      << s;
  // AllGather against a Barrier.
  std::unique_ptr<Work> w;
  if (rank_ == 0) {
    w = world_->AllGather(in, out);
  } else {
    w = world_->Barrier();
  }
  s = w->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "called Barrier but rank 0 called AllGather")) << s;
  // The communicator is still in step, and nothing was aborted.
  EXPECT_TRUE(world_->abort_status().ok());
  CheckAllGather<float>(*world_, DType::kF32, 3);
}

TEST_F(MpiCommTest, AbortUnblocksWaitingAllGather) {
  const absl::Status cause = absl::UnavailableError("rank 0 lost its device");
  Tensor in = Scalar1(1), out = Tensor::Zeros({size_});
  if (rank_ == 0) {  // never joins the AllGather: it aborts instead
    SleepMs(200);
    world_->Abort(cause);
  } else {
    auto w = world_->AllGather(in, out);
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = w->Wait(absl::Seconds(30));
    EXPECT_LT(SecondsSince(start), 5.0);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_TRUE(Contains(s, "rank 0 aborted: rank 0 lost its device")) << s;
  }
  const absl::Status got = world_->abort_status();
  EXPECT_EQ(got.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(world_->AllGather(in, out)->Wait(kWait), got);
}

TEST_F(MpiCommTest, Broadcast) {
  for (int root : {size_ - 1, 0}) {
    Tensor t = Tensor::FromVector({3}, {float(rank_), float(-rank_), 7});
    absl::Status s = world_->Broadcast(t, root)->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(t.ToVector(), (std::vector<float>{float(root), float(-root), 7}));
  }
  Tensor t = Scalar1(0);
  absl::Status s = world_->Broadcast(t, size_)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace pipewright::mpi_test
