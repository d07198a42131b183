#include "pipewright/comm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "pipewright/tensor.h"
#include "tests/runtime/comm_test_util.h"

namespace pipewright {
namespace {

using comm_test::BitEqual;
using comm_test::Comms;
using comm_test::kWait;
using comm_test::MixedMagnitudeInputs;
using comm_test::RunRanks;
using comm_test::Scalar1;
using comm_test::SecondsSince;
using comm_test::SequentialSum;

// What the local backend promises (comm.h): the reference semantics, on host and device tensors.
void ExpectLocalCapabilities(const Communicator& c) {
  EXPECT_EQ(c.kind(), CommBackend::kLocal);
  const CommCapabilities caps = c.capabilities();
  EXPECT_TRUE(caps.tagged_p2p);
  EXPECT_TRUE(caps.eager_send);
  EXPECT_TRUE(caps.host_memory);
  EXPECT_TRUE(caps.device_memory);
  EXPECT_TRUE(caps.stream_ordered);
  EXPECT_FALSE(caps.grouped_p2p);
  EXPECT_TRUE(caps.rank_order_sum);
}

TEST(LocalCommTest, WorldShape) {
  Comms comms = CreateLocalWorld(3);
  ASSERT_EQ(comms.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(comms[r]->rank(), r);
    EXPECT_EQ(comms[r]->size(), 3);
    ExpectLocalCapabilities(*comms[r]);
    EXPECT_TRUE(comms[r]->abort_status().ok());
  }
  EXPECT_TRUE(CreateLocalWorld(0).empty());
}

TEST(CommBackendTest, NamesRoundTrip) {
  for (CommBackend b : {CommBackend::kLocal, CommBackend::kMpi, CommBackend::kNccl}) {
    absl::StatusOr<CommBackend> parsed = ParseCommBackend(CommBackendName(b));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, b);
  }
  EXPECT_STREQ(CommBackendName(CommBackend::kLocal), "local");
  EXPECT_STREQ(CommBackendName(CommBackend::kMpi), "mpi");
  EXPECT_STREQ(CommBackendName(CommBackend::kNccl), "nccl");
  for (const char* bad : {"", "gloo", "NCCL", "auto"}) {
    absl::StatusOr<CommBackend> parsed = ParseCommBackend(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(parsed.status().message().find("local, mpi or nccl"), std::string::npos)
        << parsed.status();
  }
}

TEST(LocalCommTest, SendIsEagerAndCopies) {
  Comms comms = CreateLocalWorld(2);
  Tensor src = Tensor::FromVector({3}, {1, 2, 3});
  auto send = comms[0]->Send(src, 1, 0);
  EXPECT_TRUE(send->Done());  // no receive posted yet
  EXPECT_TRUE(send->Wait(absl::ZeroDuration()).ok());
  src.Fill(-1);  // the sender may reuse its buffer at once
  Tensor dst = Tensor::Zeros({3});
  ASSERT_TRUE(comms[1]->Recv(dst, 0, 0)->Wait(kWait).ok());
  EXPECT_EQ(dst.ToVector(), (std::vector<float>{1, 2, 3}));
}

TEST(LocalCommTest, TagMatchingUnderReordering) {
  Comms comms = CreateLocalWorld(2);
  RunRanks(comms, [](int rank, Communicator& c) {
    if (rank == 0) {
      for (int64_t tag : {3, 1, 2}) {
        Tensor t = Scalar1(10.0f * tag);
        EXPECT_TRUE(c.Send(t, 1, tag)->Wait(kWait).ok());
      }
    } else {
      for (int64_t tag : {1, 2, 3}) {
        Tensor t = Scalar1(0);
        absl::Status s = c.Recv(t, 0, tag)->Wait(kWait);
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_EQ(t.ToVector()[0], 10.0f * tag) << "tag " << tag;
      }
    }
  });
}

TEST(LocalCommTest, RecvPostedBeforeSend) {
  Comms comms = CreateLocalWorld(2);
  Tensor dst = Tensor::Zeros({2});
  auto recv = comms[1]->Recv(dst, 0, 5);
  EXPECT_FALSE(recv->Done());
  Tensor other = Tensor::FromVector({2}, {9, 9});
  EXPECT_TRUE(comms[0]->Send(other, 1, 6)->Wait(kWait).ok());  // other tag: no match
  EXPECT_FALSE(recv->Done());
  Tensor src = Tensor::FromVector({2}, {4, 5});
  EXPECT_TRUE(comms[0]->Send(src, 1, 5)->Wait(kWait).ok());
  EXPECT_TRUE(recv->Done());
  ASSERT_TRUE(recv->Wait(kWait).ok());
  EXPECT_EQ(dst.ToVector(), (std::vector<float>{4, 5}));
}

TEST(LocalCommTest, RecvPostedBeforeSendAcrossThreads) {
  Comms comms = CreateLocalWorld(2);
  RunRanks(comms, [](int rank, Communicator& c) {
    if (rank == 1) {
      Tensor dst = Tensor::Zeros({1});
      auto recv = c.Recv(dst, 0, 0);
      EXPECT_TRUE(c.Barrier()->Wait(kWait).ok());  // rank 0 sends only after this
      ASSERT_TRUE(recv->Wait(kWait).ok());
      EXPECT_EQ(dst.ToVector()[0], 42.0f);
    } else {
      EXPECT_TRUE(c.Barrier()->Wait(kWait).ok());
      Tensor t = Scalar1(42);
      EXPECT_TRUE(c.Send(t, 1, 0)->Wait(kWait).ok());
    }
  });
}

TEST(LocalCommTest, SameTagIsFifo) {
  Comms comms = CreateLocalWorld(2);
  // Both ways: messages queued before the receives, and receives pending before the messages.
  for (int t = 1; t <= 3; ++t) {
    Tensor m = Scalar1(static_cast<float>(t));
    ASSERT_TRUE(comms[0]->Send(m, 1, 7)->Wait(kWait).ok());
  }
  for (int t = 1; t <= 3; ++t) {
    Tensor d = Scalar1(0);
    ASSERT_TRUE(comms[1]->Recv(d, 0, 7)->Wait(kWait).ok());
    EXPECT_EQ(d.ToVector()[0], static_cast<float>(t));
  }
  Tensor d1 = Scalar1(0), d2 = Scalar1(0);
  auto r1 = comms[1]->Recv(d1, 0, 7);
  auto r2 = comms[1]->Recv(d2, 0, 7);
  Tensor a = Scalar1(100), b = Scalar1(200);
  ASSERT_TRUE(comms[0]->Send(a, 1, 7)->Wait(kWait).ok());
  EXPECT_TRUE(r1->Done());
  EXPECT_FALSE(r2->Done());
  ASSERT_TRUE(comms[0]->Send(b, 1, 7)->Wait(kWait).ok());
  ASSERT_TRUE(r1->Wait(kWait).ok());
  ASSERT_TRUE(r2->Wait(kWait).ok());
  EXPECT_EQ(d1.ToVector()[0], 100.0f);
  EXPECT_EQ(d2.ToVector()[0], 200.0f);
}

TEST(LocalCommTest, OtherPeersNeverMatch) {
  Comms comms = CreateLocalWorld(3);
  Tensor from1 = Scalar1(1), from0 = Scalar1(0.5f);
  ASSERT_TRUE(comms[1]->Send(from1, 2, 4)->Wait(kWait).ok());
  Tensor d = Scalar1(0);
  auto recv = comms[2]->Recv(d, 0, 4);
  EXPECT_FALSE(recv->Done());  // rank 1's message has the tag but not the source
  ASSERT_TRUE(comms[0]->Send(from0, 2, 4)->Wait(kWait).ok());
  ASSERT_TRUE(recv->Wait(kWait).ok());
  EXPECT_EQ(d.ToVector()[0], 0.5f);
  Tensor d1 = Scalar1(0);
  ASSERT_TRUE(comms[2]->Recv(d1, 1, 4)->Wait(kWait).ok());
  EXPECT_EQ(d1.ToVector()[0], 1.0f);
}

TEST(LocalCommTest, SizeMismatchIsInvalidArgument) {
  Comms comms = CreateLocalWorld(2);
  Tensor four = Tensor::FromVector({4}, {1, 2, 3, 4});
  ASSERT_TRUE(comms[0]->Send(four, 1, 7)->Wait(kWait).ok());
  Tensor three = Tensor::Zeros({3});
  absl::Status s = comms[1]->Recv(three, 0, 7)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("16 bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("12 bytes"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rank 0"), std::string::npos) << s;
  EXPECT_NE(s.message().find("tag 7"), std::string::npos) << s;

