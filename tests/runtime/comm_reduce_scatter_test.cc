// Communicator::ReduceScatter on the local backend: rank r's chunk is bit for bit elements
// [r * n, (r + 1) * n) of AllReduce's rank-order sum of the same inputs, whatever the arrival
// order; bad or disagreeing arguments fail every rank and still count as a collective.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/tensor.h"
#include "tests/runtime/comm_test_util.h"

namespace pipewright {
namespace {

using comm_test::BitEqual;
using comm_test::CheckF64AndI32ReduceScatter;
using comm_test::ChunkOf;
using comm_test::Comms;
using comm_test::ExpectInvalidArgument;
using comm_test::kWait;
using comm_test::LocalAllReduce;
using comm_test::MixedMagnitudeInputs;
using comm_test::RunRanks;
using comm_test::SequentialSum;

TEST(LocalReduceScatterTest, ChunksAreAllReduceBitForBit) {
  // 1e8 + 1 rounds back to 1e8 in f32, so the order of these four terms decides the result:
  // ((1e8 + 1) + -1e8) + 1 = 1 in rank order, but (1e8 + -1e8) + (1 + 1) = 2 in another.
  {
    Comms comms = CreateLocalWorld(4);
    const std::vector<float> term = {1e8f, 1.0f, -1e8f, 1.0f};
    std::vector<Tensor> outs(4);
    RunRanks(comms, [&](int rank, Communicator& c) {
      const Tensor in = Tensor::FromVector({4}, std::vector<float>(4, term[rank]));
      outs[rank] = Tensor::Zeros({1});
      absl::Status s = c.ReduceScatter(in, outs[rank])->Wait(kWait);
      EXPECT_TRUE(s.ok()) << s;
    });
    for (int r = 0; r < 4; ++r) EXPECT_EQ(outs[r].ToVector()[0], 1.0f) << "rank " << r;
  }
  // Mixed magnitudes, every arrival order (ReduceScatter does not block, so one thread drives
  // every rank and forces the order).
  constexpr int kRanks = 4;
  constexpr int64_t kN = 513;  // per rank
  const std::vector<Tensor> inputs = MixedMagnitudeInputs(kRanks, kRanks * kN, 4321);
  const Tensor reduced = LocalAllReduce(inputs, kWait);
  ASSERT_TRUE(BitEqual(reduced, SequentialSum(inputs)));
  // The check can fail: the reverse order gives other bits somewhere.
  ASSERT_FALSE(BitEqual(SequentialSum({inputs.rbegin(), inputs.rend()}), reduced));
  std::vector<int> order = {0, 1, 2, 3};
  int permutations = 0;
  do {
    Comms comms = CreateLocalWorld(kRanks);
    std::vector<Tensor> outs(kRanks);
    std::vector<std::unique_ptr<Work>> works(kRanks);
    for (int i = 0; i < kRanks; ++i) {
      const int r = order[i];
      outs[r] = Tensor::Zeros({kN});
      works[r] = comms[r]->ReduceScatter(inputs[r], outs[r]);
      EXPECT_EQ(works[r]->Done(), i == kRanks - 1);
    }
    for (int r = 0; r < kRanks; ++r) {
      absl::Status s = works[r]->Wait(kWait);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_TRUE(BitEqual(outs[r], ChunkOf(reduced, r * kN, kN))) << "rank " << r;
    }
    ++permutations;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(permutations, 24);
  // The inputs were only read.
  EXPECT_TRUE(BitEqual(inputs[0], MixedMagnitudeInputs(kRanks, kRanks * kN, 4321)[0]));
}

TEST(LocalReduceScatterTest, F64AndI32MatchAllReduce) {
  Comms comms = CreateLocalWorld(3);
  RunRanks(comms, [](int, Communicator& c) { CheckF64AndI32ReduceScatter(c, kWait); });
}

TEST(LocalReduceScatterTest, OneRankAndEmptyChunks) {
  // A group of one: `out` may be `in` itself, or another tensor; either way it is `in`.
  Comms one = CreateLocalWorld(1);
  Tensor t = Tensor::FromVector({2}, {4, 5}), copy = Tensor::Zeros({1, 2});
  ASSERT_TRUE(one[0]->ReduceScatter(t, t)->Wait(kWait).ok());
  EXPECT_EQ(t.ToVector(), (std::vector<float>{4, 5}));
  ASSERT_TRUE(one[0]->ReduceScatter(t, copy)->Wait(kWait).ok());
  EXPECT_EQ(copy.ToVector(), (std::vector<float>{4, 5}));
  // Empty chunks.
  Comms comms = CreateLocalWorld(2);
  RunRanks(comms, [](int, Communicator& c) {
    Tensor in = Tensor::Zeros({0}), out = Tensor::Zeros({0});
    absl::Status s = c.ReduceScatter(in, out)->Wait(kWait);
    EXPECT_TRUE(s.ok()) << s;
  });
}

// Rank 0, then rank 1, of a two-rank world post ReduceScatter(in_r, out_r); both get the same
// status, which is returned.
absl::Status ReduceScatterOnTwo(Comms& comms, const Tensor& in0, Tensor& out0, const Tensor& in1,
                                Tensor& out1) {
  auto w0 = comms[0]->ReduceScatter(in0, out0);
  const absl::Status s1 = comms[1]->ReduceScatter(in1, out1)->Wait(kWait);
  EXPECT_EQ(w0->Wait(kWait), s1);
  return s1;
}

TEST(LocalReduceScatterTest, BadOrDisagreeingArgumentsFailEveryRank) {
  Comms comms = CreateLocalWorld(2);
  Tensor in0 = Tensor::Zeros({6}), in1 = Tensor::Zeros({6});
  Tensor out0 = Tensor::Zeros({3}), out1 = Tensor::Zeros({3});
  // Rank 0's input is one element short; rank 1's call is right but the collective is poisoned.
  Tensor short_in = Tensor::Zeros({5});
  ExpectInvalidArgument(ReduceScatterOnTwo(comms, short_in, out0, in1, out1),
                        {"rank 0: ReduceScatter (collective #0)",
                         "the input [5] f32 must have 6 elements of f32 (2 ranks x the output "
                         "[3] f32)"});
  // bf16 on both ranks; f16 on rank 1 only (rank 0's valid call fails with rank 1's error).
  Tensor b0 = Tensor::Zeros({4}, DType::kBF16), b1 = Tensor::Zeros({4}, DType::kBF16);
  Tensor ob0 = Tensor::Zeros({2}, DType::kBF16), ob1 = Tensor::Zeros({2}, DType::kBF16);
  ExpectInvalidArgument(ReduceScatterOnTwo(comms, b0, ob0, b1, ob1),
                        {"ReduceScatter supports f32, f64 and i32, got bf16"});
  Tensor h = Tensor::Zeros({6}, DType::kF16), oh = Tensor::Zeros({3}, DType::kF16);
  ExpectInvalidArgument(ReduceScatterOnTwo(comms, in0, out0, h, oh),
                        {"rank 1: ReduceScatter (collective #2)", "got f16"});
  // An output of another dtype; an undefined one.
  Tensor ints = Tensor::Zeros({3}, DType::kI32), undefined;
  ExpectInvalidArgument(ReduceScatterOnTwo(comms, in0, ints, in1, out1), {"[3] i32"});
  ExpectInvalidArgument(ReduceScatterOnTwo(comms, in0, undefined, in1, out1),
                        {"(output): undefined tensor"});
  // Inputs that disagree between ranks (each consistent with its own output), naming both.
  Tensor eight = Tensor::Zeros({8}), four = Tensor::Zeros({4});
  ExpectInvalidArgument(
      ReduceScatterOnTwo(comms, in0, out0, eight, four),
      {"ReduceScatter (collective #5): rank 1 passed [8] f32 but rank 0 passed [6] f32"});
  // A ReduceScatter against an AllGather of the same tensors.
  auto wk = comms[0]->ReduceScatter(in0, out0);
  absl::Status sk = comms[1]->AllGather(out1, in1)->Wait(kWait);
  ExpectInvalidArgument(sk, {"called AllGather but rank 0 called ReduceScatter"});
  EXPECT_EQ(wk->Wait(kWait), sk);
  // The failed collectives still counted: the next one matches, and nothing was aborted.
  Tensor x = Tensor::FromVector({2}, {1, 2}), y = Tensor::FromVector({2}, {3, 4});
  Tensor ox = Tensor::Zeros({1}), oy = Tensor::Zeros({1});
  ASSERT_TRUE(ReduceScatterOnTwo(comms, x, ox, y, oy).ok());
  EXPECT_EQ(ox.ToVector()[0], 4.0f);
  EXPECT_EQ(oy.ToVector()[0], 6.0f);
  EXPECT_TRUE(comms[0]->abort_status().ok());
}

TEST(LocalReduceScatterTest, WaitsForTheLastRankAndEndsOnAbort) {
  Comms comms = CreateLocalWorld(3);
  std::vector<Tensor> in, out;
  for (int r = 0; r < 3; ++r) {
    in.push_back(Tensor::FromVector({3}, {1.0f * r, 10.0f * r, 100.0f * r}));
    out.push_back(Tensor::Zeros({1}));
  }
  auto w0 = comms[0]->ReduceScatter(in[0], out[0]);
  auto w2 = comms[2]->ReduceScatter(in[2], out[2]);
  EXPECT_EQ(w0->Wait(absl::Milliseconds(20)).code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(comms[1]->ReduceScatter(in[1], out[1])->Wait(kWait).ok());
  ASSERT_TRUE(w0->Wait(kWait).ok());
  ASSERT_TRUE(w2->Wait(kWait).ok());
  EXPECT_EQ(out[0].ToVector()[0], 3.0f);
  EXPECT_EQ(out[1].ToVector()[0], 30.0f);
  EXPECT_EQ(out[2].ToVector()[0], 300.0f);
  // An abort ends a pending one, and every later one.
  const absl::Status cause = absl::UnavailableError("rank 1 lost its device");
  auto w = comms[0]->ReduceScatter(in[0], out[0]);
  comms[1]->Abort(cause);
  EXPECT_EQ(w->Wait(kWait), cause);
  EXPECT_EQ(comms[2]->ReduceScatter(in[2], out[2])->Wait(kWait), cause);
}

}  // namespace
}  // namespace pipewright
