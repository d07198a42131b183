#include "pipewright/comm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
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
#include "absl/time/time.h"
#include "pipewright/tensor.h"

namespace pipewright {
namespace {

using Comms = std::vector<std::unique_ptr<Communicator>>;

constexpr absl::Duration kWait = absl::Seconds(5);

// Runs fn(rank, comm) on one thread per communicator and joins them.
void RunRanks(Comms& comms, const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < static_cast<int>(comms.size()); ++r) {
    threads.emplace_back([&, r] { fn(r, *comms[r]); });
  }
  for (std::thread& t : threads) t.join();
}

Tensor Scalar1(float v) { return Tensor::FromVector({1}, {v}); }

bool BitEqual(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

TEST(LocalCommTest, WorldShape) {
  Comms comms = CreateLocalWorld(3);
  ASSERT_EQ(comms.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(comms[r]->rank(), r);
    EXPECT_EQ(comms[r]->size(), 3);
    EXPECT_EQ(comms[r]->backend(), "local");
    EXPECT_TRUE(comms[r]->abort_status().ok());
  }
  EXPECT_TRUE(CreateLocalWorld(0).empty());
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

// Values over many orders of magnitude, both signs: float sums depend on their order.
std::vector<Tensor> MixedMagnitudeInputs(int ranks, int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-10, 10);
  std::vector<Tensor> inputs;
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> v(n);
    for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng) * 2);
    inputs.push_back(Tensor::FromVector({n}, v));
  }
  return inputs;
}

Tensor SequentialSum(const std::vector<Tensor>& inputs) {
  const int64_t n = inputs[0].numel();
  Tensor out = Tensor::Empty({n});
  for (int64_t i = 0; i < n; ++i) {
    float acc = inputs[0].data<float>()[i];
    for (size_t r = 1; r < inputs.size(); ++r) acc = acc + inputs[r].data<float>()[i];
    out.data<float>()[i] = acc;
  }
  return out;
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
    EXPECT_EQ(g.backend(), "local");
    Tensor t = Scalar1(static_cast<float>(rank + 1));
    absl::Status s = g.AllReduce(t)->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(t.ToVector()[0], rank % 2 == 0 ? 1.0f + 3.0f : 2.0f + 4.0f);
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
