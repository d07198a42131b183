// When each gradient bucket's collective ran (bucket_watch.h, Note [Bucket spans]).
#include "runtime/grad_sync/bucket_watch.h"

#include <algorithm>

namespace pipewright::internal {

void BucketWatch::Clear() {
  spans_.clear();
  open_.clear();
}

void BucketWatch::Poll() {
  if (open_.empty()) return;
  const Clock::time_point now = Clock::now();
  auto done = [&](const Open& o) {
    if (!o.work->Done()) return false;
    spans_[o.span].done = now;
    return true;
  };
  open_.erase(std::remove_if(open_.begin(), open_.end(), done), open_.end());
}

void BucketWatch::Waited(const Work& w) {
  auto it = std::find_if(open_.begin(), open_.end(), [&](const Open& o) { return o.work == &w; });
  if (it != open_.end()) {
    spans_[it->span].done = Clock::now();
    open_.erase(it);
  }
  Poll();
}

std::vector<BucketWatch::Span> BucketWatch::Take() {
  const Clock::time_point now = Clock::now();
  for (const Open& o : open_) spans_[o.span].done = now;
  open_.clear();
  std::vector<Span> out = std::move(spans_);
  spans_.clear();
  return out;
}

}  // namespace pipewright::internal
