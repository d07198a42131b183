// What the engine reports: event names, the world's rank times and events gathered from every
// process, and the run summary with the simulator's prediction (engine.h).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/simulator.h"
#include "runtime/engine/engine_impl.h"

namespace pipewright {
namespace {

using json = nlohmann::json;

json TimesToJson(const RankTimes& t) {
  return {{"global_rank", t.global_rank},
          {"pipeline_rank", t.pipeline_rank},
          {"replica", t.replica},
          {"tensor_rank", t.tensor_rank},
          {"threads", t.threads},
          {"compute", t.compute},
          {"tensor_parallel", t.tensor_parallel},
          {"recompute", t.recompute},
          {"p2p_wait", t.p2p_wait},
          {"all_reduce", t.all_reduce},
          {"agreement", t.agreement},
          {"optimizer", t.optimizer},
          {"data_wait", t.data_wait},
          {"idle", t.idle},
          {"wall", t.wall},
          {"peak_memory_bytes", t.peak_memory_bytes},
          {"peak_activation_bytes", t.peak_activation_bytes},
          {"static_memory_bytes", t.static_memory_bytes},
          {"optimizer_state_bytes", t.optimizer_state_bytes},
          {"gradient_bytes", t.gradient_bytes},
          {"grad_bytes_sent", t.grad_bytes_sent},
          {"grad_bytes_uncompressed", t.grad_bytes_uncompressed},
          {"stages", t.stages},
          {"stage_f", t.stage_f},
          {"stage_b", t.stage_b},
          {"stage_w", t.stage_w}};
}

RankTimes TimesFromJson(const json& j) {
  RankTimes t;
  t.global_rank = j.at("global_rank").get<int>();
  t.pipeline_rank = j.at("pipeline_rank").get<int>();
  t.replica = j.at("replica").get<int>();
  t.tensor_rank = j.at("tensor_rank").get<int>();
  t.threads = j.at("threads").get<int>();
  t.compute = j.at("compute").get<double>();
  t.tensor_parallel = j.at("tensor_parallel").get<double>();
  t.recompute = j.at("recompute").get<double>();
  t.p2p_wait = j.at("p2p_wait").get<double>();
  t.all_reduce = j.at("all_reduce").get<double>();
  t.agreement = j.at("agreement").get<double>();
  t.optimizer = j.at("optimizer").get<double>();
  t.data_wait = j.at("data_wait").get<double>();
  t.idle = j.at("idle").get<double>();
  t.wall = j.at("wall").get<double>();
  t.peak_memory_bytes = j.at("peak_memory_bytes").get<int64_t>();
  t.peak_activation_bytes = j.at("peak_activation_bytes").get<int64_t>();
  t.static_memory_bytes = j.at("static_memory_bytes").get<int64_t>();
  t.optimizer_state_bytes = j.at("optimizer_state_bytes").get<int64_t>();
  t.gradient_bytes = j.at("gradient_bytes").get<int64_t>();
  t.grad_bytes_sent = j.at("grad_bytes_sent").get<int64_t>();
  t.grad_bytes_uncompressed = j.at("grad_bytes_uncompressed").get<int64_t>();
  t.stages = j.at("stages").get<std::vector<int>>();
  t.stage_f = j.at("stage_f").get<std::vector<double>>();
  t.stage_b = j.at("stage_b").get<std::vector<double>>();
  t.stage_w = j.at("stage_w").get<std::vector<double>>();
  return t;
}

// An event as [kind, action kind, stage, micro-batch, peer, tag, step, start, end, collective].
json EventToJson(const RankEvent& e) {
  return json::array({static_cast<int>(e.kind), static_cast<int>(e.action.kind),
                      e.action.virtual_stage, e.action.micro_batch, e.peer, e.tag, e.step, e.start,
                      e.end, static_cast<int>(e.collective)});
}

RankEvent EventFromJson(const json& j) {
  RankEvent e;
  e.kind = static_cast<EventKind>(j.at(0).get<int>());
  e.action =
      Action{static_cast<ActionKind>(j.at(1).get<int>()), j.at(2).get<int>(), j.at(3).get<int>()};
  e.peer = j.at(4).get<int>();
  e.tag = j.at(5).get<int64_t>();
  e.step = j.at(6).get<int64_t>();
  e.start = j.at(7).get<double>();
  e.end = j.at(8).get<double>();
  e.collective = static_cast<BucketCollective>(j.at(9).get<int>());
  return e;
}

}  // namespace

const char* EventKindName(EventKind k) {
  switch (k) {
    case EventKind::kCompute:
      return "compute";
    case EventKind::kRecompute:
      return "recompute";
    case EventKind::kSend:
      return "send";
    case EventKind::kRecvWait:
      return "recv wait";
    case EventKind::kAllReduce:
      return "all-reduce";
    case EventKind::kOptimizer:
      return "optimizer";
    case EventKind::kDataWait:
      return "data wait";
    case EventKind::kAgreement:
      return "agreement";
    case EventKind::kBucket:
      return "bucket";
  }
  return "?";
}

const char* BucketCollectiveName(BucketCollective c) {
  switch (c) {
    case BucketCollective::kAllReduce:
      return "all-reduce";
    case BucketCollective::kAllGather:
      return "all-gather";
    case BucketCollective::kReduceScatter:
      return "reduce-scatter";
  }
  return "?";
}

absl::Status Engine::GatherReports() {
  Impl& m = *impl_;
  if (!m.world->multi_process()) return absl::OkStatus();
  internal::RankExecutor& r = *m.ranks[0];
  PW_RETURN_IF_ERROR(r.BindDevice());
  json mine = {{"times", TimesToJson(r.Totals())}, {"events", json::array()}};
  for (const RankEvent& e : r.events()) mine["events"].push_back(EventToJson(e));
  PW_ASSIGN_OR_RETURN(std::vector<std::string> all,
                      r.AllGatherBytes(mine.dump(), "gathering rank reports"));
  m.gathered_times.clear();
  m.gathered_events.clear();
  for (size_t g = 0; g < all.size(); ++g) {
    json j = json::parse(all[g], nullptr, /*allow_exceptions=*/false);
    try {
      if (j.is_discarded()) throw std::runtime_error("not JSON");
      m.gathered_times.push_back(TimesFromJson(j.at("times")));
      std::vector<RankEvent> events;
      for (const json& e : j.at("events")) events.push_back(EventFromJson(e));
      m.gathered_events.push_back(std::move(events));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("rank ", g, " sent a malformed report: ", e.what()));
    }
  }
  m.gathered = true;
  return absl::OkStatus();
}

