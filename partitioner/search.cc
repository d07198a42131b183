// Plan search: every pp x dp = devices, micro-batch size and schedule, each partitioned
// optimally (partition.cc), ranked by predicted step time.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "partitioner/partition_internal.h"
#include "pipewright/host.h"
#include "pipewright/partitioner.h"
#include "pipewright/status.h"

namespace pipewright {
namespace {

struct Choice {
  ScheduleKind kind;
  int chunks;
};

std::vector<Choice> Schedules(const SearchOptions& o, int pp) {
  std::vector<Choice> all;
  if (o.schedule) {
    const int v = o.chunks.value_or(
        *o.schedule == ScheduleKind::kInterleaved || IsVShaped(*o.schedule) ? 2 : 1);
    all.push_back({*o.schedule, v});
    return all;
  }
  if (pp == 1) return {{ScheduleKind::k1F1B, 1}};  // one stage: every schedule is the same
  all = {{ScheduleKind::kGpipe, 1},
         {ScheduleKind::k1F1B, 1},
         {ScheduleKind::kInterleaved, o.chunks.value_or(2)},
         {ScheduleKind::kZbH1, 1},
         {ScheduleKind::kZbV, 2}};
  return all;
}

// The (tp, sequence_parallel) pairs to try: every divisor of the devices that the model and the
// node allow (or the fixed one), sequence parallelism off and on where tp >= 2 (or as fixed).
std::vector<std::pair<int, bool>> TensorParallelChoices(const ModelCosts& model,
                                                        const DeviceSpec& dev,
                                                        const SearchOptions& o) {
  std::vector<std::pair<int, bool>> out;
  for (int tp = 1; tp <= dev.count && tp <= std::max(1, dev.devices_per_node); ++tp) {
    if (dev.count % tp != 0 || (o.tp && *o.tp != tp)) continue;
    for (bool sp : {false, true}) {
      if (o.sequence_parallel && *o.sequence_parallel != sp) continue;
      if (CheckTensorParallel(model, dev, tp, sp).ok()) out.emplace_back(tp, sp);
    }
  }
  return out;
}

// One candidate configuration and what partitioning it gave.
struct Try {
  PartitionOptions options;
  absl::StatusOr<Plan> plan = absl::UnknownError("not evaluated");
  int64_t shortfall = 0;
};

// The candidates that share a schedule (tp, sp, pp, dp, b, schedule): the ZeRO stages tried.
struct Group {
  std::vector<Try> tries;
  int skips_before = 0;        // the search's skips with a reason before this group
  std::string schedule_error;  // GenerateSchedule's refusal
  bool ruled_out = false;      // more stages than layers or than a plan holds
};

}  // namespace

absl::StatusOr<SearchResult> SearchPlans(const ModelCosts& model, const DeviceSpec& dev,
                                         const SearchOptions& o) {
  if (dev.count < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceSpec.count = ", dev.count, ": must be >= 1"));
  }
  if (model.num_layers() < 1) return absl::InvalidArgumentError("the model has no layers");
  const int64_t G =
      o.global_batch > 0 ? o.global_batch : int64_t{dev.count} * model.micro_batch_size;
  if (o.keep < 1) return absl::InvalidArgumentError("keep must be >= 1");
  if (o.zero && (*o.zero < 0 || *o.zero > 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SearchOptions.zero = ", *o.zero, ": must be 0, 1 or 2"));
  }
  if (o.tp) {
    // A fixed degree is checked here, so that its error names what is wrong with it; searched
    // degrees that the model or node rule out are skipped.
    PW_RETURN_IF_ERROR(CheckTensorParallel(model, dev, *o.tp, o.sequence_parallel.value_or(false)));
    if (dev.count % *o.tp != 0) {
      return absl::InvalidArgumentError(absl::StrCat("SearchOptions.tp = ", *o.tp,
                                                     " does not divide the ", dev.count,
                                                     " devices (DeviceSpec.count)"));
    }
  }
  const std::vector<std::pair<int, bool>> tp_choices = TensorParallelChoices(model, dev, o);
  if (tp_choices.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SearchOptions.sequence_parallel needs a tensor-parallel degree >= 2, and none divides "
        "the ",
        dev.count, " devices, fits DeviceSpec.devices_per_node (", dev.devices_per_node,
        ") and splits ", model.name,
        model.transformer ? "" : " (its layer graph has no transformer shape)"));
  }
  // Enumerated in order, evaluated on several threads, then read back in the same order: the
  // result (and which error wins) is the sequential search's.
  std::vector<Group> groups;
  std::string last_invalid;  // the last reason for a skip, and how many there were
  int skips = 0;
  for (const auto& [tp, sp] : tp_choices)
    for (int pp = 1; pp <= dev.count / tp; ++pp) {
      if ((dev.count / tp) % pp != 0 || (o.pp && *o.pp != pp)) continue;
      const int dp = dev.count / tp / pp;
      if (o.dp && *o.dp != dp) continue;
      if (pp > model.num_layers()) continue;
      if (G % dp != 0) {
        last_invalid = absl::StrCat("the global batch ", G, " is not divisible by dp ", dp);
        ++skips;
        continue;
      }
      for (int64_t b = 1; b <= G / dp; ++b) {
        if ((G / dp) % b != 0 || (o.micro_batch_size && *o.micro_batch_size != b)) continue;
        const int64_t m = G / dp / b;
        if (m > (int64_t{1} << 20)) continue;
        for (const Choice& ch : Schedules(o, pp)) {
          Group g;
          g.skips_before = skips;
          for (int zero : {0, 1, 2}) {
            if (o.zero && *o.zero != zero) continue;
            if (zero >= 1 && dp < 2) {
              if (o.zero) {
                last_invalid = absl::StrCat("SearchOptions.zero = ", zero,
                                            " needs dp >= 2: it splits the optimizer state",
                                            zero == 2 ? " and the gradients" : "");
                ++skips;
              }
              continue;
            }
            PartitionOptions po;
            po.pp = pp;
            po.dp = dp;
            po.zero = zero;
            po.tp = tp;
            po.sequence_parallel = sp;
            po.schedule = ch.kind;
            po.chunks = ch.chunks;
            po.micro_batches = static_cast<int>(m);
            po.micro_batch_size = b;
            po.precision = o.precision;
            po.allow_recompute = o.allow_recompute;
            po.suggest = false;
            g.tries.push_back({po});
          }
          // A group without tries changes nothing but last_invalid, already set.
          if (!g.tries.empty()) groups.push_back(std::move(g));
        }
      }
    }

