// Asynchronous data parallelism (--dp-mode async, Note [Async DP] in
// runtime/data_parallel/async_dp.cc): the coordinator's bound and tickets on their own, the owners'
// shard, and engine runs over a local world with a straggler. Async runs are not reproducible, so
// the engine tests assert properties: every gradient applied exactly once, the bound never
// exceeded, the loss falls, the replicas end with one model, checkpoints resume.
#include "runtime/data_parallel/async_dp.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "pipewright/engine.h"
#include "pipewright/train.h"
#include "tests/runtime/engine_util.h"

namespace pipewright {
namespace {

using internal::AsyncCoordinator;
using testing_util::EngineSetup;
using testing_util::MakeEngine;

// A claim header: the replica has done `done` steps.
std::vector<double> ClaimOf(int64_t done, bool stop = false) {
  std::vector<double> h(internal::kAsyncHeaderLen, 0.0);
  h[0] = static_cast<double>(internal::AsyncRequest::kClaim);
  h[1] = static_cast<double>(done);
  h[2] = stop ? 1 : 0;
  h[4] = -1;  // no update to report
  return h;
}

// Drives a coordinator with replicas claiming in a random order (a replica only claims again after
// its last claim was granted), checking every grant against the bound as the coordinator
// itself cannot: from the replicas' own step counts.
TEST(AsyncCoordinatorTest, GrantsNeverExceedTheBoundAndHandOutEveryTicketOnce) {
  for (int staleness : {0, 1, 3}) {
    const int D = 3;
    AsyncCoordinator c(D, staleness, /*first_ticket=*/6, /*end_ticket=*/6 + 3 * 20);
    std::vector<int64_t> done(D, 0);
    std::vector<char> waiting(D, 0), finished(D, 0);
    std::vector<int64_t> tickets;
    std::mt19937 rng(staleness + 1);
    for (int iter = 0; iter < 100000 && std::count(finished.begin(), finished.end(), 1) < D;
         ++iter) {
      const int r = static_cast<int>(rng() % D);
      if (finished[r]) continue;
      if (!waiting[r]) {
        c.Claim(r, ClaimOf(done[r]).data());
        waiting[r] = 1;
      }
      for (const auto& [who, g] : c.TakeRemote(/*local=*/-1)) {
        ASSERT_TRUE(waiting[who]);
        waiting[who] = 0;
        if (!g.go) {
          finished[who] = 1;
          continue;
        }
        int64_t slowest = -1;
        for (int j = 0; j < D; ++j) {
          if (!finished[j] && (slowest < 0 || done[j] < slowest)) slowest = done[j];
        }
        // The coordinator knows the others' steps as of their last claims (never more than
        // they have done), so its count is at least the true lead, and within the bound.
        EXPECT_LE(done[who] - slowest, staleness);
        EXPECT_GE(g.staleness, done[who] - slowest);
        EXPECT_LE(g.staleness, staleness);
        tickets.push_back(g.ticket);
        ++done[who];  // the step runs and finishes at once
      }
    }
    ASSERT_EQ(std::count(finished.begin(), finished.end(), 1), D) << "staleness " << staleness;
    std::sort(tickets.begin(), tickets.end());
    ASSERT_EQ(tickets.size(), 60u);
    for (size_t i = 0; i < tickets.size(); ++i) EXPECT_EQ(tickets[i], 6 + static_cast<int64_t>(i));
    const AsyncReport rep = c.Report();
    int64_t steps = 0;
    for (const AsyncReplicaReport& a : rep.replicas) {
      EXPECT_LE(a.max_staleness, staleness);
      steps += a.steps;
    }
    EXPECT_EQ(steps, 60);
  }
}

TEST(AsyncCoordinatorTest, AStopRequestEndsAtTheNextWholeStep) {
  const int D = 2;
  AsyncCoordinator c(D, /*staleness=*/5, 0, 100);
  for (auto [r, done] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{0, 1}}) {
    c.Claim(r, ClaimOf(done).data());  // tickets 0, 1, 2 handed out
    ASSERT_EQ(c.TakeRemote(-1).size(), 1u);
  }
  c.Claim(1, ClaimOf(1, /*stop=*/true).data());  // ticket 3 completes step 1; then no more
  auto g = c.TakeRemote(-1);
  ASSERT_EQ(g.size(), 1u);
  EXPECT_TRUE(g[0].second.go);
  EXPECT_EQ(g[0].second.ticket, 3);
  c.Claim(0, ClaimOf(2).data());
  c.Claim(1, ClaimOf(2).data());
  for (const auto& [r, grant] : c.TakeRemote(-1)) EXPECT_FALSE(grant.go) << "replica " << r;
  EXPECT_EQ(c.end_ticket(), 4);
  EXPECT_TRUE(c.Report().stop_requested);
}

TEST(AsyncShardTest, AppliesEachReplicaStepOnceAndInOrder) {
  CpuAllocator alloc;
  Parameter w{"w", Tensor::Zeros({4}), Tensor::Zeros({4}), false, "", {}};
  std::unique_ptr<Optimizer> from = Optimizer::Create({OptimizerKind::kSgd}, {&w}, &alloc);
  auto shard = internal::AsyncShard::Create({OptimizerKind::kSgd, 0.9f, 0.95f, 1e-8f, 0.0f, 0.0f},
                                            {&w}, *from, 2, &alloc);
  ASSERT_TRUE(shard.ok()) << shard.status();
  const float g[4] = {1, 2, 3, 4};
  auto first = (*shard)->Apply(1, 0, 0.5f, 1.0f, g);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, 0);
  const absl::StatusOr<int64_t> again = (*shard)->Apply(1, 0, 0.5f, 1.0f, g);
  EXPECT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("applied twice"), std::string::npos) << again.status();
  EXPECT_FALSE((*shard)->Apply(0, 1, 0.5f, 1.0f, g).ok());  // replica 0's step 0 comes first
  float v[4];
  (*shard)->Read(v);
  EXPECT_FLOAT_EQ(v[3], -2.0f);  // SGD: 0 - 0.5 * 4
  EXPECT_EQ((*shard)->applied(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(w.value.data<float>()[3], 0.0f);  // the live parameter changes only at Store
  ASSERT_TRUE((*shard)->Store(*from).ok());
  EXPECT_FLOAT_EQ(w.value.data<float>()[3], -2.0f);
}

TEST(AsyncShardTest, OwnersAreBalancedAndTheSameEverywhere) {
  std::vector<Parameter> p(5);
  const int64_t sizes[5] = {100, 10, 60, 40, 1};
  std::vector<Parameter*> ptrs;
  for (int i = 0; i < 5; ++i) {
    p[i].value = Tensor::Zeros({sizes[i]});
    ptrs.push_back(&p[i]);
  }
  const std::vector<int> owner = internal::AssignOwners(ptrs, 2);
  EXPECT_EQ(owner, internal::AssignOwners(ptrs, 2));
  int64_t load[2] = {0, 0};
  for (int i = 0; i < 5; ++i) load[owner[i]] += sizes[i];
  EXPECT_EQ(load[0], 110);  // 100, then 10 (a tie at 100 goes to the lower index)
  EXPECT_EQ(load[1], 101);  // 60 + 40, then 1
}

using testing_util::Tiny;

EngineSetup AsyncSetup(int pp, int dp, int staleness) {
  EngineSetup o;
  o.train.steps = 12;
  o.train.seed = 5;
  o.train.lr = 1e-2f;
  o.train.warmup_steps = 1;
  o.train.dp_mode = DpMode::kAsync;
  o.train.staleness = staleness;
  o.train.threads_per_rank = 1;
  o.micro_batches = 2;
  o.pp = pp;
  o.dp = dp;
  o.timeout = absl::Seconds(60);
  return o;
}

// Checks what every async run must satisfy and returns its report.
AsyncReport CheckedRun(Engine& e, int64_t until, int staleness) {
  const int64_t first = e.step();
  absl::StatusOr<AsyncReport> r = e.RunAsync(until);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  const int dp = e.topology().dp;
  EXPECT_EQ(r->steps, until - first);
  EXPECT_EQ(e.step(), until);
  EXPECT_EQ(r->updates.size(), static_cast<size_t>(r->steps * dp));
  int64_t total = 0;
  std::vector<int64_t> steps;
  for (const AsyncReplicaReport& a : r->replicas) {
    EXPECT_LE(a.max_staleness, staleness) << "replica " << a.replica;
    EXPECT_GE(a.mean_staleness, 0);
    total += a.steps;
    steps.push_back(a.steps);
  }
  EXPECT_EQ(total, r->steps * dp);
  // Every owner applied every replica's every gradient, once.
  EXPECT_EQ(r->applied_by_rank.size(), static_cast<size_t>(e.topology().world_size()));
  for (const auto& [rank, applied] : r->applied_by_rank) EXPECT_EQ(applied, steps) << rank;
  // One model afterwards: every replica holds the owners' parameters.
  for (int p = 0; p < e.topology().pp; ++p) {
    const std::vector<Parameter*> a = e.RankParameters(e.topology().GlobalRank(p, 0));
    for (int rep = 1; rep < dp; ++rep) {
      const std::vector<Parameter*> b = e.RankParameters(e.topology().GlobalRank(p, rep));
      EXPECT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
        EXPECT_EQ(std::memcmp(a[i]->value.raw(), b[i]->value.raw(), a[i]->value.nbytes()), 0)
            << a[i]->name << " differs between replicas 0 and " << rep;
      }
    }
  }
  return *r;
}