std::vector<std::vector<RankEvent>> Engine::Events() const {
  if (impl_->gathered) return impl_->gathered_events;
  std::vector<std::vector<RankEvent>> out;
  for (const auto& r : impl_->ranks) out.push_back(r->events());
  return out;
}

RunSummary Engine::Summary() const {
  const Impl& m = *impl_;
  RunSummary s;
  s.steps = m.steps_run;
  s.wall_s = m.wall;
  s.measured_step_s = m.steps_run > 0 ? m.wall / m.steps_run : 0;
  const int S = m.run.num_stages();
  std::vector<double> f(S, 0), b(S, 0), w(S, 0);
  std::vector<int> n(S, 0);
  double busy = 0, walls = 0, optimizer = 0;
  std::vector<RankTimes> all = m.gathered_times;
  if (!m.gathered) {
    for (const auto& r : m.ranks) all.push_back(r->Totals());
  }
  for (RankTimes& t : all) {
    for (size_t i = 0; i < t.stages.size(); ++i) {
      f[t.stages[i]] += t.stage_f[i];
      b[t.stages[i]] += t.stage_b[i];
      w[t.stages[i]] += t.stage_w[i];
      ++n[t.stages[i]];
    }
    busy += t.compute + t.recompute + t.tensor_parallel + t.optimizer;
    walls += t.wall;
    optimizer = std::max(optimizer, m.steps_run > 0 ? t.optimizer / m.steps_run : 0.0);
    s.ranks.push_back(std::move(t));
  }
  s.measured_bubble = walls > 0 ? std::max(0.0, 1.0 - busy / walls) : 0;
  // Bottleneck: the rank with the most compute; name the second cause when waiting dominates.
  double most = -1, mean_compute = 0;
  for (const RankTimes& t : s.ranks) {
    const double c = t.compute + t.recompute + t.tensor_parallel;  // the layers' passes
    mean_compute += c / s.ranks.size();
    if (c > most) {
      most = c;
      s.bottleneck_rank = t.global_rank;
    }
  }
  if (m.steps_run == 0) return s;
  const RankTimes* bt = &s.ranks[0];
  for (const RankTimes& t : s.ranks) {
    if (t.global_rank == s.bottleneck_rank) bt = &t;
  }
  s.bottleneck_reason = absl::StrFormat(
      "rank %d computes %.1f ms per step%s (mean over ranks %.1f ms); it waits %.1f ms on P2P, "
      "%.1f ms on all-reduce, %.1f ms on the step agreement, %.1f ms on data",
      bt->global_rank, 1e3 * most / m.steps_run,
      bt->tensor_parallel > 0 ? absl::StrFormat(", %.1f ms of it in tensor-parallel collectives",
                                                1e3 * bt->tensor_parallel / m.steps_run)
                              : "",
      1e3 * mean_compute / m.steps_run, 1e3 * bt->p2p_wait / m.steps_run,
      1e3 * bt->all_reduce / m.steps_run, 1e3 * bt->agreement / m.steps_run,
      1e3 * bt->data_wait / m.steps_run);
  SimCosts costs;
  for (int st = 0; st < S; ++st) {
    costs.stage_f.push_back(n[st] ? f[st] / n[st] : 0);
    costs.stage_b.push_back(n[st] ? b[st] / n[st] : 0);
    costs.stage_w.push_back(n[st] ? w[st] / n[st] : 0);
  }
  costs.optimizer_time = optimizer;
  absl::StatusOr<SimResult> sim = Simulate(m.run.schedule, costs);
  if (sim.ok()) {
    s.predicted_step_s = sim->makespan;
    s.predicted_bubble = sim->bubble_fraction;
  }
  return s;
}

