// Tests of the MPI backend (runtime/comm/mpi.h): point-to-point messages, timeouts, splits,
// aborts, and the harness (the collectives' data paths are in mpi_collectives_test.cc, linked
// into the same executable). Run under a launcher:
//   mpirun --allow-run-as-root --oversubscribe -np 4 build/tests/mpi_comm_test
// Every process runs every test on its own rank of a fresh world (a failure in one test cannot
// shift another's messages); only rank 0 prints gtest's report, other ranks print their failures
// only. At the end the ranks agree on the result, so every process exits non-zero when any rank
// failed. Without a launcher every test skips.
#include <gtest/gtest.h>
// The C API only (Open MPI and MPICH would otherwise pull in their C++ bindings).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/tensor.h"
#include "runtime/comm/mpi.h"
#include "tests/runtime/mpi_test_util.h"

namespace pipewright::mpi_test {
namespace {

TEST_F(MpiCommTest, WorldShape) {
  EXPECT_EQ(world_->rank(), g_process.rank);
  EXPECT_EQ(world_->size(), g_process.size);
  EXPECT_EQ(world_->kind(), CommBackend::kMpi);
  const CommCapabilities caps = world_->capabilities();
  EXPECT_TRUE(caps.tagged_p2p);
  EXPECT_TRUE(caps.eager_send);
  EXPECT_TRUE(caps.host_memory);
  EXPECT_FALSE(caps.device_memory);
  EXPECT_FALSE(caps.stream_ordered);
  EXPECT_FALSE(caps.grouped_p2p);
  EXPECT_TRUE(caps.rank_order_sum);
  EXPECT_TRUE(world_->abort_status().ok());
  EXPECT_TRUE(LaunchedByMpi());
  absl::StatusOr<MpiProcess> again = InitMpi();  // idempotent
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->rank, g_process.rank);
  EXPECT_EQ(again->size, g_process.size);
  EXPECT_GE(g_process.local_rank, 0);
  EXPECT_LT(g_process.local_rank, g_process.local_size);
  EXPECT_LE(g_process.local_size, g_process.size);
  EXPECT_FALSE(g_process.hostname.empty());
}

TEST_F(MpiCommTest, SendIsEagerAndCopies) {
  // Rank 0's send completes while rank 1 is still in the barrier, before its receive exists.
  if (rank_ == 0) {
    Tensor src = Tensor::FromVector({3}, {1, 2, 3});
    auto send = world_->Send(src, 1, 0);
    EXPECT_TRUE(send->Done());
    EXPECT_TRUE(send->Wait(absl::ZeroDuration()).ok());
    src.Fill(-1);  // the sender may reuse its buffer at once
  }
  Sync();
  if (rank_ == 1) {
    Tensor dst = Tensor::Zeros({3});
    absl::Status s = world_->Recv(dst, 0, 0)->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(dst.ToVector(), (std::vector<float>{1, 2, 3}));
  }
}

// Tags of both kinds: direct MPI tags and tags past MPI_TAG_UB (matched by the header).
const std::vector<int64_t> kTags = {
    3, 1, 2, int64_t{1} << 40, (int64_t{1} << 40) + 5, 0, INT64_MAX, int64_t{1} << 31};

float TagValue(int64_t tag, int from) {
  return static_cast<float>(static_cast<double>(tag % 1000003) + 0.25 * from);
}

TEST_F(MpiCommTest, TagsMatchRegardlessOfArrivalOrder) {
  // A ring: every rank sends to the next and receives from the previous, in another tag order.
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  for (int64_t tag : kTags) {
    Tensor t = Scalar1(TagValue(tag, rank_));
    absl::Status s = world_->Send(t, next, tag)->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
  }
  Sync();  // every message has been sent (and some have surely arrived) before any receive
  std::vector<int64_t> order(kTags.rbegin(), kTags.rend());
  for (int64_t tag : order) {
    Tensor t = Scalar1(-1);
    absl::Status s = world_->Recv(t, prev, tag)->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(t.ToVector()[0], TagValue(tag, prev)) << "tag " << tag;
  }
}

TEST_F(MpiCommTest, ReceivesPostedBeforeSendsInOtherOrder) {
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  std::vector<Tensor> bufs;
  std::vector<std::unique_ptr<Work>> recvs;
  for (int64_t tag : kTags) {
    bufs.push_back(Scalar1(-1));
    recvs.push_back(world_->Recv(bufs.back(), prev, tag));
  }
  Sync();
  for (auto it = kTags.rbegin(); it != kTags.rend(); ++it) {
    Tensor t = Scalar1(TagValue(*it, rank_));
    ASSERT_TRUE(world_->Send(t, next, *it)->Wait(kWait).ok());
  }
  for (size_t i = 0; i < kTags.size(); ++i) {
    absl::Status s = recvs[i]->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(bufs[i].ToVector()[0], TagValue(kTags[i], prev)) << "tag " << kTags[i];
  }
}

TEST_F(MpiCommTest, OtherTagsDoNotMatchAPendingReceive) {
  for (int64_t base : {int64_t{5}, int64_t{1} << 50}) {
    if (rank_ == 1) {
      Tensor dst = Scalar1(0);
      auto recv = world_->Recv(dst, 0, base);
      Sync();  // rank 0 sent tag base + 1 before this
      SleepMs(50);
      EXPECT_FALSE(recv->Done());  // the other tag's message has surely arrived by now
      Tensor other = Scalar1(0);
      ASSERT_TRUE(world_->Recv(other, 0, base + 1)->Wait(kWait).ok());
      EXPECT_EQ(other.ToVector()[0], 9.0f);
      EXPECT_FALSE(recv->Done());
      Sync();
      absl::Status s = recv->Wait(kWait);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(dst.ToVector()[0], 4.0f);
    } else {
      if (rank_ == 0) {
        Tensor other = Scalar1(9);
        ASSERT_TRUE(world_->Send(other, 1, base + 1)->Wait(kWait).ok());
      }
      Sync();
      Sync();
      if (rank_ == 0) {
        Tensor src = Scalar1(4);
        ASSERT_TRUE(world_->Send(src, 1, base)->Wait(kWait).ok());
      }
    }
  }
}

TEST_F(MpiCommTest, SameTagIsFifo) {
  for (int64_t tag : {int64_t{7}, int64_t{1} << 45}) {
    // Messages queued before the receives.
    if (rank_ == 0) {
      for (int i = 1; i <= 4; ++i) {
        Tensor m = Scalar1(static_cast<float>(i));
        ASSERT_TRUE(world_->Send(m, 1, tag)->Wait(kWait).ok());
      }
    }
    Sync();
    if (rank_ == 1) {
      for (int i = 1; i <= 4; ++i) {
        Tensor d = Scalar1(0);
        ASSERT_TRUE(world_->Recv(d, 0, tag)->Wait(kWait).ok());
        EXPECT_EQ(d.ToVector()[0], static_cast<float>(i)) << "tag " << tag;
      }
    }
    // Receives pending before the messages; waited for in reverse order.
    std::vector<Tensor> d;
    std::vector<std::unique_ptr<Work>> r;
    if (rank_ == 1) {
      for (int i = 0; i < 3; ++i) {
        d.push_back(Scalar1(0));
        r.push_back(world_->Recv(d.back(), 0, tag));
      }
    }
    Sync();
    if (rank_ == 0) {
      for (int i = 0; i < 3; ++i) {
        Tensor m = Scalar1(100.0f * (i + 1));
        ASSERT_TRUE(world_->Send(m, 1, tag)->Wait(kWait).ok());
      }
    }
    if (rank_ == 1) {
      for (int i = 2; i >= 0; --i) {
        ASSERT_TRUE(r[i]->Wait(kWait).ok());
        EXPECT_EQ(d[i].ToVector()[0], 100.0f * (i + 1)) << "tag " << tag;
      }
    }
    Sync();
  }
}

TEST_F(MpiCommTest, OtherPeersNeverMatch) {
  if (size_ < 3) GTEST_SKIP() << "needs 3 ranks";
  // Rank 1's message to rank 2 has the tag but not the source of rank 2's receive.
  if (rank_ == 1) {
    Tensor t = Scalar1(1);
    ASSERT_TRUE(world_->Send(t, 2, 4)->Wait(kWait).ok());
  }
  Tensor d = Scalar1(0);
  std::unique_ptr<Work> recv;
  if (rank_ == 2) recv = world_->Recv(d, 0, 4);
  Sync();
  if (rank_ == 2) {
    SleepMs(50);
    EXPECT_FALSE(recv->Done());
  }
  Sync();
  if (rank_ == 0) {
    Tensor t = Scalar1(0.5f);
    ASSERT_TRUE(world_->Send(t, 2, 4)->Wait(kWait).ok());
  }
  if (rank_ == 2) {
    ASSERT_TRUE(recv->Wait(kWait).ok());
    EXPECT_EQ(d.ToVector()[0], 0.5f);
    Tensor d1 = Scalar1(0);
    ASSERT_TRUE(world_->Recv(d1, 1, 4)->Wait(kWait).ok());
    EXPECT_EQ(d1.ToVector()[0], 1.0f);
  }
}

TEST_F(MpiCommTest, SizeOrDtypeMismatchIsInvalidArgument) {
  for (int64_t tag : {int64_t{7}, int64_t{1} << 42}) {
    Tensor four = Tensor::FromVector({4}, {1, 2, 3, 4});
    if (rank_ == 0) {
      ASSERT_TRUE(world_->Send(four, 1, tag)->Wait(kWait).ok());
      ASSERT_TRUE(world_->Send(four, 1, tag + 1)->Wait(kWait).ok());
      ASSERT_TRUE(world_->Send(four, 1, tag)->Wait(kWait).ok());  // after the bad one
    }
    if (rank_ == 1) {
      Tensor three = Tensor::Zeros({3});
      absl::Status s = world_->Recv(three, 0, tag)->Wait(kWait);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(Contains(s, "16 bytes")) << s;
      EXPECT_TRUE(Contains(s, "12 bytes")) << s;
      EXPECT_TRUE(Contains(s, "rank 0")) << s;
      EXPECT_TRUE(Contains(s, absl::StrCat("tag ", tag))) << s;
      EXPECT_EQ(three.ToVector(), (std::vector<float>{0, 0, 0}));  // untouched
      // Same byte size, other dtype.
      Tensor ints = Tensor::Zeros({4}, DType::kI32);
      s = world_->Recv(ints, 0, tag + 1)->Wait(kWait);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(Contains(s, "f32")) << s;
      EXPECT_TRUE(Contains(s, "i32")) << s;
      // The failed receive consumed its message; the next one of the tag still flows.
      Tensor ok = Tensor::Zeros({4});
      s = world_->Recv(ok, 0, tag)->Wait(kWait);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(ok.ToVector(), (std::vector<float>{1, 2, 3, 4}));
    }
    EXPECT_TRUE(world_->abort_status().ok());
    Sync();
  }
}

TEST_F(MpiCommTest, InvalidArgumentsFailLocally) {
  Tensor t = Scalar1(1);
  absl::Status s = world_->Send(t, size_, 0)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, absl::StrCat("peer ", size_))) << s;
  s = world_->Recv(t, -1, 0)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(world_->Send(t, 0, -3)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(world_->Recv(t, 0, -3)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  Tensor undefined;
  EXPECT_EQ(world_->Send(undefined, 0, 0)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(world_->abort_status().ok());  // errors do not abort the world
}

TEST_F(MpiCommTest, SendToSelf) {
  Tensor src = Tensor::FromVector({2}, {5, 6}), dst = Tensor::Zeros({2});
  ASSERT_TRUE(world_->Send(src, rank_, 11)->Wait(kWait).ok());
  ASSERT_TRUE(world_->Recv(dst, rank_, 11)->Wait(kWait).ok());
  EXPECT_EQ(dst.ToVector(), (std::vector<float>{5, 6}));
}

std::vector<float> Ramp(int64_t n, float scale) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(i % 9973) + 0.5f;
  return v;
}

TEST_F(MpiCommTest, LargeMessagesAndDerivedDatatypes) {
  // 24 MiB (rendezvous protocol), then the same through derived datatypes of 1000-byte blocks and
  // with every tag past 100 on the header-matched path.
  constexpr int64_t kN = 6 << 20;
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      MpiWorldOptions o;
      o.max_block_bytes = 1000;
      o.max_direct_tag = 100;
      Create(o);
    }
    const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
    for (int64_t tag : {int64_t{3}, int64_t{1000}}) {
      Tensor src = Tensor::FromVector({kN}, Ramp(kN, static_cast<float>(rank_ + 1)));
      Tensor dst = Tensor::Zeros({kN});
      auto recv = world_->Recv(dst, prev, tag);
      ASSERT_TRUE(world_->Send(src, next, tag)->Wait(kWait).ok());
      absl::Status s = recv->Wait(kWait);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(dst.ToVector(), Ramp(kN, static_cast<float>(prev + 1))) << "pass " << pass;
    }
    Sync();
  }
}

