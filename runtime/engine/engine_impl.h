// Engine::Impl (internal): what one engine holds — the run, the ranks this process runs, and the
// step counters — shared by engine.cc and reports.cc.
#ifndef PIPEWRIGHT_RUNTIME_ENGINE_ENGINE_IMPL_H_
#define PIPEWRIGHT_RUNTIME_ENGINE_ENGINE_IMPL_H_

#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/engine.h"
#include "pipewright/train_testing.h"
#include "runtime/engine/rank_executor.h"

namespace pipewright {

struct Engine::Impl {
  LayerGraph graph;
  RunSpec run;
  TrainOptions options;
  TrainTestingHooks testing;  // Engine::SetTestingHooks
  std::shared_ptr<const Dataset> data;
  internal::RunContext ctx;  // points into the members above
  LrSchedule lr;
  // Before the ranks: it may hold the communicator a launcher world was bootstrapped through,
  // which must outlive the ranks' own.
  std::unique_ptr<World> world;
  std::vector<std::unique_ptr<internal::RankExecutor>> ranks;
  int threads_per_rank = 1;  // resolved TrainOptions::threads_per_rank (engine.cc)
  int64_t step = 0;
  absl::Status failed;
  double wall = 0;
  int64_t steps_run = 0;
  // Multi-process: GatherReports fills the world's reports.
  bool gathered = false;
  std::vector<RankTimes> gathered_times;                // by global rank
  std::vector<std::vector<RankEvent>> gathered_events;  // by global rank

  internal::RankExecutor* Find(int global) const;

  // Runs fn(rank) on one thread per rank, with the rank's kernel threads current there, and
  // returns the first error (the world's abort status when a rank aborted).
  template <typename Fn>
  absl::Status OnEveryRank(Fn fn) {
    std::vector<absl::Status> status(ranks.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ranks.size(); ++i) {
      threads.emplace_back([&, i] {
        cpu::ScopedCurrentPool pool(ranks[i]->pool());
        try {
          status[i] = ranks[i]->BindDevice();
          if (status[i].ok()) status[i] = fn(*ranks[i]);
        } catch (const std::exception& e) {
          status[i] = absl::InternalError(absl::StrCat(ranks[i]->Who(), ": exception: ", e.what()));
        }
        if (!status[i].ok()) ranks[i]->world()->Abort(status[i]);
      });
    }
    for (std::thread& t : threads) t.join();
    absl::Status first = ranks[0]->world()->abort_status();
    if (!first.ok()) return first;
    for (const absl::Status& s : status) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
};

}  // namespace pipewright

#endif  // PIPEWRIGHT_RUNTIME_ENGINE_ENGINE_IMPL_H_
