// Pipeline schedules as data: an action IR, generators, communication lowering and a
// validator that executes the programs against FIFO channels. Pure C++ (no device, MPI or BLAS).
//
// Terms. p = pipeline ranks, v = model chunks per rank, S = p * v virtual stages (stage s owns a
// contiguous slice of the model; stage 0 is first). m = micro-batches per step. Each rank runs
// one Program: its ordered list of actions.
//
// Action kinds, for micro-batch `mb` on virtual stage `s`:
//   F      forward of stage s
//   B      full backward of stage s (input and weight gradients)
//   I      input-gradient half of the backward (zero-bubble schedules)
//   W      weight-gradient half; must follow I of the same (mb, s)
//   SEND_F send stage s's output activation to the rank of stage s + 1
//   RECV_F receive stage s's input activation from the rank of stage s - 1
//   SEND_B send the gradient of stage s's input to the rank of stage s - 1
//   RECV_B receive the gradient of stage s's output from the rank of stage s + 1
//   REDUCE_GRADS     all-reduce stage s's gradients across data-parallel replicas (mb unused)
//   OPTIMIZER_STEP   apply the optimizer on this rank (mb and s unused)
//
// Text form, one action per token, whitespace separated; one line per rank "rank R: ...":
//   F3@s1  B3@s1  I3@s1  W3@s1  SEND_F3@s1  RECV_F3@s2  SEND_B3@s2  RECV_B3@s1
//   REDUCE_GRADS@s1  OPTIMIZER_STEP
#ifndef PIPEWRIGHT_SCHEDULE_H_
#define PIPEWRIGHT_SCHEDULE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pipewright {

enum class ActionKind {
  kF,
  kB,
  kI,
  kW,
  kSendF,
  kRecvF,
  kSendB,
  kRecvB,
  kReduceGrads,
  kOptimizerStep,
};

// "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRADS", "OPTIMIZER_STEP"
const char* ActionKindName(ActionKind kind);
bool IsCompute(ActionKind kind);  // F, B, I, W
bool IsComm(ActionKind kind);     // SEND_*, RECV_*

struct Action {
  ActionKind kind = ActionKind::kF;
  int virtual_stage = 0;
  int micro_batch = 0;
  friend bool operator==(const Action&, const Action&) = default;
  std::string ToString() const;  // "F3@s1"
};

absl::StatusOr<Action> ParseAction(absl::string_view token);

struct Program {
  int rank = 0;
  std::vector<Action> actions;
};

enum class ScheduleKind { kGpipe, k1F1B, kInterleaved, kZbH1, kZbV, kDualPipeV, kCustom };
const char* ScheduleKindName(ScheduleKind kind);  // "gpipe", "1f1b", "interleaved", "zb-h1", …
absl::StatusOr<ScheduleKind> ParseScheduleKind(absl::string_view name);

// The most (stage, micro-batch) pairs, p * v * m, a plan or a hand-written program may schedule
// (docs/plan.md, "Limits"): a bound on what reading a file can make the generator, the validator
// and the engine build. It is far above any real step (p = 128, v = 4, m = 2048 is under half).
inline constexpr int64_t kMaxStageMicroBatches = int64_t{1} << 20;

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int ranks = 1;          // p
  int micro_batches = 1;  // m
  int chunks = 1;         // v (interleaved: any v >= 1; zb-v, dualpipev: 2; others: 1)
};

struct Schedule {
  ScheduleSpec spec;
  int num_stages = 1;             // p * v
  std::vector<int> stage_rank;    // virtual stage -> rank
  bool split_backward = false;    // true when the programs use I/W instead of B
  bool lowered = false;           // true once LowerComm has inserted the communication
  std::vector<Program> programs;  // one per rank, index = rank
};

// The largest p x m x v GenerateSchedule makes: each (rank, micro-batch, chunk) costs a few
// actions and their simulation, under 1 KiB in all, so 2^20 of them stay under a GiB.
inline constexpr int64_t kMaxScheduleSize = int64_t{1} << 20;

// Generates the compute actions of every rank (no communication). Any (p >= 1, m >= 1) with
// p x m x v <= kMaxScheduleSize is generated or refused with an InvalidArgument message that
// says what would work.
absl::StatusOr<Schedule> GenerateSchedule(const ScheduleSpec& spec);

// Inserts RECV_F before each F (and RECV_B before each B/I) whose neighbour stage is on
// another rank, SEND_F after each F and SEND_B after each B/I likewise, then REDUCE_GRADS for
// each of the rank's stages after that stage's last backward action, and one OPTIMIZER_STEP
// at the end. Lowering an already lowered schedule is an error.
absl::Status LowerComm(Schedule& schedule);

// Proves a lowered schedule correct by executing every program against FIFO channels, one per
// (sender rank, receiver rank, direction F|B): sends never block; a receive blocks until its
// channel has a message and fails when the head message is not the one it expects. Checks that
// every (micro-batch, stage) runs F exactly once and then B (or I then W) exactly once, on the
// rank that owns the stage, that every receive meets its send, nothing is left unreceived, and
// no rank can block forever. A failure names the ranks and the actions they are stuck on:
//   "deadlock: rank 2 waits on RECV_B3@s2; rank 3 waits on RECV_F4@s3"
absl::Status Validate(const Schedule& schedule);

// Text form (see the top of this file); "# comments" and blank lines are ignored. Parsing a
// text needs the stage placement: `spec` gives p, v and the kind (kCustom for hand-written).
std::string ToText(const Schedule& schedule);
absl::StatusOr<Schedule> ParseSchedule(absl::string_view text, const ScheduleSpec& spec);

// A hand-written program whose shape is read from the text itself: p = the number of "rank R:"
// lines (every rank 0..p-1 exactly once), S = the largest stage named + 1 (a multiple of p; the
// chunks are S / p, stage s on rank s mod p), m = the largest micro-batch named + 1. The kind
// is kCustom. Compute-only texts come back unlowered; texts that spell out their
// communication come back lowered (see ParseSchedule). Errors name the line.
absl::StatusOr<Schedule> ParseProgram(absl::string_view text);

// Tag of the point-to-point message that arrives at virtual stage `arriving_stage` for
// micro-batch `micro_batch`: activations (forward) into a stage's input, gradients (backward)
// into a stage's output. Unique within a step for every schedule of `num_stages` stages; the
// runtime and CheckFifoOrder use the same numbering.
int64_t MessageTag(int num_stages, int micro_batch, int arriving_stage, bool forward);

// OK when a transport without message tags (one FIFO per ordered pair of ranks: NCCL, where
// receives match sends in posting order) runs the lowered `schedule` correctly: for every
// ordered pair of ranks, the receiver posts its receives in the order the sender posts the
// sends. Otherwise InvalidArgument naming the pair and the position where the orders differ.
absl::Status CheckFifoOrder(const Schedule& schedule);

// True for the schedules that place two chunks per rank in a "V": zb-v and dualpipev.
bool IsVShaped(ScheduleKind kind);

// Stage placement: rank of virtual stage s. Interleaved: s mod p. zb-v, dualpipev: s for s < p,
// else 2p - 1 - s (the "V"). Others: s.
int StageRank(const ScheduleSpec& spec, int stage);

}  // namespace pipewright

#endif  // PIPEWRIGHT_SCHEDULE_H_
