#include "pipewright/trace.h"

#include <algorithm>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

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
                                 e.kind == EventKind::kAllReduce
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
  SimResult r;
  r.ranks.resize(topology.pp);
  double t0 = std::numeric_limits<double>::infinity(), t1 = 0;
  for (int p = 0; p < topology.pp; ++p) {
    int g = topology.GlobalRank(p, replica);
    if (g >= static_cast<int>(events.size())) continue;
    for (const RankEvent& e : events[g]) {
      if (e.step != step || e.kind != EventKind::kCompute) continue;
      t0 = std::min(t0, e.start);
      t1 = std::max(t1, e.end);
    }
  }
  if (!(t1 > t0)) return r;
  double busy = 0;
  for (int p = 0; p < topology.pp; ++p) {
    int g = topology.GlobalRank(p, replica);
    if (g >= static_cast<int>(events.size())) continue;
    for (const RankEvent& e : events[g]) {
      if (e.step != step || e.kind != EventKind::kCompute) continue;
      r.timeline.push_back({p, e.action, e.start - t0, e.end - t0});
      r.ranks[p].busy += e.end - e.start;
    }
    busy += r.ranks[p].busy;
  }
  r.makespan = t1 - t0;
  r.bubble_fraction = 1.0 - busy / (topology.pp * r.makespan);
  (void)schedule;
  return r;
}

}  // namespace pipewright