double MeanLoss(const AsyncReport& r, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) s += r.updates[i].loss;
  return s / static_cast<double>(to - from);
}

TEST(AsyncDpTest, AStragglerRunsBehindWithinTheBoundAndTheLossFalls) {
  for (const auto& [pp, schedule] :
       {std::pair{1, ScheduleKind::k1F1B}, std::pair{2, ScheduleKind::k1F1B},
        std::pair{2, ScheduleKind::kZbH1}}) {
    EngineSetup s = AsyncSetup(pp, 2, /*staleness=*/2);
    s.schedule = schedule;
    // 10x: the order of the replicas' step counts must survive a loaded machine (a CI run beside
    // builds once gave the fast replica 11 steps to the straggler's 13 at 3x).
    s.hooks.slow_replica = 1;
    s.hooks.slow_factor = 10;
    auto e = MakeEngine(Tiny(), s);
    ASSERT_TRUE(e.ok()) << e.status();
    const AsyncReport r = CheckedRun(**e, 12, 2);
    ASSERT_EQ(r.replicas.size(), 2u);
    // The fast replica takes more of the run's steps, never more than the bound ahead.
    EXPECT_GE(r.replicas[0].steps, r.replicas[1].steps) << "pp " << pp;
    EXPECT_LE(r.replicas[0].steps - r.replicas[1].steps, 2 + 1) << "pp " << pp;
    EXPECT_LT(MeanLoss(r, r.updates.size() - 4, r.updates.size()), MeanLoss(r, 0, 4))
        << "pp " << pp;
  }
}