  // Same byte size, other dtype; with the receive pending first.
  Tensor ints = Tensor::Zeros({4}, DType::kI32);
  auto recv = comms[1]->Recv(ints, 0, 8);
  ASSERT_TRUE(comms[0]->Send(four, 1, 8)->Wait(kWait).ok());
  s = recv->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("f32"), std::string::npos) << s;
  EXPECT_NE(s.message().find("i32"), std::string::npos) << s;
}

TEST(LocalCommTest, InvalidPeerOrTag) {
  Comms comms = CreateLocalWorld(2);
  Tensor t = Scalar1(1);
  absl::Status s = comms[0]->Send(t, 2, 0)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("peer 2"), std::string::npos) << s;
  s = comms[1]->Recv(t, -1, 0)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("peer -1"), std::string::npos) << s;
  s = comms[0]->Send(t, 1, -3)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = comms[1]->Recv(t, 0, -3)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  Tensor undefined;
  EXPECT_EQ(comms[0]->Send(undefined, 1, 0)->Wait(kWait).code(),
            absl::StatusCode::kInvalidArgument);
  // Errors do not abort the world.
  EXPECT_TRUE(comms[0]->abort_status().ok());
}

TEST(LocalCommTest, AllReduceIsDeterministicRankOrderSum) {
  constexpr int kRanks = 4, kN = 2048;
  const std::vector<Tensor> inputs = MixedMagnitudeInputs(kRanks, kN, 1234);
  const Tensor expected = SequentialSum(inputs);
  // The check can fail: the reverse order gives other bits somewhere.
  std::vector<Tensor> reversed(inputs.rbegin(), inputs.rend());
  ASSERT_FALSE(BitEqual(SequentialSum(reversed), expected));

  Tensor first_run;
  for (int run = 0; run < 5; ++run) {
    Comms comms = CreateLocalWorld(kRanks);
    std::vector<Tensor> bufs;
    for (const Tensor& t : inputs) bufs.push_back(t.Clone());
    RunRanks(comms, [&](int rank, Communicator& c) {
      absl::Status s = c.AllReduce(bufs[rank])->Wait(kWait);
      EXPECT_TRUE(s.ok()) << s;
    });
    for (int r = 0; r < kRanks; ++r) EXPECT_TRUE(BitEqual(bufs[r], expected)) << "rank " << r;
    if (run == 0) first_run = bufs[0].Clone();
    EXPECT_TRUE(BitEqual(bufs[0], first_run)) << "run " << run;
  }
}

