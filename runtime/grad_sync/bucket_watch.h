// When each gradient bucket's collective ran, as the rank that posted it saw it (internal).
//
// Note [Bucket spans]. A data-parallel strategy posts one collective (or a few) per gradient
// bucket while the backward still runs (Note [Bucket order] in bucketed_all_reduce.cc), and waits
// for them only at the step's end, so the rank's recorded intervals show the reduction as one
// "all-reduce" wait in which most of the work is already done. A BucketWatch keeps, per posted
// collective, its span: from just before the post to the moment the rank saw it complete. A rank
// does not block to see that: it polls Work::Done on the collectives still open
//  - before every post (so a bucket that finished before the next one was posted ends first),
//  - after each layer's GradReady and each REDUCE_GRADS (the backward's launch points),
//  - at the end of every interval the rank records (a forward, a send, a receive's wait ...:
//    RankExecutor::Record), and
//  - around every wait of the strategy's (GradSyncContext::wait), a waited one ending when its
//    wait returns;
// so a span ends at most one layer's backward (or one other action) after the collective really
// completed, or, once the program is done, when the step's end waits for it. Polling also drives
// progress on a backend that progresses only when called (MPI). The strategies report what they
// post (Post);
// the rank polls, owns the watch and turns the spans into EventKind::kBucket events, which count
// in no time category: they overlap compute.
//
// One watch per rank, used by the rank's thread only (Note [Who touches a rank]). A Work stays
// open until it is waited for or the watch is cleared, so a strategy keeps each Work it posted
// until then: it waits for every one in Finish, and drops them only in its BeginStep, which the
// rank calls after Clear.
#ifndef PIPEWRIGHT_RUNTIME_GRAD_SYNC_BUCKET_WATCH_H_
#define PIPEWRIGHT_RUNTIME_GRAD_SYNC_BUCKET_WATCH_H_

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "pipewright/comm.h"
#include "pipewright/engine.h"

namespace pipewright::internal {

class BucketWatch {
 public:
  using Clock = std::chrono::steady_clock;

  // One collective of one bucket.
  struct Span {
    int stage = 0;   // virtual stage
    int bucket = 0;  // the bucket's index among its stage's (BucketLayers order)
    BucketCollective collective = BucketCollective::kAllReduce;
    Clock::time_point posted, done;
  };

  // Forgets every span, open or ended (a new step).
  void Clear();
  // Polls the open collectives, then runs `post` (which posts one collective and returns its
  // Work), timing the span from just before it: a backend may do the whole reduction inside the
  // call (the local backend's last arrival does).
  template <typename F>
  std::unique_ptr<Work> Post(int stage, int bucket, BucketCollective collective, F&& post) {
    Poll();
    const Clock::time_point t = Clock::now();
    std::unique_ptr<Work> w = std::forward<F>(post)();
    if (w == nullptr) return w;
    open_.push_back({w.get(), spans_.size()});
    spans_.push_back({stage, bucket, collective, t, t});
    return w;
  }
  // Ends the span of every open collective whose Work::Done is true, now.
  void Poll();
  // `w` has been waited for successfully: its span, if open, ends now; the others are polled.
  void Waited(const Work& w);
  // Every span of the step so far, in the order they were posted (an open one ends now: after
  // the strategy's Finish every collective is complete), and forgets them.
  std::vector<Span> Take();

 private:
  struct Open {
    Work* work = nullptr;
    size_t span = 0;  // its index in spans_
  };

  std::vector<Span> spans_;  // in post order
  std::vector<Open> open_;   // not seen complete yet
};

// `watch->Post(...)`, or just `post()` where no one watches (a context without a watch, as the
// strategies' own tests make).
template <typename F>
std::unique_ptr<Work> PostBucket(BucketWatch* watch, int stage, int bucket,
                                 BucketCollective collective, F&& post) {
  if (watch == nullptr) return std::forward<F>(post)();
  return watch->Post(stage, bucket, collective, std::forward<F>(post));
}

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_GRAD_SYNC_BUCKET_WATCH_H_
