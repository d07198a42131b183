// Gradient bucket spans (EventKind::kBucket, Note [Bucket spans] in
// runtime/grad_sync/bucket_watch.h) and their tracks in the Chrome trace (Note [Bucket tracks] in
// runtime/trace.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/engine.h"
#include "pipewright/trace.h"
#include "tests/runtime/engine_util.h"

namespace pipewright {
namespace {

using testing_util::EngineSetup;
using testing_util::MakeEngine;
using testing_util::ParitySetup;
using testing_util::Tiny;

constexpr int kSteps = 2;

// A bucket per layer with parameters (bucket_bytes = 1), so each stage has several.
EngineSetup BucketSetup(int pp, int dp, int zero = 0) {
  EngineSetup o = ParitySetup(pp, dp, ScheduleKind::k1F1B, 1, Recompute::kNone, 4, kSteps);
  o.train.bucket_bytes = 1;
  o.train.zero = zero;
  return o;
}

// Per virtual stage: its layers with parameters, i.e. its buckets at bucket_bytes = 1.
std::vector<int> BucketsPerStage(const LayerGraph& g, const Engine& e) {
  const std::vector<int>& b = e.stage_boundaries();
  std::vector<int> out;
  for (size_t s = 0; s + 1 < b.size(); ++s) {
    int n = 0;
    for (int i = b[s]; i < b[s + 1]; ++i) n += g.node(i).cost.params > 0 ? 1 : 0;
    out.push_back(n);
  }
  return out;
}

double Sum(const std::vector<RankEvent>& events, EventKind kind) {
  double s = 0;
  for (const RankEvent& e : events) s += e.kind == kind ? e.end - e.start : 0;
  return s;
}

// dp = 2: every rank has, per step, one all-reduce span per bucket of its stage, at least one
// posted before its last backward of the step ended; the spans count in no time category; the
// trace shows them on the replica's bucket track(s), each track's slices never overlapping.
TEST(EngineBucketTrace, EveryBucketOnItsTrackOverlappingTheBackward) {
  const LayerGraph g = Tiny();
  auto e = MakeEngine(g, BucketSetup(2, 2));
  ASSERT_TRUE(e.ok()) << e.status();
  for (int i = 0; i < kSteps; ++i) ASSERT_TRUE((*e)->Step().ok());
  const Engine& engine = **e;
  const Topology& topo = engine.topology();
  const std::vector<int> buckets = BucketsPerStage(g, engine);
  const std::vector<std::vector<RankEvent>> events = engine.Events();
  ASSERT_EQ(events.size(), 4u);
  int total = 0;
  for (size_t r = 0; r < events.size(); ++r) {
    const int stage = topo.PipelineRank(static_cast<int>(r));  // pp = 2, one stage per rank
    ASSERT_GE(buckets[stage], 2) << "the test wants several buckets per stage";
    for (int step = 0; step < kSteps; ++step) {
      std::map<int64_t, int> seen;  // bucket -> spans
      double first_post = 1e300, last_backward_end = -1;
      for (const RankEvent& ev : events[r]) {
        if (ev.step != step) continue;
        if (ev.kind == EventKind::kCompute && ev.action.kind == ActionKind::kB) {
          last_backward_end = std::max(last_backward_end, ev.end);
        }
        if (ev.kind != EventKind::kBucket) continue;
        ++total;
        ++seen[ev.tag];
        EXPECT_EQ(ev.collective, BucketCollective::kAllReduce);
        EXPECT_EQ(ev.action.kind, ActionKind::kReduceGrads);
        EXPECT_EQ(ev.action.virtual_stage, stage);
        EXPECT_LE(ev.start, ev.end);
        first_post = std::min(first_post, ev.start);
      }
      ASSERT_EQ(seen.size(), static_cast<size_t>(buckets[stage])) << "rank " << r;
      for (const auto& [b, n] : seen) {
        EXPECT_GE(b, 0);
        EXPECT_LT(b, buckets[stage]);
        EXPECT_EQ(n, 1) << "rank " << r << " step " << step << " bucket " << b;
      }
      // Posted during the backward, not at the step's end.
      EXPECT_LT(first_post, last_backward_end) << "rank " << r << " step " << step;
    }
    // Engine::Events' order: by start.
    EXPECT_TRUE(
        std::is_sorted(events[r].begin(), events[r].end(),
                       [](const RankEvent& a, const RankEvent& b) { return a.start < b.start; }));
  }

  // The time categories are what they were: the other events' sums, and with idle the wall.
  const RunSummary s = engine.Summary();
  ASSERT_EQ(s.ranks.size(), 4u);
  for (const RankTimes& t : s.ranks) {
    const std::vector<RankEvent>& ev = events[t.global_rank];
    EXPECT_NEAR(t.compute, Sum(ev, EventKind::kCompute), 1e-9);
    EXPECT_NEAR(t.all_reduce, Sum(ev, EventKind::kAllReduce), 1e-9);
    EXPECT_NEAR(t.compute + t.recompute + t.p2p_wait + t.all_reduce + t.agreement + t.optimizer +
                    t.data_wait + t.idle,
                t.wall, 1e-9);
  }

  // The trace: each rank's spans on its replica's bucket track(s), named by bucket and stage.
  const nlohmann::json j = nlohmann::json::parse(EngineChromeTrace(topo, events), nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  std::map<std::pair<int, int>, std::string> thread_names;  // (pid, tid) -> name
  for (const auto& ev : j["traceEvents"]) {
    if (ev["ph"] == "M" && ev["name"] == "thread_name") {
      thread_names[{ev["pid"].get<int>(), ev["tid"].get<int>()}] =
          ev["args"]["name"].get<std::string>();
    }
  }
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> slices;  // per track
  std::map<std::tuple<int, int64_t, int64_t>, int> per_bucket;  // (rank, step, bucket) -> spans
  int bucket_slices = 0, other_slices = 0, other_events = 0;
  for (const auto& ev : j["traceEvents"]) {
    if (ev["ph"] != "X") continue;
    const int pid = ev["pid"].get<int>(), tid = ev["tid"].get<int>();
    const int rank = ev["args"]["global_rank"].get<int>();
    const int replica = topo.Replica(rank);
    if (ev["cat"] != "bucket") {
      ++other_slices;
      EXPECT_EQ(tid, replica);  // everything else stays on the replica's thread
      continue;
    }
    ++bucket_slices;
    const std::string& track = thread_names[{pid, tid}];
    EXPECT_EQ(track.rfind(absl::StrCat("replica ", replica, ": gradient buckets"), 0), 0u) << track;
    EXPECT_NE(tid, replica);
    const int64_t bucket = ev["args"]["bucket"].get<int64_t>();
    EXPECT_EQ(ev["name"], absl::StrCat("bucket ", bucket, " of stage ", pid, " all-reduce"));
    ++per_bucket[{rank, ev["args"]["step"].get<int64_t>(), bucket}];
    const double ts = ev["ts"].get<double>();
    slices[{pid, tid}].push_back({ts, ts + ev["dur"].get<double>()});
  }
  for (const auto& ev : events) {
    for (const RankEvent& x : ev) other_events += x.kind != EventKind::kBucket ? 1 : 0;
  }
  EXPECT_EQ(bucket_slices, total);
  EXPECT_EQ(other_slices, other_events);
  for (const auto& [key, n] : per_bucket) EXPECT_EQ(n, 1);
  for (int p = 0; p < topo.pp; ++p) {
    for (int d = 0; d < topo.dp; ++d) {
      EXPECT_EQ(thread_names[std::make_pair(p, d)], absl::StrCat("replica ", d));
      EXPECT_EQ(thread_names[std::make_pair(p, topo.dp + d)],
                absl::StrCat("replica ", d, ": gradient buckets"));
    }
  }
  for (auto& [track, v] : slices) {  // a thread's slices must nest: these never overlap
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i) EXPECT_LE(v[i - 1].second, v[i].first);
  }
}

// ZeRO-1 reduce-scatters each bucket: its spans say so.
TEST(EngineBucketTrace, ZeroReduceScattersEachBucket) {
  const LayerGraph g = Tiny();
  auto e = MakeEngine(g, BucketSetup(2, 2, /*zero=*/1));
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE((*e)->Step().ok());
  const std::vector<int> buckets = BucketsPerStage(g, **e);
  const std::vector<std::vector<RankEvent>> events = (*e)->Events();
  for (size_t r = 0; r < events.size(); ++r) {
    std::set<int64_t> seen;
    for (const RankEvent& ev : events[r]) {
      if (ev.kind != EventKind::kBucket) continue;
      EXPECT_EQ(ev.collective, BucketCollective::kReduceScatter);
      EXPECT_TRUE(seen.insert(ev.tag).second) << "bucket " << ev.tag << " twice";
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(buckets[(*e)->topology().PipelineRank(r)]));
  }
  const std::string trace = EngineChromeTrace((*e)->topology(), events);
  EXPECT_NE(trace.find("of stage 1 reduce-scatter"), std::string::npos);
}

// dp = 1: nothing to reduce, no spans, no bucket track; the trace is what it always was.
TEST(EngineBucketTrace, NoSpansWithoutReplicas) {
  auto e = MakeEngine(Tiny(), BucketSetup(2, 1));
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE((*e)->Step().ok());
  for (const std::vector<RankEvent>& ev : (*e)->Events()) {
    for (const RankEvent& x : ev) EXPECT_NE(x.kind, EventKind::kBucket);
  }
  const std::string trace = EngineChromeTrace((*e)->topology(), (*e)->Events());
  EXPECT_EQ(trace.find("gradient buckets"), std::string::npos);
  EXPECT_EQ(trace.find("\"bucket\""), std::string::npos);
  EXPECT_EQ(trace.find("thread_sort_index"), std::string::npos);
}

}  // namespace
}  // namespace pipewright
