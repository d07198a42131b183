#include "pipewright/trace.h"

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace pipewright {

using json = nlohmann::json;

namespace {

// Note [Bucket tracks]. A rank's bucket spans (EventKind::kBucket) overlap its compute, so they go
// on threads of their own below the rank's replica thread: "replica R: gradient buckets". They
// also overlap one another when several collectives are in flight at once, and the slices of one
// thread must nest (Perfetto drops the ones that do not), so the spans are dealt to lanes, each a
// thread: a span goes to the first lane whose last span has ended by its start; the second lane
// is "replica R: gradient buckets (lane 2)", and so on. Lane l of replica R is thread
// dp (l + 1) + R, and thread_sort_index metadata keeps each replica's lanes right below it.
void AppendBucketTracks(const Topology& topology, size_t g, const std::vector<RankEvent>& events,
                        json* trace) {
  std::vector<const RankEvent*> spans;
  for (const RankEvent& e : events) {
    if (e.kind == EventKind::kBucket) spans.push_back(&e);
  }
  if (spans.empty()) return;
  std::stable_sort(spans.begin(), spans.end(),
                   [](const RankEvent* a, const RankEvent* b) { return a->start < b->start; });
  const int pid = topology.PipelineRank(static_cast<int>(g));
  const int replica = topology.Replica(static_cast<int>(g));
  constexpr int kSortStride = 1 << 16;  // sort indices of one replica's threads
  std::vector<double> lane_end;         // per lane: the end of its last span
  for (const RankEvent* e : spans) {
    size_t lane = 0;
    while (lane < lane_end.size() && lane_end[lane] > e->start) ++lane;
    const int tid = topology.dp * (static_cast<int>(lane) + 1) + replica;
    if (lane == lane_end.size()) {
      lane_end.push_back(e->end);
      std::string name = absl::StrCat("replica ", replica, ": gradient buckets");
      if (lane > 0) absl::StrAppend(&name, " (lane ", lane + 1, ")");
      trace->push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", pid},
                        {"tid", tid},
                        {"args", {{"name", name}}}});
      trace->push_back(
          {{"ph", "M"},
           {"name", "thread_sort_index"},
           {"pid", pid},
           {"tid", tid},
           {"args", {{"sort_index", replica * kSortStride + 1 + static_cast<int>(lane)}}}});
      if (lane == 0) {
        trace->push_back({{"ph", "M"},
                          {"name", "thread_sort_index"},
                          {"pid", pid},
                          {"tid", replica},
                          {"args", {{"sort_index", replica * kSortStride}}}});
      }
    }
    lane_end[lane] = std::max(lane_end[lane], e->end);
    const char* collective = BucketCollectiveName(e->collective);
    trace->push_back({{"ph", "X"},
                      {"name", absl::StrCat("bucket ", e->tag, " of stage ",
                                            e->action.virtual_stage, " ", collective)},
                      {"cat", EventKindName(e->kind)},
                      {"pid", pid},
                      {"tid", tid},
                      {"ts", e->start * 1e6},
                      {"dur", std::max(0.0, e->end - e->start) * 1e6},
                      {"args",
                       {{"step", e->step},
                        {"global_rank", g},
                        {"stage", e->action.virtual_stage},
                        {"bucket", e->tag},
                        {"collective", collective}}}});
  }
}

}  // namespace