TEST_F(MpiCommTest, SenderProgressesWhileItComputes) {
  // Rank 0 sends 32 MiB and then "computes" (no pipewright calls) for 2 s; the progress thread
  // keeps the transfer going, so rank 1 gets it long before rank 0 is back.
  constexpr int64_t kN = 8 << 20;
  Sync();
  if (rank_ == 0) {
    Tensor src = Tensor::FromVector({kN}, Ramp(kN, 1));
    ASSERT_TRUE(world_->Send(src, 1, 1)->Wait(kWait).ok());
    SleepMs(2000);
  } else if (rank_ == 1) {
    Tensor dst = Tensor::Zeros({kN});
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = world_->Recv(dst, 0, 1)->Wait(kWait);
    const double waited = SecondsSince(start);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_LT(waited, 1.5);
    EXPECT_EQ(dst.ToVector(), Ramp(kN, 1));
  }
  Sync();
}

TEST_F(MpiCommTest, BarrierWaitsForTheLastRankAndTimesOut) {
  Sync();
  const auto start = std::chrono::steady_clock::now();
  if (rank_ == size_ - 1) SleepMs(400);
  auto barrier = world_->Barrier();
  if (rank_ == 0) {
    absl::Status s = barrier->Wait(absl::Milliseconds(50));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_TRUE(Contains(s, "Barrier (collective #")) << s;
    EXPECT_TRUE(Contains(s, "waiting for ranks")) << s;
    EXPECT_TRUE(EndsWith(s, std::to_string(size_ - 1))) << s;
    EXPECT_TRUE(world_->abort_status().ok());
  }
  absl::Status s = barrier->Wait(kWait);  // waiting again after the timeout works
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_GE(SecondsSince(start), 0.35);
}