namespace {

// One line for stderr: where the rank is now, from its flight record.
std::string FlightLine(const internal::RankExecutor& r,
                       const std::vector<internal::FlightEntry>& entries, double now) {
  std::string who = absl::StrCat("flight: rank ", r.global(), " (pipeline rank ", r.pipe(),
                                 ", replica ", r.replica(), "): ");
  if (entries.empty()) return who + "no action begun yet";
  const internal::FlightEntry& e = entries.back();
  if (e.end_s >= 0) {
    return absl::StrFormat("%sidle for %.2fs after %s (step %d)", who, now - e.end_s, e.action,
                           e.step);
  }
  std::string line =
      absl::StrFormat("%sstep %d, in %s for %.2fs", who, e.step, e.action, now - e.start_s);
  if (e.wait_since_s >= 0) {
    absl::StrAppend(
        &line, absl::StrFormat(", waiting on %s for %.2fs", e.waiting_on, now - e.wait_since_s));
  } else if (!e.waiting_on.empty()) {
    absl::StrAppend(&line, ", after waiting on ", e.waiting_on);
  }
  if (e.peer >= 0) {
    absl::StrAppend(&line,
                    absl::StrFormat(" (peer rank %d, tag %d, %d bytes)", e.peer, e.tag, e.bytes));
  }
  return line;
}

}  // namespace

absl::Status Engine::DumpFlightRecords(const std::string& dir) const {
  const Impl& m = *impl_;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("flight recorder: cannot create '", dir, "': ", ec.message()));
  }
  absl::Status first = absl::OkStatus();
  for (const auto& rp : m.ranks) {
    const internal::RankExecutor& r = *rp;
    const double now = r.Now();
    const std::vector<internal::FlightEntry> entries = r.flight().Snapshot();
    json j = {
        {"rank", r.global()}, {"pipeline_rank", r.pipe()},           {"replica", r.replica()},
        {"now_s", now},       {"actions_begun", r.flight().count()}, {"entries", json::array()}};
    for (const internal::FlightEntry& e : entries) {
      json x = {{"step", e.step}, {"action", e.action}, {"start_s", e.start_s}};
      x["end_s"] = e.end_s >= 0 ? json(e.end_s) : json(nullptr);
      if (!e.waiting_on.empty()) x["waiting_on"] = e.waiting_on;
      if (e.wait_since_s >= 0) x["waiting_for_s"] = now - e.wait_since_s;
      if (e.peer >= 0) {
        x["peer"] = e.peer;
        x["tag"] = e.tag;
        x["bytes"] = e.bytes;
      }
      j["entries"].push_back(std::move(x));
    }
    const std::string path = absl::StrCat(dir, "/flight-rank-", r.global(), ".json");
    std::ofstream out(path, std::ios::trunc);
    out << j.dump(1) << "\n";
    out.close();
    if (!out && first.ok()) {
      first = absl::InternalError(absl::StrCat("flight recorder: cannot write '", path, "'"));
    }
    std::fprintf(stderr, "%s [%s]\n", FlightLine(r, entries, now).c_str(), path.c_str());
  }
  return first;
}

}  // namespace pipewright
