// Training data: byte-level tokens (vocabulary 256) and a deterministic synthetic task, and a
// loader thread that prefetches whole steps.
//
// Global sample i depends only on (dataset, seed, i) — never on the batch layout — so runs with
// different pipeline depths, schedules or micro-batchings see the same global batches. A sample
// is seq_len + 1 tokens: inputs are tokens [0, seq_len), targets tokens [1, seq_len].
#ifndef PIPEWRIGHT_DATA_H_
#define PIPEWRIGHT_DATA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "pipewright/tensor.h"

namespace pipewright {

class Dataset {
 public:
  virtual ~Dataset() = default;
  // "synthetic" or "text:<path> (<n> bytes)"
  virtual std::string Describe() const = 0;
  // Writes seq_len + 1 tokens of global sample `index` (>= 0) into `out`.
  virtual void Sample(int64_t index, int64_t seq_len, int32_t* out) const = 0;
};

// Byte-level text: sample i is the window of seq_len + 1 bytes at a position drawn from
// (seed, i). Errors when the file is missing, unreadable or shorter than seq_len + 2 bytes.
absl::StatusOr<std::unique_ptr<Dataset>> OpenTextDataset(const std::string& path, int64_t seq_len,
                                                         uint64_t seed);
// Repeated patterns (docs/data.md): sample i repeats a random pattern of 2..8 letters drawn
// from 'a'..'p'. After one period every token is predictable, so a small attention model can
// drive the loss far below the ln(16) of guessing.
std::unique_ptr<Dataset> SyntheticDataset(uint64_t seed);
// "synthetic" or a path to a text file.
absl::StatusOr<std::unique_ptr<Dataset>> OpenDataset(absl::string_view spec, int64_t seq_len,
                                                     uint64_t seed);

struct BatchLayout {
  int64_t micro_batches = 1;     // per replica
  int64_t micro_batch_size = 1;  // sequences per micro-batch
  int64_t seq_len = 1;
  int64_t replicas = 1;  // data-parallel width
  int64_t global_batch() const { return micro_batches * micro_batch_size * replicas; }
  // Global sample index of sequence `b` of micro-batch `j` of replica `r` at `step`.
  int64_t SampleIndex(int64_t step, int64_t r, int64_t j, int64_t b) const {
    return step * global_batch() + (r * micro_batches + j) * micro_batch_size + b;
  }
};

// One replica's micro-batches for one step: inputs and targets are [B, T] i32.
struct StepBatch {
  int64_t step = 0;
  std::vector<Tensor> inputs, targets;
};

// Builds one step's batch for `replica` (synchronously).
StepBatch MakeStepBatch(const Dataset& data, const BatchLayout& layout, int64_t step,
                        int64_t replica);

// A background thread that builds step batches ahead of use (bounded queue of `prefetch`).
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> data, BatchLayout layout, int64_t replica,
             int64_t first_step, int prefetch = 2);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  // The next step's batch, waiting for the loader thread if it is behind.
  StepBatch Next();
  // Total time Next() spent waiting for data.
  absl::Duration wait_time() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace pipewright

#endif  // PIPEWRIGHT_DATA_H_
