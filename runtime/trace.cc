#include "pipewright/trace.h"

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace pipewright {

using json = nlohmann::json;

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