TEST(LocalCommTest, AllReduceResultIndependentOfArrivalOrder) {
  // One thread drives every rank (AllReduce does not block), so each arrival order is forced.
  constexpr int kRanks = 4, kN = 512;
  const std::vector<Tensor> inputs = MixedMagnitudeInputs(kRanks, kN, 99);
  const Tensor expected = SequentialSum(inputs);
  std::vector<int> order = {0, 1, 2, 3};
  int permutations = 0;
  do {
    Comms comms = CreateLocalWorld(kRanks);
    std::vector<Tensor> bufs;
    for (const Tensor& t : inputs) bufs.push_back(t.Clone());
    std::vector<std::unique_ptr<Work>> works(kRanks);
    for (int i = 0; i < kRanks; ++i) {
      works[order[i]] = comms[order[i]]->AllReduce(bufs[order[i]]);
      EXPECT_EQ(works[order[i]]->Done(), i == kRanks - 1);
    }
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(works[r]->Wait(kWait).ok());
      EXPECT_TRUE(BitEqual(bufs[r], expected)) << "rank " << r;
    }
    ++permutations;
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(permutations, 24);
}

TEST(LocalCommTest, AllReduceF64AndI32) {
  Comms comms = CreateLocalWorld(3);
  std::vector<Tensor> f64, i32;
  for (int r = 0; r < 3; ++r) {
    Tensor d = Tensor::Empty({2}, DType::kF64);
    d.data<double>()[0] = 0.1 * (r + 1);
    d.data<double>()[1] = 1e300 * (r == 1 ? -1 : 1);
    f64.push_back(d);
    i32.push_back(Tensor::FromVectorI32({3}, {r, -10 * r, 2147483647}));
  }
  RunRanks(comms, [&](int rank, Communicator& c) {
    EXPECT_TRUE(c.AllReduce(f64[rank])->Wait(kWait).ok());
    EXPECT_TRUE(c.AllReduce(i32[rank])->Wait(kWait).ok());
  });
  const double e0 = (0.1 * 1 + 0.1 * 2) + 0.1 * 3;
  const double e1 = (1e300 + -1e300) + 1e300;
  // 3 * INT32_MAX wraps around.
  const int32_t wrapped = static_cast<int32_t>(3u * 2147483647u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(f64[r].data<double>()[0], e0);
    EXPECT_EQ(f64[r].data<double>()[1], e1);
    EXPECT_EQ(i32[r].data<int32_t>()[0], 3);
    EXPECT_EQ(i32[r].data<int32_t>()[1], -30);
    EXPECT_EQ(i32[r].data<int32_t>()[2], wrapped);
  }
}