TEST(AsyncDpTest, StalenessZeroIsLockStep) {
  EngineSetup s = AsyncSetup(2, 2, /*staleness=*/0);
  s.hooks.slow_replica = 0;
  s.hooks.slow_factor = 2;
  auto e = MakeEngine(Tiny(), s);
  ASSERT_TRUE(e.ok()) << e.status();
  const AsyncReport r = CheckedRun(**e, 8, 0);
  for (const AsyncReplicaReport& a : r.replicas) {
    EXPECT_EQ(a.steps, 8);
    EXPECT_EQ(a.max_staleness, 0);
  }
  EXPECT_GT(r.replicas[1].wait_s, 0);  // the fast replica waited for the slow one
}

TEST(AsyncDpTest, CheckpointsOfAnAsyncRunResume) {
  const std::string dir = ::testing::TempDir() + "/async_ckpt_" + std::to_string(getpid());
  EngineSetup s = AsyncSetup(2, 2, 1);
  std::vector<std::pair<std::string, std::vector<float>>> saved;  // outlives the engine
  {
    auto e = MakeEngine(Tiny(), s);
    ASSERT_TRUE(e.ok()) << e.status();
    CheckedRun(**e, 5, 1);
    ASSERT_TRUE((*e)->Save(dir).ok());
    for (const auto& [name, t] : (*e)->Weights()) {
      saved.emplace_back(name, std::vector<float>(t.data<float>(), t.data<float>() + t.numel()));
    }
  }
  auto e = MakeEngine(Tiny(), s);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE((*e)->Resume(dir).ok());
  EXPECT_EQ((*e)->step(), 5);
  const std::vector<std::pair<std::string, Tensor>> resumed = (*e)->Weights();
  ASSERT_EQ(resumed.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_EQ(saved[i].first, resumed[i].first);
    EXPECT_EQ(
        std::memcmp(saved[i].second.data(), resumed[i].second.raw(), resumed[i].second.nbytes()), 0)
        << saved[i].first;
  }
  const AsyncReport r = CheckedRun(**e, 10, 1);
  EXPECT_EQ(r.first_step, 5);
  std::filesystem::remove_all(dir);
}