std::string EngineChromeTrace(const Topology& topology,
                              const std::vector<std::vector<RankEvent>>& events) {
  json trace = json::array();
  for (int p = 0; p < topology.pp; ++p) {
    trace.push_back({{"ph", "M"},
                     {"name", "process_name"},
                     {"pid", p},
                     {"args", {{"name", "pipeline rank " + std::to_string(p)}}}});
    for (int r = 0; r < topology.dp; ++r) {
      trace.push_back({{"ph", "M"},
                       {"name", "thread_name"},
                       {"pid", p},
                       {"tid", r},
                       {"args", {{"name", "replica " + std::to_string(r)}}}});
    }
  }
  // Flow ids pair the n-th send of (step, src, dst, tag) with the n-th receive of it.
  using Key = std::tuple<int64_t, int, int, int64_t>;
  std::map<Key, int64_t> ids;
  int64_t next_id = 1;
  auto flow_id = [&](const Key& k) {
    auto it = ids.find(k);
    if (it != ids.end()) return it->second;
    return ids[k] = next_id++;
  };
  for (size_t g = 0; g < events.size(); ++g) {
    const int pid = topology.PipelineRank(static_cast<int>(g));
    const int tid = topology.Replica(static_cast<int>(g));
    for (const RankEvent& e : events[g]) {
      if (e.kind == EventKind::kBucket) continue;  // on tracks of their own (AppendBucketTracks)
      std::string name = e.kind == EventKind::kCompute ? e.action.ToString()
                         : e.kind == EventKind::kDataWait || e.kind == EventKind::kOptimizer ||
                                 e.kind == EventKind::kAllReduce || e.kind == EventKind::kAgreement
                             ? std::string(EventKindName(e.kind))
                             : std::string(EventKindName(e.kind)) + " " + e.action.ToString();
      json ev = {{"ph", "X"},
                 {"name", name},
                 {"cat", EventKindName(e.kind)},
                 {"pid", pid},
                 {"tid", tid},
                 {"ts", e.start * 1e6},
                 {"dur", std::max(0.0, e.end - e.start) * 1e6},
                 {"args", {{"step", e.step}, {"global_rank", g}}}};
      if (e.peer >= 0) {
        ev["args"]["peer"] = e.peer;
        ev["args"]["tag"] = e.tag;
      }
      trace.push_back(ev);
      if (e.kind == EventKind::kSend) {
        trace.push_back({{"ph", "s"},
                         {"name", "p2p"},
                         {"cat", "p2p"},
                         {"id", flow_id({e.step, static_cast<int>(g), e.peer, e.tag})},
                         {"pid", pid},
                         {"tid", tid},
                         {"ts", e.start * 1e6}});
      } else if (e.kind == EventKind::kRecvWait) {
        trace.push_back({{"ph", "f"},
                         {"bp", "e"},
                         {"name", "p2p"},
                         {"cat", "p2p"},
                         {"id", flow_id({e.step, e.peer, static_cast<int>(g), e.tag})},
                         {"pid", pid},
                         {"tid", tid},
                         {"ts", e.end * 1e6}});
      }
    }
  }
  for (size_t g = 0; g < events.size(); ++g) AppendBucketTracks(topology, g, events[g], &trace);
  return json{{"traceEvents", trace}, {"displayTimeUnit", "ms"}}.dump();
}

SimResult MeasuredTimeline(const Schedule& schedule, const Topology& topology,
                           const std::vector<std::vector<RankEvent>>& events, int64_t step,
                           int replica) {
  (void)schedule;
  const int first = replica == kAllReplicas ? 0 : replica;
  const int last = replica == kAllReplicas ? topology.dp - 1 : replica;
  const int rows = (last - first + 1) * topology.pp;
  SimResult r;
  if (rows <= 0) return r;
  r.ranks.resize(rows);
  // Each (row, global rank) drawn; the rows in replica-major order.
  std::vector<std::pair<int, int>> drawn;
  for (int d = first; d <= last; ++d) {
    for (int p = 0; p < topology.pp; ++p) {
      const int g = topology.GlobalRank(p, d);
      if (g >= 0 && g < static_cast<int>(events.size())) {
        drawn.emplace_back((d - first) * topology.pp + p, g);
      }
    }
  }
  double t0 = std::numeric_limits<double>::infinity(), t1 = 0;
  for (const auto& [row, g] : drawn) {
    for (const RankEvent& e : events[g]) {
      if (e.step != step || e.kind != EventKind::kCompute) continue;
      t0 = std::min(t0, e.start);
      t1 = std::max(t1, e.end);
    }
  }
  if (!(t1 > t0)) return r;
  double busy = 0;
  for (const auto& [row, g] : drawn) {
    for (const RankEvent& e : events[g]) {
      if (e.step != step || e.kind != EventKind::kCompute) continue;
      r.timeline.push_back({row, e.action, e.start - t0, e.end - t0});
      r.ranks[row].busy += e.end - e.start;
    }
    busy += r.ranks[row].busy;
  }
  r.makespan = t1 - t0;
  r.bubble_fraction = 1.0 - busy / (rows * r.makespan);
  return r;
}

std::string MeasuredTimelineSvg(const Schedule& schedule, const Topology& topology,
                                const std::vector<std::vector<RankEvent>>& events, int64_t step) {
  SvgOptions o;
  for (int d = 0; d < topology.dp; ++d) {
    for (int p = 0; p < topology.pp; ++p) {
      o.row_labels.push_back(
          absl::StrCat("rank ", topology.GlobalRank(p, d), " (pp ", p, ", dp ", d, ")"));
    }
  }
  o.time_unit = "ms";
  o.unit_scale = 1e3;
  o.title = absl::StrCat("measured step ", step + 1, ": ", ScheduleKindName(schedule.spec.kind));
  return ToSvg(schedule, MeasuredTimeline(schedule, topology, events, step, kAllReplicas), o);
}

}  // namespace pipewright