TEST(LocalCommTest, AllReduceRejectsOtherDtypesForEveryRank) {
  Comms comms = CreateLocalWorld(2);
  Tensor a = Tensor::Zeros({4}, DType::kBF16), b = Tensor::Zeros({4}, DType::kBF16);
  auto w0 = comms[0]->AllReduce(a);
  EXPECT_EQ(w0->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  absl::Status s1 = comms[1]->AllReduce(b)->Wait(kWait);
  EXPECT_EQ(s1.code(), absl::StatusCode::kInvalidArgument) << s1;
  EXPECT_NE(s1.message().find("bf16"), std::string::npos) << s1;
  // The failed collective still counted: the next ones match.
  Tensor x = Scalar1(1), y = Scalar1(2);
  auto wx = comms[0]->AllReduce(x);
  ASSERT_TRUE(comms[1]->AllReduce(y)->Wait(kWait).ok());
  ASSERT_TRUE(wx->Wait(kWait).ok());
  EXPECT_EQ(x.ToVector()[0], 3.0f);
}

TEST(LocalCommTest, AllReduceMismatchFailsEveryParticipant) {
  Comms comms = CreateLocalWorld(3);
  Tensor a = Tensor::Zeros({4}), b = Tensor::Zeros({5}), c = Tensor::Zeros({4});
  auto w0 = comms[0]->AllReduce(a);
  auto w1 = comms[1]->AllReduce(b);
  EXPECT_EQ(w0->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);  // failed promptly
  absl::Status s1 = w1->Wait(kWait);
  EXPECT_EQ(s1.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s1.message().find("[5] f32"), std::string::npos) << s1;
  EXPECT_EQ(comms[2]->AllReduce(c)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  // Mismatched kinds too.
  Tensor d = Scalar1(0);
  auto w2 = comms[0]->AllReduce(d);
  absl::Status s = comms[1]->Barrier()->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("Barrier"), std::string::npos) << s;
  EXPECT_NE(s.message().find("AllReduce"), std::string::npos) << s;
  EXPECT_EQ(w2->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LocalCommTest, CollectivesMatchByCallOrder) {
  Comms comms = CreateLocalWorld(2);
  Tensor a0 = Scalar1(1), b0 = Scalar1(10), a1 = Scalar1(2), b1 = Scalar1(20);
  auto wa0 = comms[0]->AllReduce(a0);
  auto wb0 = comms[0]->AllReduce(b0);
  EXPECT_FALSE(wa0->Done());
  auto wa1 = comms[1]->AllReduce(a1);
  EXPECT_TRUE(wa0->Done());
  EXPECT_FALSE(wb0->Done());
  auto wb1 = comms[1]->AllReduce(b1);
  for (Work* w : {wa0.get(), wb0.get(), wa1.get(), wb1.get()}) ASSERT_TRUE(w->Wait(kWait).ok());
  EXPECT_EQ(a0.ToVector()[0], 3.0f);
  EXPECT_EQ(a1.ToVector()[0], 3.0f);
  EXPECT_EQ(b0.ToVector()[0], 30.0f);
  EXPECT_EQ(b1.ToVector()[0], 30.0f);
}

// Rank r's element i of an AllGather input: exact in every dtype used here.
double GatherValue(int rank, int64_t i) { return 1000.0 * (rank + 1) + static_cast<double>(i); }

template <typename T>
Tensor GatherInput(DType dtype, int rank, int64_t n) {
  Tensor t = Tensor::Empty({n}, dtype);
  for (int64_t i = 0; i < n; ++i) t.data<T>()[i] = static_cast<T>(GatherValue(rank, i));
  return t;
}

// Every rank's output holds rank 0's input, then rank 1's, ... exactly.
template <typename T>
void ExpectGathered(const Tensor& out, int ranks, int64_t n) {
  ASSERT_EQ(out.numel(), ranks * n);
  for (int r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(out.data<T>()[r * n + i], static_cast<T>(GatherValue(r, i)))
          << "block " << r << " element " << i;
    }
  }
}

TEST(LocalCommTest, AllGatherConcatenatesInRankOrder) {
  constexpr int kRanks = 4;
  constexpr int64_t kN = 37;
  Comms comms = CreateLocalWorld(kRanks);
  std::vector<Tensor> f32_out(kRanks), i32_out(kRanks), f64_out(kRanks);
  RunRanks(comms, [&](int rank, Communicator& c) {
    // Ranks arrive in a scrambled order.
    std::this_thread::sleep_for(std::chrono::milliseconds(3 * ((rank * 7) % kRanks)));
    const Tensor f32 = GatherInput<float>(DType::kF32, rank, kN);
    const Tensor i32 = GatherInput<int32_t>(DType::kI32, rank, kN);
    const Tensor f64 = GatherInput<double>(DType::kF64, rank, kN);
    // Output shapes are free: only the element count matters.
    f32_out[rank] = Tensor::Zeros({kRanks, kN}, DType::kF32);
    i32_out[rank] = Tensor::Zeros({kRanks * kN}, DType::kI32);
    f64_out[rank] = Tensor::Zeros({kN, kRanks}, DType::kF64);
    // Several in flight at once, waited for out of call order.
    auto w1 = c.AllGather(f32, f32_out[rank]);
    auto w2 = c.AllGather(i32, i32_out[rank]);
    auto w3 = c.AllGather(f64, f64_out[rank]);
    for (Work* w : {w3.get(), w1.get(), w2.get()}) {
      absl::Status s = w->Wait(kWait);
      EXPECT_TRUE(s.ok()) << s;
    }
  });
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(r);
    ExpectGathered<float>(f32_out[r], kRanks, kN);
    ExpectGathered<int32_t>(i32_out[r], kRanks, kN);
    ExpectGathered<double>(f64_out[r], kRanks, kN);
  }
}