TEST(AsyncDpTest, AStopRequestEndsAtAWholeStep) {
  auto e = MakeEngine(Tiny(), AsyncSetup(1, 2, 1));
  ASSERT_TRUE(e.ok()) << e.status();
  RequestStop();
  absl::StatusOr<AsyncReport> r = (*e)->RunAsync(10);
  ClearStopRequest();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->stop_requested);
  EXPECT_LT(r->steps, 10);
  EXPECT_EQ(r->updates.size(), static_cast<size_t>(r->steps * 2));
  EXPECT_EQ((*e)->step(), r->steps);
}

TEST(AsyncDpTest, AFailingRankEndsTheRunOnEveryRankWithItsError) {
  EngineSetup s = AsyncSetup(2, 2, 1);
  s.hooks.inject_failure_rank = 3;  // pipeline rank 1 of replica 1
  s.hooks.inject_failure_step = 2;
  s.timeout = absl::Seconds(20);
  auto e = MakeEngine(Tiny(), s);
  ASSERT_TRUE(e.ok()) << e.status();
  const absl::StatusOr<AsyncReport> r = (*e)->RunAsync(8);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("injected failure"), std::string::npos) << r.status();
  EXPECT_FALSE((*e)->RunAsync(9).ok());  // the engine refuses to go on
}

TEST(AsyncDpTest, RefusesWhatItCannotDo) {
  EngineSetup s = AsyncSetup(1, 1, 1);
  auto one = MakeEngine(Tiny(), s);
  ASSERT_FALSE(one.ok());
  EXPECT_NE(one.status().message().find("RunSpec.data_parallel >= 2"), std::string::npos)
      << one.status();

  s = AsyncSetup(1, 2, -1);
  auto negative = MakeEngine(Tiny(), s);
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("TrainOptions.staleness = -1"), std::string::npos);

  s = AsyncSetup(1, 2, 1);
  s.train.grad_compression = GradCompression::Bf16();
  auto compressed = MakeEngine(Tiny(), s);
  ASSERT_FALSE(compressed.ok());
  EXPECT_NE(compressed.status().message().find("TrainOptions.grad_compression"), std::string::npos);

  s = AsyncSetup(1, 2, 1);
  s.hooks.slow_replica = 2;
  auto slow = MakeEngine(Tiny(), s);
  ASSERT_FALSE(slow.ok());
  EXPECT_NE(slow.status().message().find("only 2 replicas"), std::string::npos);

  auto e = MakeEngine(Tiny(), AsyncSetup(1, 2, 1));
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ((*e)->Step().status().code(), absl::StatusCode::kFailedPrecondition);

  EngineSetup sync = AsyncSetup(1, 2, 1);
  sync.train.dp_mode = DpMode::kSync;
  auto se = MakeEngine(Tiny(), sync);
  ASSERT_TRUE(se.ok()) << se.status();
  EXPECT_EQ((*se)->RunAsync(2).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pipewright
