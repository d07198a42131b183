// `pipewright train`'s flags (train_flags.cc registers them) and the run they describe
// (RunTrain, train_cmd.cc).
#ifndef PIPEWRIGHT_TOOLS_TRAIN_FLAGS_H_
#define PIPEWRIGHT_TOOLS_TRAIN_FLAGS_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pipewright::tools {

struct TrainFlags {
  std::string preset = "gpt-tiny";
  int pp = 1, dp = 1, tp = 1, chunks = 1, threads_per_rank = 0;
  bool sequence_parallel = false;
  std::string schedule = "1f1b", recompute = "none", plan, program, trace, svg;
  double timeout_s = 60, bucket_mb = 1;
  int64_t micro_batches = 4, micro_batch_size = 0, steps = 60, warmup = 5, base_batch = 32;
  int64_t stop_after = 0;
  int64_t log_every = 0;
  std::string metrics;     // --metrics FILE.csv
  double peak_tflops = 0;  // --peak-tflops: one device's (rank's) peak, for the CSV's mfu
  std::string valid_data;  // --valid-data: held-out data evaluated during the run
  int64_t eval_every = 0, eval_batches = 4;
  std::string split;          // --split 3,6: the first layer of every stage but the first
  std::string calibrate_out;  // --calibrate-out MODEL.json: the model's costs, as measured
  int64_t save_every = 0;     // steps between periodic checkpoints (0: only at the end)
  int keep = 0;               // step checkpoints kept (0: all)
  std::string flight_dir;     // where flight records go (default: --save DIR, else .)
  uint64_t seed = 1;
  float lr = 3e-3f, clip = 1.0f, weight_decay = 0.1f, min_lr_ratio = 0.1f;
  std::string lr_scaling = "none", optimizer = "adamw", data = "synthetic";
  std::string device = "cpu", precision = "fp32", save, resume, comm = "auto";
  std::string grad_compression = "none";
  std::string dp_mode = "sync", slow_replica;  // slow_replica: "R:FACTOR"
  int staleness = 1;
  float loss_scale = 65536.0f;
  std::string inject_failure;  // "RANK:STEP", tests of failure handling
  int64_t loss_scale_window = 1000;
  int data_workers = 1;
  int tied = -1;              // --tied 0|1: the LM head tied to the embedding (-1: the preset's)
  int zero = -1;              // --zero 0|1|2 (-1: the plan's, else 0)
  int zero_buffers = 2;       // --zero-buffers 1|2
  int64_t data_delay_us = 0;  // benchmark-only: an artificially slow data source
  bool json = false;
  std::set<std::string> given;  // flags the user gave explicitly
};

// The presets small enough to instantiate and train on this machine; the analytic giants
// (gpt3-175b, megatron-*) are for `pipewright model` and `plan` only.
const std::vector<std::string>& TrainablePresets();

// Runs `pipewright train` with these flags (train_cmd.cc).
absl::Status RunTrain(const TrainFlags& flags);
// Whether this process is the run's root: true until RunTrain has launched the world.
bool TrainRootProcess();

}  // namespace pipewright::tools

#endif  // PIPEWRIGHT_TOOLS_TRAIN_FLAGS_H_
