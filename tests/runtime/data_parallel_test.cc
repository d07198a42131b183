// The data-parallel strategies alone (runtime/data_parallel/): the exact norm accumulator, the
// flat layout's shard boundaries, and Replicated / Sharded (ZeRO-1, ZeRO-2) driven as the rank
// executor drives them, with replicas as threads over the local communicator.
#include "runtime/data_parallel/data_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pipewright/comm.h"
#include "pipewright/ops.h"
#include "runtime/data_parallel/exact_sum.h"

namespace pipewright::internal {
namespace {

double Sum(const std::vector<double>& xs) {
  ExactSum s;
  for (double x : xs) s.Add(x);
  return s.Round();
}

TEST(ExactSum, RoundsOnceToNearestEven) {
  EXPECT_EQ(Sum({}), 0.0);
  EXPECT_EQ(Sum({1.5, 0x1p-300}), 1.5);  // the tiny term is kept, then rounded away
  // 1 + 2^-53 is halfway between 1 and its successor: ties to even, 1.
  EXPECT_EQ(Sum({1.0, 0x1p-53}), 1.0);
  // Any more than halfway, however far below: up. A double sum in either order gives 1.
  EXPECT_EQ(Sum({1.0, 0x1p-53, 0x1p-200}), 1.0 + 0x1p-52);
  EXPECT_EQ(Sum({0x1p-200, 0x1p-53, 1.0}), 1.0 + 0x1p-52);
  // Terms far apart that a double accumulator would drop one by one add up exactly.
  std::vector<double> many(1 << 12, 0x1p-60);
  many.push_back(1.0);
  EXPECT_EQ(Sum(many), 1.0 + 0x1p-48);
  // Carries across limbs: (2^32 - 1) 2^k added 2^20 times.
  std::vector<double> carries(1 << 20, 4294967295.0 * 0x1p-40);
  EXPECT_EQ(Sum(carries), 4294967295.0 * 0x1p-20);
}

TEST(ExactSum, InfinitiesAndNaNs) {
  EXPECT_TRUE(std::isinf(Sum({1.0, INFINITY})));
  EXPECT_TRUE(std::isnan(Sum({1.0, INFINITY, NAN})));
  EXPECT_TRUE(std::isinf(Sum({0x1p301})));  // beyond the accumulator
}

// Any order and any grouping — partial sums serialised as slots and added by an f64 all-reduce,
// as the step agreement does — gives the same bits.
TEST(ExactSum, IndependentOfOrderAndGrouping) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> m(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-140, 120);
  std::vector<double> xs(5000);
  for (double& x : xs) {
    const double f = std::ldexp(static_cast<double>(m(rng)), e(rng));
    x = f * f;
  }
  const double want = Sum(xs);
  double naive = 0;
  for (double x : xs) naive += x;
  EXPECT_NEAR(want, naive, 1e-12 * naive);
  for (int trial = 0; trial < 5; ++trial) {
    std::shuffle(xs.begin(), xs.end(), rng);
    const int groups = 1 + trial;
    std::vector<double> slots(ExactSum::kSlots, 0.0);
    for (int g = 0; g < groups; ++g) {
      ExactSum part;
      for (size_t i = g; i < xs.size(); i += groups) part.Add(xs[i]);
      std::vector<double> mine(ExactSum::kSlots);
      part.ToSlots(mine.data());
      for (int k = 0; k < ExactSum::kSlots; ++k) slots[k] += mine[k];
    }
    EXPECT_EQ(ExactSum::FromSlots(slots.data()).Round(), want) << groups << " groups";
  }
}

// A tensor's squares summed by chunk give the same bits whole or in pieces cut on chunk
// boundaries — what makes a sharded norm equal the replicated one.
TEST(ExactSum, ChunkSquaresOfPiecesEqualTheWhole) {
  const int64_t n = 5 * kNormChunk + 123;
  std::vector<float> v(n);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (float& x : v) x = d(rng);
  const Tensor t = Tensor::FromVector({n}, v);
  ExactSum whole, pieces;
  ASSERT_TRUE(AddChunkSquares(ops::Exec{}, t, 0, n, &whole).ok());
  ASSERT_TRUE(AddChunkSquares(ops::Exec{}, t, 0, 2 * kNormChunk, &pieces).ok());
  ASSERT_TRUE(AddChunkSquares(ops::Exec{}, t, 2 * kNormChunk, 3 * kNormChunk, &pieces).ok());
  ASSERT_TRUE(AddChunkSquares(ops::Exec{}, t, 3 * kNormChunk, n, &pieces).ok());
  EXPECT_EQ(whole.Round(), pieces.Round());
  EXPECT_FALSE(AddChunkSquares(ops::Exec{}, t, 7, n, &pieces).ok()) << "not on a chunk boundary";
}

TEST(FlatLayout, ShardBoundariesCutTensorsOnlyAtChunkBoundaries) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int64_t> size(1, 5 * kNormChunk);
  for (int trial = 0; trial < 200; ++trial) {
    const int replicas = 2 + trial % 5;
    std::vector<int64_t> sizes(1 + trial % 9);
    int64_t total = 0;
    for (int64_t& s : sizes) total += s = trial % 3 == 0 ? size(rng) * 7 : size(rng);
    const FlatLayout l = LayOutFlat(sizes, replicas);
    ASSERT_EQ(l.offsets.size(), sizes.size());
    int64_t end = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_GE(l.offsets[i], end) << "tensors overlap";
      end = l.offsets[i] + sizes[i];
      for (int r = 1; r < replicas; ++r) {
        const int64_t b = r * l.shard;
        if (b > l.offsets[i] && b < end) {
          EXPECT_EQ((b - l.offsets[i]) % kNormChunk, 0) << "trial " << trial << " tensor " << i;
        }
      }
    }
    EXPECT_LE(end, l.numel());
    // Padding: under two chunks per replica (a shard rounded up to whole chunks, each cut tensor
    // moved by less than a chunk).
    EXPECT_LE(l.numel() - total, 2 * replicas * kNormChunk) << "trial " << trial;
    if (total >= 4 * replicas * kNormChunk) {
      EXPECT_LE(l.shard, (total + replicas - 1) / replicas + 2 * kNormChunk);
    }
  }
}