TEST_F(MpiCommTest, RecvTimeoutNamesPeerAndTagAndDoesNotAbort) {
  const int peer = (rank_ + 1) % size_;
  Tensor t = Scalar1(0);
  auto recv = world_->Recv(t, peer, 17);
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = recv->Wait(absl::Milliseconds(200));
  const double waited = SecondsSince(start);
  EXPECT_GE(waited, 0.2);
  EXPECT_LT(waited, 0.4);  // within 2x the timeout
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(Contains(s, absl::StrCat("rank ", rank_, ": "))) << s;
  EXPECT_TRUE(Contains(s, absl::StrCat("Recv from rank ", peer))) << s;
  EXPECT_TRUE(Contains(s, "tag 17")) << s;
  EXPECT_TRUE(Contains(s, "0.2s")) << s;
  EXPECT_TRUE(world_->abort_status().ok());
  Sync();
  // Waiting again after the timeout works once the message comes.
  Tensor m = Scalar1(static_cast<float>(rank_));
  ASSERT_TRUE(world_->Send(m, (rank_ + size_ - 1) % size_, 17)->Wait(kWait).ok());
  s = recv->Wait(kWait);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(t.ToVector()[0], static_cast<float>(peer));
}

// In a split group the ranks are not mpirun's: a timeout also names the world rank, so the error
// points at the process that went silent (issue 16: "waiting for ranks 0" named a group rank).
TEST_F(MpiCommTest, SplitGroupTimeoutsNameWorldRanks) {
  if (size_ < 2) GTEST_SKIP() << "needs 2 ranks";
  // One group, in reverse order: group rank g is world rank size - 1 - g.
  absl::StatusOr<std::unique_ptr<Communicator>> sub = world_->Split(0, size_ - rank_, kWait);
  ASSERT_TRUE(sub.ok()) << sub.status();
  Communicator& g = **sub;
  ASSERT_EQ(g.rank(), size_ - 1 - rank_);
  Sync();
  if (rank_ == size_ - 1) SleepMs(500);
  Tensor t = Scalar1(1);
  auto w = g.AllReduce(t);
  if (rank_ == 0) {
    absl::Status s = w->Wait(absl::Milliseconds(100));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_TRUE(EndsWith(s, absl::StrCat("waiting for ranks 0 (world rank ", size_ - 1, ")"))) << s;
    // Point to point: the group peer 0 is world rank size - 1.
    Tensor r = Scalar1(0);
    s = g.Recv(r, 0, 17)->Wait(absl::Milliseconds(50));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_TRUE(Contains(s, absl::StrCat("Recv from rank 0 (world rank ", size_ - 1, ", tag 17)")))
        << s;
  }
  ASSERT_TRUE(w->Wait(kWait).ok());
  EXPECT_EQ(t.ToVector()[0], static_cast<float>(size_));
}

