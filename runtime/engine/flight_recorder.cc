// The rank's flight recorder (flight_recorder.h).
#include "runtime/engine/flight_recorder.h"

#include <utility>

namespace pipewright::internal {

FlightEntry* FlightRecorder::Current() {
  if (count_ == 0) return nullptr;
  return &ring_[static_cast<size_t>((count_ - 1) % static_cast<int64_t>(capacity_))];
}

void FlightRecorder::Begin(int64_t step, std::string action, double now_s) {
  absl::MutexLock lock(&mu_);
  FlightEntry e;
  e.step = step;
  e.action = std::move(action);
  e.start_s = now_s;
  if (ring_.size() < capacity_) {
    ring_.push_back(std::move(e));
  } else {
    ring_[static_cast<size_t>(count_ % static_cast<int64_t>(capacity_))] = std::move(e);
  }
  ++count_;
}

void FlightRecorder::Peer(int peer, int64_t tag, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (FlightEntry* e = Current()) {
    e->peer = peer;
    e->tag = tag;
    e->bytes = bytes;
  }
}

void FlightRecorder::Waiting(std::string what, double now_s) {
  absl::MutexLock lock(&mu_);
  if (FlightEntry* e = Current()) {
    e->waiting_on = std::move(what);
    e->wait_since_s = now_s;
  }
}

void FlightRecorder::DoneWaiting() {
  absl::MutexLock lock(&mu_);
  if (FlightEntry* e = Current()) e->wait_since_s = -1;
}

void FlightRecorder::End(double now_s) {
  absl::MutexLock lock(&mu_);
  if (FlightEntry* e = Current()) e->end_s = now_s;
}

std::vector<FlightEntry> FlightRecorder::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<FlightEntry> out;
  const int64_t n = static_cast<int64_t>(ring_.size());
  for (int64_t i = count_ - n; i < count_; ++i) {
    out.push_back(ring_[static_cast<size_t>(i % static_cast<int64_t>(capacity_))]);
  }
  return out;
}

int64_t FlightRecorder::count() const {
  absl::MutexLock lock(&mu_);
  return count_;
}

}  // namespace pipewright::internal
