// What `pipewright train` prints: the header, and the summary with per-rank times and the plan's
// predictions beside the measurements (text or JSON).
#ifndef PIPEWRIGHT_TOOLS_TRAIN_REPORT_H_
#define PIPEWRIGHT_TOOLS_TRAIN_REPORT_H_

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "pipewright/engine.h"
#include "pipewright/plan.h"

namespace pipewright::tools {

// What the steps of one run gave.
struct RunRecord {
  std::vector<double> losses;
  double total_time = 0, data_wait = 0, wall_s = 0;
  int64_t skipped_steps = 0, first_step = 0;
  int64_t saved_step = -1;  // the last step a checkpoint was saved after (-1: none yet)
  bool stopped = false;     // a stop request (a preemption signal) ended the run early
  float last_loss_scale = 0;
  absl::Status failure;
  void Add(const StepResult& r) {
    losses.push_back(r.loss);
    skipped_steps += r.skipped ? 1 : 0;
    last_loss_scale = r.loss_scale;
    total_time += r.step_time_s;
    data_wait += r.data_wait_s;
  }
};

// "gpt2-124m (16 layers, 124.48M parameters (tied)), data …", the layout, the batch, then the
// precision and the data-parallel mode. Parameters are counted once where tied (as `model`).
void PrintHeader(const LayerGraph& graph, const Engine& engine, const TrainOptions& options,
                 const std::string& data);

struct ReportInput {
  const LayerGraph* graph = nullptr;
  const Engine* engine = nullptr;
  const Plan* plan = nullptr;  // when the run came from a plan
  const RunRecord* record = nullptr;
  Precision precision = Precision::kFp32;
  GradCompression grad_compression;
  int zero = 0;                        // TrainOptions::zero
  const AsyncReport* async = nullptr;  // --dp-mode async
  int staleness = 0;
  std::string plan_file, trace, svg, checkpoint;
};
// The final summary: `{"summary": ...}` with --json, else a paragraph and the rank table;
// returns the summary (the JSON form) either way.
nlohmann::json PrintSummary(const ReportInput& in, bool as_json);

}  // namespace pipewright::tools

#endif  // PIPEWRIGHT_TOOLS_TRAIN_REPORT_H_
