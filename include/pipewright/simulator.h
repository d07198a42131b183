// Simulates a lowered schedule with per-stage costs: predicted makespan, per-rank busy time,
// bubble fraction, peak in-flight activations and the timeline; exports Chrome traces and SVG.
#ifndef PIPEWRIGHT_SIMULATOR_H_
#define PIPEWRIGHT_SIMULATOR_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pipewright/schedule.h"

namespace pipewright {

// Costs of one whole stage (a chunk of an interleaved or zb-v schedule costs 1/v of these).
// When the schedule does not split the backward, a B action costs b + w.
struct SimCosts {
  double f = 1.0;  // forward
  double b = 1.0;  // input-gradient backward (I)
  double w = 0.0;  // weight-gradient backward (W)
  // Optional per-virtual-stage costs (size = num_stages) that replace f/b/w scaled by 1/v.
  std::vector<double> stage_f, stage_b, stage_w;
  double comm_latency = 0.0;    // seconds per message
  double comm_per_byte = 0.0;   // seconds per byte
  double message_bytes = 0.0;   // bytes per activation / gradient message
  double reduce_time = 0.0;     // REDUCE_GRADS duration per stage
  double optimizer_time = 0.0;  // OPTIMIZER_STEP duration
};

struct SimEvent {
  int rank = 0;
  Action action;
  double start = 0, end = 0;
};

struct SimRank {
  double busy = 0;           // time spent in compute (and reduce/optimizer) actions
  double peak_inflight = 0;  // max micro-batches whose activations are held, in whole-stage units
};

struct SimResult {
  double makespan = 0;
  // Idle share of p x makespan: 1 - sum(busy) / (p * makespan). Every action with a duration
  // (F/B/I/W, REDUCE_GRADS, OPTIMIZER_STEP) counts as busy; only waiting is bubble.
  double bubble_fraction = 0;
  std::vector<SimRank> ranks;
  // Every action, sorted by (rank, start). Sends have start == end; a receive spans its wait
  // (start = the rank's clock on reaching it, end = when the message arrived).
  std::vector<SimEvent> timeline;
};

struct SimOptions {
  // Fill SimResult::timeline; without it (the planner's many simulations) the result has the
  // same makespan, busy times, bubble and peaks, in less time and memory.
  bool timeline = true;
};

// `schedule` must be lowered (LowerComm); an invalid one is an error naming the stuck actions.
// A receive completes at max(its rank's time, send time + latency + bytes * per_byte); sends
// and receives take no time on the rank. Activations of (mb, s) are held from the start of F
// until the end of its B (or W when the backward is split), 1/v of a stage each. A deadlock
// (a receive whose send never happens, or a cycle) is FailedPrecondition:
//   "deadlock: rank 0 waits on RECV_B0@s0; rank 1 waits on RECV_F0@s1"
// A send or receive of a micro-batch outside [0, spec.micro_batches) is InvalidArgument.
absl::StatusOr<SimResult> Simulate(const Schedule& schedule, const SimCosts& costs,
                                   const SimOptions& options = {});

// Chrome trace-event JSON (opens in Perfetto / chrome://tracing): process = rank, one slice per
// action, flow arrows from each send to its receive.
std::string ToChromeTrace(const Schedule& schedule, const SimResult& result);
// Text made safe inside an XML (SVG) element or attribute: & < > " ' escaped.
std::string XmlEscape(absl::string_view text);

// How ToSvg labels a diagram. By default rows read "rank R" and times are the simulator's cost
// units (no unit named); a measured timeline names each row's place and its time unit.
struct SvgOptions {
  std::vector<std::string> row_labels;  // one per row (SimEvent::rank); "rank R" where missing
  std::string time_unit;                // e.g. "ms"; times are shown multiplied by unit_scale
  double unit_scale = 1;
  std::string title;  // replaces the schedule's name at the start of the title when not empty
};

// The papers' timeline diagram: one row per rank, one box per compute action coloured by kind,
// micro-batch number inside; a legend, the time axis and the makespan/bubble in the title.
std::string ToSvg(const Schedule& schedule, const SimResult& result,
                  const SvgOptions& options = {});

}  // namespace pipewright

#endif  // PIPEWRIGHT_SIMULATOR_H_
