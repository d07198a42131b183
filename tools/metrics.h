// `train --metrics FILE.csv` and `pipewright plot`: one CSV row per step, and the SVG drawn from
// such a file.
#ifndef PIPEWRIGHT_TOOLS_METRICS_H_
#define PIPEWRIGHT_TOOLS_METRICS_H_

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/train.h"

namespace pipewright::tools {

// The columns, in order.
inline constexpr const char* kMetricsHeader =
    "step,loss,lr,grad_norm,step_time_s,samples_per_s,tokens_per_s,peak_memory_bytes,loss_scale,"
    "skipped,eval_loss,model_tflops_per_s,mfu";

// Writes FILE.csv as the run goes: the header, then a row per step, flushed at once so a killed
// run keeps every finished step. A failed write is reported once on stderr and ends the file's
// writing, never the run.
class MetricsCsv {
 public:
  // Replaces `path` (refused like any output: a FIFO, a directory; CheckOutputPath).
  // `model_flops_per_sample`: forward + backward FLOPs of one sequence (recomputation not
  // counted: model FLOPs); `peak_flops`: what all the run's devices together can do (mfu, the
  // model FLOPs utilization, is model_tflops_per_s over it; 0: unknown, mfu left empty).
  static absl::StatusOr<std::unique_ptr<MetricsCsv>> Open(const std::string& path,
                                                          double model_flops_per_sample = 0,
                                                          double peak_flops = 0);
  // eval_loss: NaN (an empty field) unless the step was evaluated (--eval-every).
  void Add(const StepResult& r, int64_t tokens_per_sample, int64_t peak_memory_bytes,
           double eval_loss);

 private:
  std::string path_;
  std::ofstream out_;
  double model_flops_per_sample_ = 0, peak_flops_ = 0;
  bool failed_ = false;
};

// A metrics file read back: its columns by name, each with one value per row.
struct MetricsTable {
  std::vector<std::string> columns;
  std::vector<std::vector<double>> values;  // [column][row]
  const std::vector<double>* Column(const std::string& name) const;
};
// Parses a CSV of numbers with a header line (`what` names it in errors): every row as many
// fields as the header, each a finite number or empty (read as NaN and not drawn).
absl::StatusOr<MetricsTable> ParseMetricsCsv(const std::string& text, const std::string& what);

// An SVG of loss, learning rate and throughput against the step, one panel each (columns that
// are missing or have no finite value are left out).
std::string PlotMetricsSvg(const MetricsTable& table, const std::string& title);

}  // namespace pipewright::tools

#endif  // PIPEWRIGHT_TOOLS_METRICS_H_
