// Hooks for tests and benchmarks of an Engine run: a straggler and an injected failure. They are
// not training settings (TrainOptions, train.h) and a production run leaves them at their
// defaults; Engine::SetTestingHooks installs them.
//
//   TrainTestingHooks hooks;
//   hooks.slow_replica = 1;  hooks.slow_factor = 2;  // replica 1 computes 2x slower
//   PW_RETURN_IF_ERROR(engine->SetTestingHooks(hooks));
#ifndef PIPEWRIGHT_TRAIN_TESTING_H_
#define PIPEWRIGHT_TRAIN_TESTING_H_

#include <cstdint>

#include "absl/status/status.h"

namespace pipewright {

struct TrainTestingHooks {
  // A straggler (benchmarks of asynchronous DP, tests of waits): replica `slow_replica` (-1:
  // none) sleeps slow_factor - 1 times the length of each of its compute intervals after it, so
  // it computes slow_factor times slower. slow_factor in [1, 1000].
  int slow_replica = -1;
  double slow_factor = 1.0;
  // Fault injection for tests of failure handling: global rank `inject_failure_rank` fails with
  // Internal "injected failure" at its first backward action of step `inject_failure_step`
  // (-1: never).
  int inject_failure_rank = -1;
  int64_t inject_failure_step = -1;
  // Mixed precision without the step's 16-bit weight copies: every use casts its master again
  // (Note [16-bit weights once a step] in layer.h; the test that the copies change no bit).
  bool half_weights_every_use = false;
};

// InvalidArgument naming the field (`TrainTestingHooks.slow_factor = 0.5: must be in [1,
// 1000]`) unless `hooks` is usable in a run of `data_parallel` replicas: slow_factor in
// [1, 1000], slow_replica -1 or a replica of the run.
absl::Status ValidateTrainTestingHooks(const TrainTestingHooks& hooks, int data_parallel);

}  // namespace pipewright

#endif  // PIPEWRIGHT_TRAIN_TESTING_H_
