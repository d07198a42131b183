// Reports of a measured engine run: a Chrome trace of every rank's recorded events, and the
// papers' timeline diagram drawn from the measured times of one step.
#ifndef PIPEWRIGHT_TRACE_H_
#define PIPEWRIGHT_TRACE_H_

#include <string>
#include <vector>

#include "pipewright/comm.h"
#include "pipewright/engine.h"
#include "pipewright/simulator.h"

namespace pipewright {

// Chrome trace-event JSON (Perfetto / chrome://tracing): process = pipeline rank, thread =
// replica; one slice per event (F/B/I/W, recompute, send, receive wait, all-reduce, optimizer,
// data wait) named by its action ("F3@s1"), and a flow arrow from each send to the end of its
// receive. Gradient bucket spans (EventKind::kBucket) go on threads of their own, "replica R:
// gradient buckets" (more lanes, "(lane 2)" and on, where collectives overlap: Note [Bucket
// tracks] in trace.cc), one slice per collective named like "bucket 3 of stage 1 all-reduce",
// category "bucket". `events` is Engine::Events() (index = global rank).
std::string EngineChromeTrace(const Topology& topology,
                              const std::vector<std::vector<RankEvent>>& events);

// The compute events of `step` on `replica`'s ranks as a SimResult timeline (times in seconds
// from the step's first event; row = pipeline rank), so ToSvg draws the measured schedule like
// the simulated one. With replica = kAllReplicas, every replica's ranks, row = replica x pp +
// pipeline rank, all from the step's first event anywhere.
constexpr int kAllReplicas = -1;
SimResult MeasuredTimeline(const Schedule& schedule, const Topology& topology,
                           const std::vector<std::vector<RankEvent>>& events, int64_t step,
                           int replica);

// The SVG of MeasuredTimeline(..., kAllReplicas): rows labelled "rank G (pp P, dp R)", times
// in milliseconds, the title saying "measured step N".
std::string MeasuredTimelineSvg(const Schedule& schedule, const Topology& topology,
                                const std::vector<std::vector<RankEvent>>& events, int64_t step);

}  // namespace pipewright

#endif  // PIPEWRIGHT_TRACE_H_