TEST_F(MpiCommTest, CollectiveTimeoutNamesMissingRanks) {
  for (const bool gather : {false, true}) {
    SCOPED_TRACE(gather ? "AllGather" : "AllReduce");
    Sync();
    if (rank_ == size_ - 1) SleepMs(500);
    Tensor t = Scalar1(1), out = Tensor::Zeros({size_});
    auto w = gather ? world_->AllGather(t, out) : world_->AllReduce(t);
    if (rank_ == 0) {
      absl::Status s = w->Wait(absl::Milliseconds(100));
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_TRUE(
          Contains(s, absl::StrCat("rank 0: ", gather ? "AllGather" : "AllReduce", " (collective #",
                                   gather ? 3 : 1, ") timed out after 0.1s")))
          << s;
      EXPECT_TRUE(Contains(s, "waiting for ranks")) << s;
      EXPECT_TRUE(EndsWith(s, std::to_string(size_ - 1))) << s;
      EXPECT_TRUE(world_->abort_status().ok());
    }
    ASSERT_TRUE(w->Wait(kWait).ok());  // waiting again after the timeout works
    EXPECT_EQ(t.ToVector()[0], gather ? 1.0f : static_cast<float>(size_));
    if (gather) {
      EXPECT_EQ(out.ToVector(), std::vector<float>(size_, 1.0f));
    }
  }
}