TEST(LocalCommTest, AllGatherHalfPrecisionAndEdgeSizes) {
  // bf16/f16 move as bytes; a size-1 world may gather in place; empty inputs are fine.
  Comms comms = CreateLocalWorld(2);
  std::vector<Tensor> bf16_out(2), empty_out(2);
  RunRanks(comms, [&](int rank, Communicator& c) {
    Tensor in = Tensor::Empty({3}, DType::kBF16);
    for (int i = 0; i < 3; ++i)
      in.data<uint16_t>()[i] = static_cast<uint16_t>(0x3f80 + rank * 16 + i);
    bf16_out[rank] = Tensor::Zeros({6}, DType::kBF16);
    EXPECT_TRUE(c.AllGather(in, bf16_out[rank])->Wait(kWait).ok());
    Tensor empty_in = Tensor::Zeros({0}, DType::kF16);
    empty_out[rank] = Tensor::Zeros({0}, DType::kF16);
    EXPECT_TRUE(c.AllGather(empty_in, empty_out[rank])->Wait(kWait).ok());
  });
  for (int r = 0; r < 2; ++r) {
    for (int b = 0; b < 2; ++b) {
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(bf16_out[r].data<uint16_t>()[b * 3 + i], 0x3f80 + b * 16 + i);
      }
    }
  }
  Comms one = CreateLocalWorld(1);
  Tensor t = Tensor::FromVector({2}, {4, 5});
  ASSERT_TRUE(one[0]->AllGather(t, t)->Wait(kWait).ok());
  EXPECT_EQ(t.ToVector(), (std::vector<float>{4, 5}));
}