// How the last five parameters (f to j) form layers: a layer each; one layer whose gradients
// are one group; one layer of five gradient groups (Note [Gradient groups] in
// pipewright/layer.h) reported as each is added; the same groups never reported.
enum class Tail { kLayers, kOneGroup, kGroups, kGroupsUnreported };

// One replica's parameters for the strategy tests: a stage of layers, one without parameters and
// one with a tied tensor among them.
struct Replica {
  std::vector<std::unique_ptr<Parameter>> params;
  DataParallelParams view;
  Tail tail = Tail::kLayers;

  explicit Replica(Tail t = Tail::kLayers) : tail(t) {
    const std::vector<std::pair<std::string, int64_t>> shapes = {{"a", kNormChunk + 17},
                                                                 {"b", 900},
                                                                 {"c", 2 * kNormChunk},
                                                                 {"d", 5000},
                                                                 {"e", 64},
                                                                 {"f", 3000},
                                                                 {"g", 3001},
                                                                 {"h", 2999},
                                                                 {"i", 3000},
                                                                 {"j", 3000}};
    for (const auto& [name, n] : shapes) {
      auto p = std::make_unique<Parameter>();
      p->name = name;
      std::vector<float> v(n);
      for (int64_t i = 0; i < n; ++i) v[i] = 0.01f * std::sin(static_cast<float>(i + n));
      p->value = Tensor::FromVector({n}, v);
      p->grad = Tensor::Zeros({n});
      p->weight_decay = name != "b";
      params.push_back(std::move(p));
    }
    view.stages.push_back({0,
                           {{params[0].get(), params[1].get()},
                            {},
                            {params[2].get()},
                            {params[3].get(), params[4].get()}}});
    if (tail == Tail::kLayers) {
      for (size_t i = 5; i < params.size(); ++i) {
        view.stages[0].layers.push_back({params[i].get()});
      }
    } else {
      std::vector<Parameter*> last;
      for (size_t i = 5; i < params.size(); ++i) last.push_back(params[i].get());
      view.stages[0].layers.push_back(last);
      if (tail != Tail::kOneGroup) {
        for (const auto& layer : view.stages[0].layers) {
          view.stages[0].groups.push_back({});
          if (!layer.empty()) view.stages[0].groups.back().push_back(layer);
        }
        view.stages[0].groups.back().clear();
        for (Parameter* p : last) view.stages[0].groups.back().push_back({p});
      }
    }
    for (auto& p : params) view.trained.push_back(p.get());
    view.tied.insert(params[4].get());  // kept whole by a sharded strategy
  }

  // Adds micro-batch mb's gradient of replica r to layer `layer`'s parameters: values whose
  // float sums depend on their order.
  void AddGrads(int r, int mb, int layer) { AddGrads(r, mb, view.stages[0].layers[layer]); }
  void AddGrads(int r, int mb, const std::vector<Parameter*>& ps) {
    for (Parameter* p : ps) {
      float* g = p->grad.data<float>();
      for (int64_t i = 0; i < p->grad.numel(); ++i) {
        g[i] += std::ldexp(std::cos(static_cast<float>(i * 7 + r * 13 + mb * 5)),
                           static_cast<int>((i + r + mb) % 21) - 10);
      }
    }
  }
};