TEST_F(MpiCommTest, SplitIntoDataParallelGroups) {
  if (size_ % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const Topology topo{2, size_ / 2};  // pp = 2
  const int pipeline_rank = topo.PipelineRank(rank_), replica = topo.Replica(rank_);
  // key = -replica: the new ranks are in reverse replica order.
  auto sub = world_->Split(pipeline_rank, -replica, kWait);
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_NE(*sub, nullptr);
  Communicator& dp = **sub;
  EXPECT_EQ(dp.kind(), CommBackend::kMpi);
  EXPECT_TRUE(dp.capabilities().rank_order_sum);
  EXPECT_EQ(dp.size(), topo.dp);
  EXPECT_EQ(dp.rank(), topo.dp - 1 - replica);
  const std::vector<int> group = topo.DataParallelGroup(pipeline_rank);
  // AllReduce in the group: sum over its members in *group* rank order.
  Tensor t = Scalar1(static_cast<float>(rank_ + 1));
  absl::Status s = dp.AllReduce(t)->Wait(kWait);
  ASSERT_TRUE(s.ok()) << s;
  float e = 0;
  for (int g : group) e += static_cast<float>(g + 1);
  EXPECT_EQ(t.ToVector()[0], e);
  // AllGather in the group: blocks in group rank order (reverse replica order).
  Tensor tagged = Scalar1(static_cast<float>(rank_)), all = Tensor::Zeros({dp.size()});
  ASSERT_TRUE(dp.AllGather(tagged, all)->Wait(kWait).ok());
  for (int r = 0; r < dp.size(); ++r) {
    EXPECT_EQ(all.ToVector()[r], static_cast<float>(group[group.size() - 1 - r])) << r;
  }
  // Bit-identical to the rank-order sum of the group's inputs, ordered by group rank.
  std::vector<Tensor> inputs;
  for (auto it = group.rbegin(); it != group.rend(); ++it) {
    inputs.push_back(MixedMagnitudeInput(*it, 777, 5));
  }
  Tensor mine = MixedMagnitudeInput(rank_, 777, 5);
  ASSERT_TRUE(dp.AllReduce(mine)->Wait(kWait).ok());
  EXPECT_TRUE(BitEqual(mine, SequentialSum(inputs)));
  // P2P in the group uses its ranks, with the same tags as the parent without mixing.
  if (dp.size() > 1) {
    const int next = (dp.rank() + 1) % dp.size(), prev = (dp.rank() + dp.size() - 1) % dp.size();
    Tensor m = Scalar1(static_cast<float>(rank_)), parent_msg = Scalar1(-5);
    ASSERT_TRUE(world_->Send(parent_msg, rank_, 0)->Wait(kWait).ok());  // same tag, parent
    ASSERT_TRUE(dp.Send(m, next, 0)->Wait(kWait).ok());
    Tensor got = Scalar1(0);
    ASSERT_TRUE(dp.Recv(got, prev, 0)->Wait(kWait).ok());
    const int prev_world = topo.GlobalRank(pipeline_rank, topo.dp - 1 - prev);
    EXPECT_EQ(got.ToVector()[0], static_cast<float>(prev_world));
    ASSERT_TRUE(world_->Recv(got, rank_, 0)->Wait(kWait).ok());
    EXPECT_EQ(got.ToVector()[0], -5.0f);
  }
  // The parent still works after the split, and a split of the split too.
  Tensor p = Scalar1(1);
  ASSERT_TRUE(world_->AllReduce(p)->Wait(kWait).ok());
  EXPECT_EQ(p.ToVector()[0], static_cast<float>(size_));
  auto self = dp.Split(dp.rank(), 0, kWait);
  ASSERT_TRUE(self.ok()) << self.status();
  ASSERT_NE(*self, nullptr);
  EXPECT_EQ((*self)->size(), 1);
  Tensor one = Scalar1(3);
  ASSERT_TRUE((*self)->AllReduce(one)->Wait(kWait).ok());
  EXPECT_EQ(one.ToVector()[0], 3.0f);
}

TEST_F(MpiCommTest, SplitNegativeColorGetsNull) {
  auto sub = world_->Split(rank_ == 1 ? -1 : 0, 0, kWait);
  ASSERT_TRUE(sub.ok()) << sub.status();
  if (rank_ == 1) {
    EXPECT_EQ(*sub, nullptr);
    return;
  }
  ASSERT_NE(*sub, nullptr);
  EXPECT_EQ((*sub)->size(), size_ - 1);
  EXPECT_EQ((*sub)->rank(), rank_ == 0 ? 0 : rank_ - 1);
  EXPECT_TRUE((*sub)->Barrier()->Wait(kWait).ok());
}

TEST_F(MpiCommTest, DestroyedCommunicatorFailsItsPendingWork) {
  Tensor t = Scalar1(0);
  auto recv = world_->Recv(t, (rank_ + 1) % size_, 99);  // never sent
  Sync();
  world_.reset();
  EXPECT_TRUE(recv->Done());
  absl::Status s = recv->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_TRUE(Contains(s, "destroyed")) << s;
}

TEST_F(MpiCommTest, AbortReachesWaitersOnOtherRanks) {
  const absl::Status cause = absl::UnavailableError("rank 0 lost its device");
  if (rank_ == 0) {
    SleepMs(200);
    world_->Abort(cause);
    EXPECT_EQ(world_->abort_status(), cause);
    world_->Abort(absl::InternalError("second abort loses"));
    EXPECT_EQ(world_->abort_status(), cause);
  } else {
    Tensor t = Scalar1(0);
    auto recv = world_->Recv(t, 0, 3);
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = recv->Wait(absl::Seconds(30));
    EXPECT_LT(SecondsSince(start), 5.0);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_TRUE(Contains(s, "rank 0 aborted: rank 0 lost its device")) << s;
    EXPECT_EQ(world_->abort_status(), s);
  }
  // Future operations fail with it too, on every rank.
  const absl::Status got = world_->abort_status();
  EXPECT_EQ(got.code(), absl::StatusCode::kUnavailable);
  Tensor t = Scalar1(1);
  EXPECT_EQ(world_->Send(t, 0, 0)->Wait(kWait), got);
  EXPECT_EQ(world_->Barrier()->Wait(kWait), got);
  EXPECT_EQ(world_->AllReduce(t)->Wait(kWait), got);
  EXPECT_EQ(world_->Split(0, 0, kWait).status(), got);
}

TEST_F(MpiCommTest, AbortWithOkIsAborted) {
  if (rank_ == 0) {  // never joins the barrier: it aborts instead
    SleepMs(100);
    world_->Abort(absl::OkStatus());
    auto barrier = world_->Barrier();
    EXPECT_TRUE(barrier->Done());
    EXPECT_EQ(barrier->Wait(kWait).code(), absl::StatusCode::kAborted);
  } else {
    absl::Status s = world_->Barrier()->Wait(absl::Seconds(30));
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_TRUE(Contains(s, "rank 0 aborted")) << s;
  }
  EXPECT_EQ(world_->abort_status().code(), absl::StatusCode::kAborted);
}

TEST_F(MpiCommTest, ToStatusCarriesTheMpiErrorString) {
  EXPECT_TRUE(mpi::ToStatus(MPI_SUCCESS, "MPI_Barrier(comm)", "x.cc", 1).ok());
  char text[MPI_MAX_ERROR_STRING + 1] = {};
  int len = 0;
  ASSERT_EQ(MPI_Error_string(MPI_ERR_TAG, text, &len), MPI_SUCCESS);
  absl::Status s = mpi::ToStatus(MPI_ERR_TAG, "MPI_Isend(buf, n, MPI_BYTE, 1, -5, comm, &req)",
                                 "runtime/comm/mpi.cc", 42);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(
      Contains(s, "MPI_Isend(buf, n, MPI_BYTE, 1, -5, comm, &req) at runtime/comm/mpi.cc:42"))
      << s;
  EXPECT_TRUE(Contains(s, std::string(text, len))) << s;
  EXPECT_EQ(mpi::ToStatus(MPI_ERR_NO_MEM, "MPI_Alloc_mem", "x.cc", 1).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(mpi::ToStatus(MPI_ERR_INTERN, "MPI_Send", "x.cc", 1).code(),
            absl::StatusCode::kInternal);
}

TEST_F(MpiCommTest, AbortReachesSplitCommunicators) {
  // Groups: even/odd ranks with 4+ ranks, else one group of all.
  const int color = size_ >= 4 ? rank_ % 2 : 0;
  auto sub = world_->Split(color, rank_, kWait);
  ASSERT_TRUE(sub.ok()) << sub.status();
  ASSERT_NE(*sub, nullptr);
  Communicator& g = **sub;
  const int aborter = size_ >= 4 ? 2 : 0;  // in group 0
  const absl::Status cause = absl::InternalError("stage 3 diverged");
  if (rank_ == aborter) {
    SleepMs(200);
    g.Abort(cause);
  } else {
    // Rank 1 waits in an AllReduce of its group that the last rank never joins; others in
    // receives no one sends.
    std::unique_ptr<Work> w;
    Tensor t = Scalar1(1);
    if (rank_ == size_ - 1 && rank_ != 1) {
      w = world_->Recv(t, aborter, 5);
    } else if (g.rank() == 0 && g.size() > 1 && rank_ != 1) {
      w = g.Recv(t, 1, 5);
    } else {
      w = g.AllReduce(t);
    }
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = w->Wait(absl::Seconds(30));
    EXPECT_LT(SecondsSince(start), 5.0);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_TRUE(Contains(s, absl::StrCat("rank ", aborter, " aborted: stage 3 diverged"))) << s;
  }
  EXPECT_EQ(world_->abort_status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(g.abort_status(), world_->abort_status());
  Tensor t = Scalar1(0);
  EXPECT_EQ(g.Recv(t, 0, 0)->Wait(kWait), world_->abort_status());
  EXPECT_EQ(world_->Barrier()->Wait(kWait), world_->abort_status());
}

// The harness itself: with PIPEWRIGHT_MPI_TEST_FAIL_RANK=r, rank r fails this test (and only it),
// and the whole run must fail (ctest: mpi.comm.failure_propagates, WILL_FAIL).
TEST_F(MpiCommTest, InjectedFailureOnOneRank) {
  const char* fail_rank = std::getenv("PIPEWRIGHT_MPI_TEST_FAIL_RANK");
  if (fail_rank == nullptr) GTEST_SKIP() << "PIPEWRIGHT_MPI_TEST_FAIL_RANK is not set";
  if (rank_ == std::atoi(fail_rank)) ADD_FAILURE() << "injected failure on rank " << rank_;
  Sync();
}

// A manual benchmark (--gtest_also_run_disabled_tests): ping-pong between ranks 0 and 1 and
// AllReduce over all ranks; rank 0 prints the rates.
TEST_F(MpiCommTest, DISABLED_Throughput) {
  for (int64_t bytes : {int64_t{4} << 10, int64_t{1} << 20, int64_t{16} << 20, int64_t{64} << 20}) {
    const int64_t n = bytes / 4;
    Tensor a = Tensor::Zeros({n}), b = Tensor::Zeros({n});
    const int reps = bytes < (1 << 20) ? 200 : 10;
    Sync();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) {
      if (rank_ == 0) {
        ASSERT_TRUE(world_->Send(a, 1, 1)->Wait(kWait).ok());
        ASSERT_TRUE(world_->Recv(b, 1, 2)->Wait(kWait).ok());
      } else if (rank_ == 1) {
        ASSERT_TRUE(world_->Recv(b, 0, 1)->Wait(kWait).ok());
        ASSERT_TRUE(world_->Send(a, 0, 2)->Wait(kWait).ok());
      }
    }
    const double t = SecondsSince(start);
    if (rank_ == 0) {
      std::printf("ping-pong %8lld bytes: %8.1f us per round trip, %6.2f GB/s\n",
                  static_cast<long long>(bytes), 1e6 * t / reps, 2.0 * bytes * reps / t / 1e9);
    }
    Sync();
    const auto start2 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) ASSERT_TRUE(world_->AllReduce(a)->Wait(kWait).ok());
    const double t2 = SecondsSince(start2);
    if (rank_ == 0) {
      std::printf("allreduce %8lld bytes: %8.1f us each, %6.2f GB/s of tensor\n",
                  static_cast<long long>(bytes), 1e6 * t2 / reps, 1.0 * bytes * reps / t2 / 1e9);
    }
  }
}

// Non-zero ranks print only their failures (rank 0 prints gtest's usual report).
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace pipewright::mpi_test

int main(int argc, char** argv) {
  using namespace pipewright;
  using mpi_test::g_mpi;
  using mpi_test::g_process;
  ::testing::InitGoogleTest(&argc, argv);
  g_mpi = LaunchedByMpi();
  if (g_mpi) {
    absl::StatusOr<MpiProcess> p = InitMpi();
    if (!p.ok()) {
      std::fprintf(stderr, "InitMpi failed: %s\n", p.status().ToString().c_str());
      return 1;
    }
    g_process = *p;
    if (p->rank != 0) {
      ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new mpi_test::FailurePrinter(p->rank));
    }
  }
  int rc = RUN_ALL_TESTS();
  if (g_mpi) {
    // Every rank learns whether any rank failed, and exits accordingly.
    int failed = rc != 0 ? 1 : 0, total = -1;
    absl::StatusOr<std::unique_ptr<Communicator>> world = CreateMpiWorld();
    if (world.ok()) {
      Tensor flag = Tensor::FromVectorI32({1}, {failed});
      absl::Status s = (*world)->AllReduce(flag)->Wait(absl::Seconds(60));
      if (s.ok())
        total = flag.data<int32_t>()[0];
      else
        std::fprintf(stderr, "[rank %d] result exchange failed: %s\n", g_process.rank,
                     s.ToString().c_str());
      world->reset();
    }
    if (total != 0) rc = 1;
    if (g_process.rank == 0 && total > 0) {
      std::fprintf(stderr, "%d of %d ranks failed\n", total, g_process.size);
    }
    FinalizeMpi();
  }
  return rc;
}