TEST(LocalCommTest, AllGatherOutputMismatchIsInvalidArgumentForEveryRank) {
  Comms comms = CreateLocalWorld(2);
  Tensor in0 = Tensor::Zeros({3}), in1 = Tensor::Zeros({3});
  // Rank 0's output is one element short; rank 1's is right but the collective is poisoned.
  Tensor short_out = Tensor::Zeros({5}), out1 = Tensor::Zeros({6});
  auto w0 = comms[0]->AllGather(in0, short_out);
  absl::Status s0 = w0->Wait(kWait);
  EXPECT_EQ(s0.code(), absl::StatusCode::kInvalidArgument) << s0;
  EXPECT_NE(s0.message().find("AllGather"), std::string::npos) << s0;
  EXPECT_NE(s0.message().find("[5] f32"), std::string::npos) << s0;
  EXPECT_NE(s0.message().find("6 elements"), std::string::npos) << s0;
  absl::Status s1 = comms[1]->AllGather(in1, out1)->Wait(kWait);
  EXPECT_EQ(s1, s0);
  // Other dtype for the output.
  Tensor ints = Tensor::Zeros({6}, DType::kI32), out = Tensor::Zeros({6});
  auto wd = comms[0]->AllGather(in0, ints);
  absl::Status sd = comms[1]->AllGather(in1, out)->Wait(kWait);
  EXPECT_EQ(sd.code(), absl::StatusCode::kInvalidArgument) << sd;
  EXPECT_NE(sd.message().find("i32"), std::string::npos) << sd;
  EXPECT_EQ(wd->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  // An undefined tensor.
  Tensor undefined;
  auto wu = comms[0]->AllGather(undefined, out);
  EXPECT_EQ(comms[1]->AllGather(in1, out1)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(wu->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  // Inputs that disagree between ranks fail every participant, naming both.
  Tensor four = Tensor::Zeros({4}), eight = Tensor::Zeros({8});
  auto wa = comms[0]->AllGather(in0, out);
  absl::Status sa = comms[1]->AllGather(four, eight)->Wait(kWait);
  EXPECT_EQ(sa.code(), absl::StatusCode::kInvalidArgument) << sa;
  EXPECT_NE(sa.message().find("AllGather (collective #"), std::string::npos) << sa;
  EXPECT_NE(sa.message().find("[4] f32"), std::string::npos) << sa;
  EXPECT_NE(sa.message().find("[3] f32"), std::string::npos) << sa;
  EXPECT_EQ(wa->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  // An AllGather against an AllReduce.
  auto wk = comms[0]->AllGather(in0, out);
  absl::Status sk = comms[1]->AllReduce(in1)->Wait(kWait);
  EXPECT_EQ(sk.code(), absl::StatusCode::kInvalidArgument) << sk;
  EXPECT_NE(sk.message().find("called AllReduce but rank 0 called AllGather"), std::string::npos)
      << sk;
  EXPECT_EQ(wk->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  // The failed collectives still counted: the next one matches, and nothing was aborted.
  Tensor x = Scalar1(1), y = Scalar1(2), gx = Tensor::Zeros({2}), gy = Tensor::Zeros({2});
  auto wx = comms[0]->AllGather(x, gx);
  ASSERT_TRUE(comms[1]->AllGather(y, gy)->Wait(kWait).ok());
  ASSERT_TRUE(wx->Wait(kWait).ok());
  EXPECT_EQ(gx.ToVector(), (std::vector<float>{1, 2}));
  EXPECT_EQ(gy.ToVector(), (std::vector<float>{1, 2}));
  EXPECT_TRUE(comms[0]->abort_status().ok());
}

TEST(LocalCommTest, AllGatherTimesOutNamingMissingRanks) {
  Comms comms = CreateLocalWorld(3);
  Tensor in0 = Scalar1(0), in2 = Scalar1(2), out0 = Tensor::Zeros({3}), out2 = Tensor::Zeros({3});
  auto w0 = comms[0]->AllGather(in0, out0);
  auto w2 = comms[2]->AllGather(in2, out2);
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = w0->Wait(absl::Milliseconds(30));
  EXPECT_LT(SecondsSince(start), 1.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("rank 0: AllGather (collective #0) timed out after 0.03s"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("waiting for ranks 1"), std::string::npos) << s;
  EXPECT_TRUE(comms[0]->abort_status().ok());
  // The late rank completes it; waiting again works.
  Tensor in1 = Scalar1(1), out1 = Tensor::Zeros({3});
  ASSERT_TRUE(comms[1]->AllGather(in1, out1)->Wait(kWait).ok());
  ASSERT_TRUE(w0->Wait(kWait).ok());
  ASSERT_TRUE(w2->Wait(kWait).ok());
  for (const Tensor* out : {&out0, &out1, &out2}) {
    EXPECT_EQ(out->ToVector(), (std::vector<float>{0, 1, 2}));
  }
}

TEST(LocalCommTest, AbortUnblocksWaitingAllGather) {
  Comms comms = CreateLocalWorld(3);
  const absl::Status cause = absl::UnavailableError("rank 2 lost its device");
  std::vector<absl::Status> got(2);
  std::vector<double> waited(2, -1);
  std::vector<std::thread> waiters;
  for (int r = 0; r < 2; ++r) {
    waiters.emplace_back([&, r] {
      Tensor in = Scalar1(static_cast<float>(r)), out = Tensor::Zeros({3});
      auto w = comms[r]->AllGather(in, out);
      const auto start = std::chrono::steady_clock::now();
      got[r] = w->Wait(absl::Seconds(30));
      waited[r] = SecondsSince(start);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  comms[2]->Abort(cause);  // instead of joining the AllGather
  for (std::thread& t : waiters) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r], cause) << r;
    EXPECT_LT(waited[r], 3.0) << r;
  }
  Tensor in = Scalar1(0), out = Tensor::Zeros({3});
  EXPECT_EQ(comms[2]->AllGather(in, out)->Wait(kWait), cause);
}

TEST(LocalCommTest, Broadcast) {
  Comms comms = CreateLocalWorld(3);
  std::vector<Tensor> bufs;
  for (int r = 0; r < 3; ++r) bufs.push_back(Tensor::FromVector({2}, {float(r), float(-r)}));
  RunRanks(comms, [&](int rank, Communicator& c) {
    absl::Status s = c.Broadcast(bufs[rank], 2)->Wait(kWait);
    EXPECT_TRUE(s.ok()) << s;
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(bufs[r].ToVector(), (std::vector<float>{2, -2}));
  Tensor t = Scalar1(0);
  EXPECT_EQ(comms[0]->Broadcast(t, 3)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LocalCommTest, Barrier) {
  Comms comms = CreateLocalWorld(2);
  auto w1 = comms[1]->Barrier();
  EXPECT_FALSE(w1->Done());
  EXPECT_EQ(w1->Wait(absl::Milliseconds(10)).code(), absl::StatusCode::kDeadlineExceeded);
  auto w0 = comms[0]->Barrier();
  EXPECT_TRUE(w0->Done());
  EXPECT_TRUE(w1->Wait(kWait).ok());

  Comms four = CreateLocalWorld(4);
  std::atomic<int> arrived{0};
  RunRanks(four, [&](int rank, Communicator& c) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5 * rank));
    arrived.fetch_add(1);
    EXPECT_TRUE(c.Barrier()->Wait(kWait).ok());
    EXPECT_EQ(arrived.load(), 4);
  });
}

TEST(LocalCommTest, SplitEvenOddThenAllReduce) {
  Comms comms = CreateLocalWorld(4);
  RunRanks(comms, [](int rank, Communicator& c) {
    // key = -rank: the new ranks are in reverse parent order.
    auto sub = c.Split(rank % 2, -rank, kWait);
    ASSERT_TRUE(sub.ok()) << sub.status();
    ASSERT_NE(*sub, nullptr);
    Communicator& g = **sub;
    EXPECT_EQ(g.size(), 2);
    EXPECT_EQ(g.rank(), rank < 2 ? 1 : 0);
    ExpectLocalCapabilities(g);
    Tensor t = Scalar1(static_cast<float>(rank + 1));
    absl::Status s = g.AllReduce(t)->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(t.ToVector()[0], rank % 2 == 0 ? 1.0f + 3.0f : 2.0f + 4.0f);
    // AllGather in the split is in its rank order: new rank 0 is the larger parent rank.
    Tensor mine = Scalar1(static_cast<float>(rank)), all = Tensor::Zeros({2});
    ASSERT_TRUE(g.AllGather(mine, all)->Wait(kWait).ok());
    EXPECT_EQ(all.ToVector(),
              rank % 2 == 0 ? (std::vector<float>{2, 0}) : (std::vector<float>{3, 1}));
    // P2P in the split uses its ranks: new rank 0 sends to new rank 1.
    Tensor m = Scalar1(static_cast<float>(rank));
    if (g.rank() == 0) {
      EXPECT_TRUE(g.Send(m, 1, 0)->Wait(kWait).ok());
    } else {
      ASSERT_TRUE(g.Recv(m, 0, 0)->Wait(kWait).ok());
      EXPECT_EQ(m.ToVector()[0], static_cast<float>(rank + 2));
    }
    // The parent still works after the split.
    Tensor p = Scalar1(1);
    EXPECT_TRUE(c.AllReduce(p)->Wait(kWait).ok());
    EXPECT_EQ(p.ToVector()[0], 4.0f);
  });
}

TEST(LocalCommTest, SplitNegativeColorGetsNull) {
  Comms comms = CreateLocalWorld(3);
  RunRanks(comms, [](int rank, Communicator& c) {
    auto sub = c.Split(rank == 1 ? -1 : 0, 0, kWait);
    ASSERT_TRUE(sub.ok()) << sub.status();
    if (rank == 1) {
      EXPECT_EQ(*sub, nullptr);
      return;
    }
    ASSERT_NE(*sub, nullptr);
    EXPECT_EQ((*sub)->size(), 2);
    EXPECT_EQ((*sub)->rank(), rank == 0 ? 0 : 1);
    EXPECT_TRUE((*sub)->Barrier()->Wait(kWait).ok());
  });
}

TEST(LocalCommTest, SplitTimesOut) {
  Comms comms = CreateLocalWorld(2);
  const auto start = std::chrono::steady_clock::now();
  auto sub = comms[0]->Split(0, 0, absl::Milliseconds(50));
  EXPECT_EQ(sub.status().code(), absl::StatusCode::kDeadlineExceeded) << sub.status();
  EXPECT_NE(sub.status().message().find("Split"), std::string::npos) << sub.status();
  EXPECT_LT(SecondsSince(start), 1.0);
  EXPECT_TRUE(comms[0]->abort_status().ok());
}

TEST(LocalCommTest, RecvTimeoutNamesPeerAndTagAndDoesNotAbort) {
  Comms comms = CreateLocalWorld(2);
  Tensor t = Scalar1(0);
  auto recv = comms[1]->Recv(t, 0, 17);
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = recv->Wait(absl::Milliseconds(50));
  EXPECT_LT(SecondsSince(start), 1.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s;
  EXPECT_NE(s.message().find("Recv from rank 0"), std::string::npos) << s;
  EXPECT_NE(s.message().find("tag 17"), std::string::npos) << s;
  EXPECT_NE(s.message().find("0.05s"), std::string::npos) << s;
  EXPECT_TRUE(comms[0]->abort_status().ok());
  EXPECT_TRUE(comms[1]->abort_status().ok());
  // Waiting again after the timeout works once the message comes.
  Tensor m = Scalar1(8);
  ASSERT_TRUE(comms[0]->Send(m, 1, 17)->Wait(kWait).ok());
  EXPECT_TRUE(recv->Wait(kWait).ok());
  EXPECT_EQ(t.ToVector()[0], 8.0f);
}

TEST(LocalCommTest, CollectiveTimeoutNamesMissingRanks) {
  Comms comms = CreateLocalWorld(3);
  Tensor t = Scalar1(0), u = Scalar1(0);
  auto w0 = comms[0]->AllReduce(t);
  auto w2 = comms[2]->AllReduce(u);
  absl::Status s = w0->Wait(absl::Milliseconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("AllReduce"), std::string::npos) << s;
  EXPECT_NE(s.message().find("waiting for ranks 1"), std::string::npos) << s;
}

TEST(LocalCommTest, AbortWakesBlockedWaiter) {
  Comms comms = CreateLocalWorld(2);
  const absl::Status cause = absl::UnavailableError("rank 0 lost its device");
  absl::Status got;
  double waited = -1;
  std::thread waiter([&] {
    Tensor t = Scalar1(0);
    auto recv = comms[1]->Recv(t, 0, 3);
    const auto start = std::chrono::steady_clock::now();
    got = recv->Wait(absl::Seconds(30));
    waited = SecondsSince(start);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  comms[0]->Abort(cause);
  comms[1]->Abort(absl::InternalError("second abort loses"));
  waiter.join();
  EXPECT_EQ(got, cause);
  EXPECT_LT(waited, 3.0);
  EXPECT_EQ(comms[0]->abort_status(), cause);
  EXPECT_EQ(comms[1]->abort_status(), cause);
  // Future operations fail with it too.
  Tensor t = Scalar1(1);
  EXPECT_EQ(comms[0]->Send(t, 1, 0)->Wait(kWait), cause);
  EXPECT_EQ(comms[1]->Barrier()->Wait(kWait), cause);
  auto sub = comms[0]->Split(0, 0, kWait);
  EXPECT_EQ(sub.status(), cause);
}

TEST(LocalCommTest, AbortWithOkIsAborted) {
  Comms comms = CreateLocalWorld(2);
  auto barrier = comms[0]->Barrier();
  comms[1]->Abort(absl::OkStatus());
  EXPECT_TRUE(barrier->Done());
  absl::Status s = barrier->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_EQ(comms[0]->abort_status().code(), absl::StatusCode::kAborted);
}

TEST(LocalCommTest, AbortReachesSplitCommunicators) {
  Comms comms = CreateLocalWorld(4);
  std::vector<std::unique_ptr<Communicator>> subs(4);
  RunRanks(comms, [&](int rank, Communicator& c) {
    auto sub = c.Split(rank % 2, rank, kWait);
    ASSERT_TRUE(sub.ok()) << sub.status();
    subs[rank] = *std::move(sub);
  });
  for (const auto& s : subs) ASSERT_NE(s, nullptr);
  const absl::Status cause = absl::InternalError("stage 3 diverged");
  // Rank 1 blocks in an AllReduce of its split group (rank 3 never joins); an abort of a split
  // communicator of the other group wakes it and reaches the world.
  absl::Status got;
  double waited = -1;
  std::thread waiter([&] {
    Tensor t = Scalar1(1);
    auto w = subs[1]->AllReduce(t);
    const auto start = std::chrono::steady_clock::now();
    got = w->Wait(absl::Seconds(30));
    waited = SecondsSince(start);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  subs[2]->Abort(cause);
  waiter.join();
  EXPECT_EQ(got, cause);
  EXPECT_LT(waited, 3.0);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(comms[r]->abort_status(), cause) << r;
    EXPECT_EQ(subs[r]->abort_status(), cause) << r;
  }
  Tensor t = Scalar1(0);
  EXPECT_EQ(subs[0]->Recv(t, 1, 0)->Wait(kWait), cause);
  EXPECT_EQ(comms[3]->Barrier()->Wait(kWait), cause);
}

}  // namespace
}  // namespace pipewright