struct StrategyRun {
  std::vector<std::vector<float>> values;        // per parameter, replica 0's after the steps
  std::vector<double> norms;                     // per step
  std::vector<GradSyncBytes> bytes;              // per replica, last step
  std::vector<int64_t> grad_bytes, state_bytes;  // per replica
  bool replicas_equal = true;
  absl::Status error;  // Tail::kGroupsUnreported: the first replica's
  // Per replica, per step: the bucket collectives it posted (Note [Bucket spans]).
  std::vector<std::vector<std::vector<BucketWatch::Span>>> spans;
};

// `steps` steps of `zero` over `dp` replicas with `micro_batches` micro-batches each.
StrategyRun RunStrategy(int zero, int dp, int micro_batches, int steps, Tail tail = Tail::kLayers) {
  auto comms = CreateLocalWorld(dp);
  std::vector<Replica> replicas;
  for (int r = 0; r < dp; ++r) replicas.emplace_back(tail);
  StrategyRun out;
  out.bytes.resize(dp);
  out.grad_bytes.resize(dp);
  out.state_bytes.resize(dp);
  out.spans.resize(dp);
  std::vector<std::vector<double>> slots(steps, std::vector<double>(ExactSum::kSlots, 0.0));
  std::vector<std::vector<std::vector<double>>> mine(
      dp, std::vector<std::vector<double>>(steps, std::vector<double>(ExactSum::kSlots)));
  std::vector<absl::Status> status(dp);
  std::vector<std::thread> threads;
  for (int r = 0; r < dp; ++r) {
    threads.emplace_back([&, r] {
      BucketWatch watch;  // as the rank keeps it: polled at launch points, told of each wait
      DataParallelContext ctx;
      ctx.dp = comms[r].get();
      ctx.replica = r;
      ctx.replicas = dp;
      ctx.alloc = DefaultCpuAllocator();
      ctx.wait = [&watch](Work& w, const std::string&) {
        PW_RETURN_IF_ERROR(w.Wait(absl::Seconds(30)));
        watch.Waited(w);
        return absl::OkStatus();
      };
      ctx.sync_device = [] { return absl::OkStatus(); };
      ctx.buckets = &watch;
      ctx.bucket_bytes = 4 * 1000;  // a bucket per layer with parameters, about
      Replica& rep = replicas[r];
      std::unique_ptr<DataParallel> s;
      if (zero == 0) {
        GradSyncContext g{ctx.dp, ctx.alloc, ctx.wait, ctx.sync_device, ctx.buckets};
        s = CreateReplicated(
            ctx, rep.view,
            CreateBucketedAllReduce(g, rep.view.stages, ctx.bucket_bytes, GradCompression::None()));
      } else {
        auto created = CreateSharded(ctx, rep.view, zero);
        if (!created.ok()) {
          status[r] = created.status();
          return;
        }
        s = *std::move(created);
      }
      auto run = [&]() -> absl::Status {
        for (int step = 0; step < steps; ++step) {
          watch.Clear();
          s->BeginStep();
          ZeroGrads(rep.view.trained);
          for (int mb = 0; mb < micro_batches; ++mb) {
            // As a B action runs: the layers' weight gradients last layer first, each
            // announced as soon as it is added.
            PW_RETURN_IF_ERROR(s->BeginBackward(0, mb + 1 == micro_batches));
            for (int layer = static_cast<int>(rep.view.stages[0].layers.size()); layer-- > 0;) {
              const bool grouped = tail == Tail::kGroups || tail == Tail::kGroupsUnreported;
              if (grouped && layer + 1 == static_cast<int>(rep.view.stages[0].layers.size())) {
                // Group by group, last first, each told as it is complete (as the layers do).
                const auto& groups = rep.view.stages[0].groups[layer];
                for (size_t g = groups.size(); g-- > 0;) {
                  rep.AddGrads(r, mb + step, groups[g]);
                  GradientObserver* o = s->observer(0);
                  if (o != nullptr && tail == Tail::kGroups) {
                    PW_RETURN_IF_ERROR(o->GradientsDone(groups[g]));
                  }
                }
              } else {
                rep.AddGrads(r, mb + step, layer);
              }
              PW_RETURN_IF_ERROR(s->GradReady(0, layer, mb + 1 == micro_batches));
              watch.Poll();
            }
          }
          PW_RETURN_IF_ERROR(s->StageReady(0));
          PW_RETURN_IF_ERROR(s->Finish());
          out.spans[r].push_back(watch.Take());
          ExactSum norm;
          PW_RETURN_IF_ERROR(s->AddSquaredNorm(&norm));
          norm.ToSlots(mine[r][step].data());
          PW_RETURN_IF_ERROR(s->Step(1e-2f, 0.5f));
          PW_RETURN_IF_ERROR(s->SyncParameters());
        }
        out.bytes[r] = s->StepBytes();
        out.grad_bytes[r] = s->GradientBytes();
        out.state_bytes[r] = s->OptimizerStateBytes();
        return absl::OkStatus();
      };
      status[r] = run();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < dp; ++r) {
    if (tail == Tail::kGroupsUnreported && zero == 2) {
      if (out.error.ok()) out.error = status[r];
      continue;
    }
    EXPECT_TRUE(status[r].ok()) << status[r];
  }
  for (int step = 0; step < steps; ++step) {
    for (int r = 0; r < dp; ++r) {
      for (int k = 0; k < ExactSum::kSlots; ++k) slots[step][k] += mine[r][step][k];
    }
    out.norms.push_back(ExactSum::FromSlots(slots[step].data()).Round());
  }
  for (auto& p : replicas[0].params) out.values.push_back(p->value.ToVector());
  for (int r = 1; r < dp; ++r) {
    for (size_t i = 0; i < replicas[r].params.size(); ++i) {
      out.replicas_equal =
          out.replicas_equal && replicas[r].params[i]->value.ToVector() == out.values[i];
    }
  }
  return out;
}

TEST(Sharded, ZeroOneEqualsReplicatedBitForBitAndSendsTheSameBytes) {
  for (int dp : {2, 3}) {
    const StrategyRun want = RunStrategy(0, dp, 2, 3);
    const StrategyRun got = RunStrategy(1, dp, 2, 3);
    EXPECT_TRUE(want.replicas_equal);
    EXPECT_TRUE(got.replicas_equal) << "dp " << dp;
    EXPECT_EQ(got.norms, want.norms) << "dp " << dp;
    EXPECT_EQ(got.values, want.values) << "dp " << dp;
    for (int r = 0; r < dp; ++r) {
      // The same gradients reduced; the reduce-scatter and all-gather move the all-reduce's
      // wire bytes, and the padding of the chunk-aligned shards on top.
      // (ring bytes are rounded down per collective: a byte per bucket either way)
      EXPECT_NEAR(got.bytes[r].uncompressed, want.bytes[r].uncompressed, 16);
      EXPECT_GE(got.bytes[r].sent, want.bytes[r].sent);
      EXPECT_LE(got.bytes[r].sent, want.bytes[r].sent + 4 * 4 * kNormChunk * dp * 4);
      EXPECT_LT(got.state_bytes[r], want.state_bytes[r]) << "the state is split";
    }
  }
}

TEST(Sharded, ZeroTwoAgreesToRoundingAndHoldsAShareOfTheGradients) {
  const int dp = 2, mbs = 3;
  const StrategyRun want = RunStrategy(0, dp, mbs, 3);
  const StrategyRun one = RunStrategy(1, dp, mbs, 3);
  const StrategyRun two = RunStrategy(2, dp, mbs, 3);
  EXPECT_TRUE(two.replicas_equal);
  ASSERT_EQ(two.values.size(), want.values.size());
  double worst = 0;
  for (size_t i = 0; i < want.values.size(); ++i) {
    for (size_t k = 0; k < want.values[i].size(); ++k) {
      worst = std::max(worst, static_cast<double>(std::abs(two.values[i][k] - want.values[i][k])));
    }
  }
  EXPECT_LT(worst, 1e-5);
  EXPECT_NE(two.values, want.values) << "micro-batch-first sums should round differently";
  for (size_t s = 0; s < want.norms.size(); ++s) {
    EXPECT_NEAR(two.norms[s], want.norms[s], 1e-5 * want.norms[s]);
  }
  for (int r = 0; r < dp; ++r) {
    // A reduce-scatter per micro-batch: about mbs times ZeRO-1's reduce-scatter bytes.
    EXPECT_GT(two.bytes[r].sent, one.bytes[r].sent);
    EXPECT_NEAR(two.bytes[r].uncompressed, one.bytes[r].uncompressed, 16);
    // Gradients: the shards, two buckets in flight and the tied tensor, not the whole.
    EXPECT_LT(two.grad_bytes[r], one.grad_bytes[r]);
  }
}

// ZeRO-2's buckets are made of gradient groups, so one may end inside a layer: a layer of five
// groups reported one by one holds two small buckets in flight, where the same layer as one group
// needs buffers for all five at once. The sums are the same, so the bits are too; a layer that
// declares groups and does not report them is refused by name.
TEST(Sharded, ZeroTwoBucketsEndInsideALayer) {
  const int dp = 2, mbs = 3, steps = 3;
  const StrategyRun layers = RunStrategy(2, dp, mbs, steps, Tail::kLayers);
  const StrategyRun one = RunStrategy(2, dp, mbs, steps, Tail::kOneGroup);
  const StrategyRun groups = RunStrategy(2, dp, mbs, steps, Tail::kGroups);
  EXPECT_TRUE(groups.replicas_equal);
  EXPECT_EQ(groups.values, layers.values);
  EXPECT_EQ(one.values, layers.values);
  EXPECT_EQ(groups.norms, layers.norms);
  for (int r = 0; r < dp; ++r) {
    EXPECT_EQ(groups.grad_bytes[r], layers.grad_bytes[r]) << "the same buckets";
    // Two buffers of the five tensors (15,000 floats) against two of the largest other bucket
    // (d: 5,000).
    EXPECT_GE(one.grad_bytes[r] - groups.grad_bytes[r], 2 * 4 * 9000) << r;
  }
  // ZeRO-1 reduces once per step, after the backward: groups change nothing.
  EXPECT_EQ(RunStrategy(1, dp, mbs, steps, Tail::kGroups).values,
            RunStrategy(1, dp, mbs, steps, Tail::kLayers).values);
  const StrategyRun silent = RunStrategy(2, dp, mbs, 1, Tail::kGroupsUnreported);
  EXPECT_EQ(silent.error.code(), absl::StatusCode::kInternal) << silent.error;
  EXPECT_NE(silent.error.message().find("ReportGradients"), std::string::npos) << silent.error;
}

// Note [Bucket spans]: every strategy that reduces by bucket tells the watch of each collective
// it posts — the bucketed all-reduce one all-reduce per bucket, ZeRO-1 one reduce-scatter per
// bucket, ZeRO-2 one per bucket and micro-batch — plus the all-reduce of the bucket with the
// tied tensor (kept whole by a sharded strategy).
TEST(BucketSpans, EveryStrategyReportsEachBucketCollective) {
  const int dp = 2, mbs = 3, steps = 2;
  const Replica shape;
  const StageBuckets sb = BucketLayers(shape.view.stages[0], 4 * 1000);  // RunStrategy's
  const int kBuckets = static_cast<int>(sb.params.size());  // a bucket per layer with parameters
  ASSERT_EQ(kBuckets, 8);
  const int kTiedBucket = sb.layer_bucket[3];  // layer 3's: parameters d and the tied e
  for (int zero : {0, 1, 2}) {
    const StrategyRun run = RunStrategy(zero, dp, mbs, steps);
    ASSERT_EQ(run.spans.size(), static_cast<size_t>(dp));
    for (int r = 0; r < dp; ++r) {
      ASSERT_EQ(run.spans[r].size(), static_cast<size_t>(steps));
      for (const std::vector<BucketWatch::Span>& step : run.spans[r]) {
        std::map<std::pair<int, BucketCollective>, int> count;  // (bucket, collective) -> posts
        for (const BucketWatch::Span& sp : step) {
          EXPECT_EQ(sp.stage, 0);
          EXPECT_LE(sp.posted, sp.done);
          ++count[{sp.bucket, sp.collective}];
        }
        std::map<std::pair<int, BucketCollective>, int> want;
        for (int b = 0; b < kBuckets; ++b) {
          if (zero == 0) want[{b, BucketCollective::kAllReduce}] = 1;
          if (zero != 0) want[{b, BucketCollective::kReduceScatter}] = zero == 1 ? 1 : mbs;
        }
        if (zero != 0) want[{kTiedBucket, BucketCollective::kAllReduce}] = 1;
        EXPECT_EQ(count, want) << "zero " << zero << ", replica " << r;
        // In post order, the first bucket first.
        ASSERT_FALSE(step.empty());
        EXPECT_EQ(step.front().bucket, 0);
      }
    }
  }
}

TEST(Sharded, RefusesWithoutReplicas) {
  Replica rep;
  DataParallelContext ctx;
  ctx.alloc = DefaultCpuAllocator();
  auto s = CreateSharded(ctx, rep.view, 1);
  EXPECT_FALSE(s.ok());
}

}  // namespace
}  // namespace pipewright::internal