  // Each group's schedule is made once, for its ZeRO stages, and partitioned on a worker.
  auto evaluate = [&](Group& g) {
    const PartitionOptions& first = g.tries.front().options;
    absl::StatusOr<Schedule> sched =
        GenerateSchedule({first.schedule, first.pp, first.micro_batches, first.chunks});
    if (!sched.ok()) {
      g.schedule_error = std::string(sched.status().message());
      return;
    }
    // Configurations the schedule or the layer count rule out are not candidates.
    if (sched->num_stages > model.num_layers() || sched->num_stages > kMaxPlanStages) {
      g.ruled_out = true;
      return;
    }
    for (Try& t : g.tries)
      t.plan = internal::Partition(model, dev, t.options, &t.shortfall, &*sched);
  };
  const int workers = static_cast<int>(std::min<size_t>(
      groups.size(), static_cast<size_t>(o.threads > 0 ? o.threads : UsableCores())));
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < groups.size(); i = next++) evaluate(groups[i]);
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < workers; ++t) {
    try {
      threads.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads to be had (a process limit): the ones started share the rest
    }
  }
  work();
  for (std::thread& t : threads) t.join();

  SearchResult result;
  // Why each infeasible candidate did not fit, by shortfall in bytes.
  std::vector<std::pair<int64_t, std::string>> misses;
  for (Group& g : groups) {
    if (!g.schedule_error.empty() || g.ruled_out) continue;
    for (Try& t : g.tries) {
      const PartitionOptions& po = t.options;
      ++result.candidates;
      if (t.plan.ok()) {
        ++result.feasible;
        result.best.push_back(*std::move(t.plan));
      } else if (t.plan.status().code() == absl::StatusCode::kFailedPrecondition) {
        misses.emplace_back(
            t.shortfall,
            absl::StrCat("pp=", po.pp, " dp=", po.dp, po.tp > 1 ? absl::StrCat(" tp=", po.tp) : "",
                         po.sequence_parallel ? " sp" : "",
                         po.zero ? absl::StrCat(" zero=", po.zero) : "", " b=", po.micro_batch_size,
                         " m=", po.micro_batches, " ", ScheduleKindName(po.schedule), ": ",
                         t.plan.status().message()));
      } else {
        return t.plan.status();
      }
    }
  }
  // The last reason in the enumeration's order: a schedule's refusal unless a skip came after it.
  for (auto g = groups.rbegin(); g != groups.rend(); ++g) {
    if (g->schedule_error.empty()) continue;
    if (g->skips_before == skips) last_invalid = g->schedule_error;
    break;
  }
  if (result.best.empty()) {
    if (result.candidates == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "no pp x dp x tp x micro-batch x schedule combination is possible for ", dev.count,
          " devices, global batch ", G, " and ", model.num_layers(), " layers",
          last_invalid.empty() ? "" : absl::StrCat(" (", last_invalid, ")")));
    }
    std::sort(misses.begin(), misses.end());
    return absl::FailedPreconditionError(
        absl::StrCat("none of ", result.candidates, " configurations fits in memory; the closest, ",
                     misses.front().second,
                     ".\nwould fit: more devices or device memory, bf16/fp16, or a smaller "
                     "global batch"));
  }
  // Fastest first; step times within a millionth count as equal, and the plan using less
  // memory wins.
  std::stable_sort(result.best.begin(), result.best.end(), [](const Plan& a, const Plan& b) {
    const double ta = a.predicted.step_time_s, tb = b.predicted.step_time_s;
    if (std::abs(ta - tb) > 1e-6 * std::max(ta, tb)) return ta < tb;
    return a.predicted.peak_memory_bytes < b.predicted.peak_memory_bytes;
  });
  if (static_cast<int>(result.best.size()) > o.keep) result.best.resize(o.keep);
  std::sort(misses.begin(), misses.end());
  for (size_t i = 0; i < misses.size() && i < 3; ++i) result.infeasible.push_back(misses[i].second);
  return result;
}

}  // namespace pipewright
