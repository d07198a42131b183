// A rank's flight recorder (docs/runtime.md, "Flight recorder"): the last actions the rank
// began, in a ring buffer, with what each waited on, so that a hang or a failure can be
// diagnosed from files instead of a debugger. Written by the rank's thread, read (Snapshot,
// Summary) from any thread, e.g. the CLI's SIGUSR2 watcher while the step still runs.
#ifndef PIPEWRIGHT_RUNTIME_ENGINE_FLIGHT_RECORDER_H_
#define PIPEWRIGHT_RUNTIME_ENGINE_FLIGHT_RECORDER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace pipewright::internal {

struct FlightEntry {
  int64_t step = -1;
  std::string action;      // "F3@s1", "RECV_F3@s1", "OPTIMIZER_STEP", ...
  double start_s = 0;      // seconds since the engine's epoch
  double end_s = -1;       // -1: still running
  std::string waiting_on;  // the wait in progress (or the last one), "" if none
  double wait_since_s = -1;
  int peer = -1;  // P2P: the other rank
  int64_t tag = -1;
  int64_t bytes = -1;
};

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity = 256) : capacity_(capacity) {}

  // A new entry (the oldest is dropped when full); the next calls describe it.
  void Begin(int64_t step, std::string action, double now_s);
  void Peer(int peer, int64_t tag, int64_t bytes);
  void Waiting(std::string what, double now_s);
  void DoneWaiting();
  void End(double now_s);

  // Oldest first.
  std::vector<FlightEntry> Snapshot() const;
  // Total entries begun (the ring holds the last `capacity`).
  int64_t count() const;

 private:
  FlightEntry* Current() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::vector<FlightEntry> ring_ ABSL_GUARDED_BY(mu_);
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_ENGINE_FLIGHT_RECORDER_H_
