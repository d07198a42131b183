#include "pipewright/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "pipewright/checkpoint.h"
#include "runtime/ops/ops.h"
#include "runtime/train_state.h"

namespace pipewright {

const char* EventKindName(EventKind k) {
  switch (k) {
    case EventKind::kCompute:
      return "compute";
    case EventKind::kRecompute:
      return "recompute";
    case EventKind::kSend:
      return "send";
    case EventKind::kRecvWait:
      return "recv wait";
    case EventKind::kAllReduce:
      return "all-reduce";
    case EventKind::kOptimizer:
      return "optimizer";
    case EventKind::kDataWait:
      return "data wait";
  }
  return "?";
}

absl::StatusOr<std::vector<int>> BalancedBoundaries(const LayerGraph& graph, int stages) {
  const int n = graph.num_layers();
  if (stages < 1 || stages > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot split ", graph.name(), "'s ", n, " layers into ", stages,
                     " non-empty stages (pp x chunks must be between 1 and the number of layers)"));
  }
  // cost[i]: layer i's forward + backward FLOPs (at least 1 so that empty-cost layers still
  // spread). best[k][j]: minimum bottleneck placing layers [0, j) on k stages.
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    const Cost& c = graph.node(i).cost;
    prefix[i + 1] = prefix[i] + std::max(1.0, c.forward_flops + c.backward_flops);
  }
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k) {
    for (int j = k; j <= n - (stages - k); ++j) {
      for (int i = k - 1; i < j; ++i) {
        double v = std::max(best[k - 1][i], prefix[j] - prefix[i]);
        if (v < best[k][j]) {
          best[k][j] = v;
          cut[k][j] = i;
        }
      }
    }
  }
  std::vector<int> b(stages + 1);
  b[stages] = n;
  for (int k = stages; k > 0; --k) b[k - 1] = cut[k][b[k]];
  return b;
}

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kDirF = 0, kDirB = 1;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Tag of the message that arrives at virtual stage `stage` for micro-batch `mb`: activations
// (F) into a stage's input, gradients (B) into a stage's output.
int64_t P2PTag(int num_stages, int mb, int stage, int dir) {
  return (static_cast<int64_t>(mb) * num_stages + stage) * 2 + dir;
}

// NCCL has no tags: between two ranks, receives match sends in posting order. That is correct
// only when, for every ordered pair of pipeline ranks, the tags the sender posts come in the
// same order as the tags the receiver posts. OK when they do; otherwise names the first pair
// and position where they differ.
}  // namespace

absl::Status CheckFifoOrder(const Schedule& sched) {
  const int S = sched.num_stages, P = static_cast<int>(sched.programs.size());
  // sent[from][to] / expected[to][from]: tags in program order.
  std::vector<std::vector<std::vector<int64_t>>> sent(P, std::vector<std::vector<int64_t>>(P)),
      expected(P, std::vector<std::vector<int64_t>>(P));
  for (int r = 0; r < P; ++r) {
    for (const Action& a : sched.programs[r].actions) {
      const bool send = a.kind == ActionKind::kSendF || a.kind == ActionKind::kSendB;
      const bool recv = a.kind == ActionKind::kRecvF || a.kind == ActionKind::kRecvB;
      if (!send && !recv) continue;
      const bool fwd = a.kind == ActionKind::kSendF || a.kind == ActionKind::kRecvF;
      const int other = send ? (fwd ? a.virtual_stage + 1 : a.virtual_stage - 1)
                             : (fwd ? a.virtual_stage - 1 : a.virtual_stage + 1);
      if (other < 0 || other >= S) continue;  // Validate reports it
      const int peer = sched.stage_rank[other];
      const int arriving_at = send ? other : a.virtual_stage;
      const int64_t tag = P2PTag(S, a.micro_batch, arriving_at, fwd ? kDirF : kDirB);
      (send ? sent[r][peer] : expected[r][peer]).push_back(tag);
    }
  }
  for (int from = 0; from < P; ++from) {
    for (int to = 0; to < P; ++to) {
      const std::vector<int64_t>& a = sent[from][to];
      const std::vector<int64_t>& b = expected[to][from];
      for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        if (a[i] != b[i]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the NCCL backend matches messages in posting order (it has no tags), but this "
              "schedule's message ",
              i, " from pipeline rank ", from, " to ", to,
              " is posted in a different order by the receiver; run it with --comm local"));
        }
      }
    }
  }
  return absl::OkStatus();
}

namespace {

struct Bucket {
  std::vector<Parameter*> params;
  int pending = 0;  // layers whose last weight gradient of the step is still to come
  int64_t numel = 0;
  Tensor flat;
  std::unique_ptr<Work> work;
};

struct StageRt {
  int index = 0;  // virtual stage
  int begin = 0, end = 0;
  bool first = false, last = false;
  bool recompute = false;  // keep only the stage input; recompute the forward before backward
  std::unique_ptr<Stage> stage;
  std::vector<int64_t> in_shape, out_shape;
  DType in_dtype = DType::kF32;
  int last_backward = -1;         // program index of the action finishing the weight grads
  std::vector<int> layer_bucket;  // per layer: bucket index, or -1 without parameters
  std::vector<int> bucket_pending0;
  std::vector<Bucket> buckets;
  // Per micro-batch state of the step.
  std::vector<std::vector<Saved>> saved;
  std::vector<Tensor> input, output, grad_out, grad_in;
  // Measured seconds and counts, summed over steps.
  double f_s = 0, b_s = 0, w_s = 0, rc_s = 0;
  int64_t f_n = 0, b_n = 0, w_n = 0;
};

struct StepOutcome {
  double loss = 0, grad_norm = 0;
  float loss_scale = 1.0f;
  bool skipped = false;
};

}  // namespace

class RankExecutor {
 public:
  int global = 0, pipe = 0, replica = 0;
  int slot = 0;  // index among this process's ranks
  Topology topo;
  const Schedule* schedule = nullptr;
  const EngineOptions* opts = nullptr;
  const LayerGraph* graph = nullptr;
  std::shared_ptr<const Dataset> data;
  BatchLayout layout;
  Clock::time_point epoch;

  // Device memory and its stream (CUDA) — declared before everything allocated from them.
  int cuda_device = -1;  // >= 0 on CUDA
  std::unique_ptr<CudaStream> stream;
  std::unique_ptr<Allocator> alloc = std::make_unique<CpuAllocator>();
  // Host memory for the rank's host-side values on CUDA (batches, scalars, staging).
  std::unique_ptr<CpuAllocator> host = std::make_unique<CpuAllocator>();
  std::unique_ptr<Communicator> world, dp_comm;
  std::vector<StageRt> stages;
  std::vector<int> local;  // virtual stage -> index in stages, or -1
  std::vector<Parameter*> params;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<DataLoader> loader;
  // fp16 dynamic loss scaling; every rank keeps an identical copy, updated from the agreed
  // outcome of each step.
  LossScaler scaler;
  int64_t static_bytes = 0;

  std::vector<RankEvent> events;
  RankTimes step_times, total;

  bool needs_data() const {
    for (const StageRt& s : stages) {
      if (s.first || s.last) return true;
    }
    return false;
  }

  std::string Who() const {
    return absl::StrFormat("rank %d (pipeline rank %d, replica %d)", global, pipe, replica);
  }
  int PeerOf(int stage) const { return topo.GlobalRank(schedule->stage_rank[stage], replica); }
  StageRt* Local(int stage) {
    if (stage < 0 || stage >= static_cast<int>(local.size()) || local[stage] < 0) return nullptr;
    return &stages[local[stage]];
  }

  absl::Status RunStep(int64_t step, float lr, StepOutcome* out);
  bool on_cuda() const { return cuda_device >= 0; }
  // Makes this rank's GPU current on the calling thread (CUDA state is per thread).
  absl::Status BindDevice() const {
    return on_cuda() ? SetCudaDevice(cuda_device) : absl::OkStatus();
  }
  // Waits until the rank's queued device work is done (no-op on the CPU), so that host clocks
  // time it and other threads may read what it wrote.
  absl::Status Sync() const {
    return on_cuda() ? SynchronizeStream(alloc->stream()) : absl::OkStatus();
  }
  // A host copy of a tensor of this rank (a shared reference when it is already on the host).
  absl::StatusOr<Tensor> ToHost(const Tensor& t) const {
    if (t.device().is_cpu()) return t;
    Tensor h = Tensor::Empty(t.shape(), t.dtype(), DefaultCpuAllocator());
    PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc.get()}, t, h));
    return h;
  }

 private:
  // The first stage's tokens and the last stage's targets of micro-batch `mb`, on the rank's
  // device (copied from the loader's host batch once per step on CUDA).
  absl::StatusOr<Tensor> Tokens(int mb);
  absl::StatusOr<const Tensor*> Targets(int mb);

 public:
  // In-place sum of a host tensor over the world (staged through the GPU for NCCL).
  absl::Status AllReduceHost(Tensor& v, const std::string& what);
  // The rank's totals over the steps so far, with per-stage mean times.
  RankTimes Totals() const;

 private:
  absl::Status RunAction(const Action& a, int index, int64_t step, float lr, StepOutcome* out);
  struct PendingRecv {
    Action action;
    StageRt* stage = nullptr;
    int peer = -1;
    int64_t tag = -1;
    Tensor buf;
    std::unique_ptr<Work> work;
    Clock::time_point start;
  };
  absl::Status IssueSend(const Action& a);
  absl::Status PostRecv(const Action& a, PendingRecv* r);
  absl::Status FinishRecv(PendingRecv& r);
  absl::Status RunP2PGroup(const Program& prog, size_t begin, size_t end);
  absl::Status Forward(StageRt& st, int mb);
  absl::Status Backward(StageRt& st, const Action& a, int index);
  absl::Status Agree(int64_t step, float lr, StepOutcome* out);
  absl::Status LayerWeightDone(StageRt& st, int layer);
  absl::Status Launch(Bucket& b);
  void Record(EventKind kind, const Action& a, Clock::time_point start, int peer = -1,
              int64_t tag = -1);
  absl::Status WaitOrAbort(Work& w, const std::string& what);

  StepBatch batch_;
  std::vector<Tensor> dev_tokens_, dev_targets_;  // CUDA copies of batch_, per micro-batch
  std::vector<double> losses_;                    // [micro-batch], last-stage ranks only
  std::vector<std::unique_ptr<Work>> sends_;
  int64_t step_ = 0;
};

void RankExecutor::Record(EventKind kind, const Action& a, Clock::time_point start, int peer,
                          int64_t tag) {
  RankEvent e;
  e.kind = kind;
  e.action = a;
  e.peer = peer;
  e.tag = tag;
  e.step = step_;
  e.start = Seconds(epoch, start);
  e.end = Seconds(epoch, Clock::now());
  events.push_back(e);
  double d = e.end - e.start;
  switch (kind) {
    case EventKind::kCompute:
      step_times.compute += d;
      break;
    case EventKind::kRecompute:
      step_times.recompute += d;
      break;
    case EventKind::kSend:
    case EventKind::kRecvWait:
      step_times.p2p_wait += d;
      break;
    case EventKind::kAllReduce:
      step_times.all_reduce += d;
      break;
    case EventKind::kOptimizer:
      step_times.optimizer += d;
      break;
    case EventKind::kDataWait:
      step_times.data_wait += d;
      break;
  }
}

absl::Status RankExecutor::WaitOrAbort(Work& w, const std::string& what) {
  absl::Status s = w.Wait(opts->timeout);
  if (s.ok()) return s;
  absl::Status first = world->abort_status();
  if (!first.ok()) return first;  // another rank failed first: report that
  return absl::Status(s.code(), absl::StrCat(Who(), " ", what, ": ", s.message()));
}

absl::Status RankExecutor::RunStep(int64_t step, float lr, StepOutcome* out) {
  step_ = step;
  step_times = RankTimes{};
  const Clock::time_point t0 = Clock::now();
  const int M = static_cast<int>(layout.micro_batches);
  alloc->ResetPeak();
  const int64_t start_bytes = alloc->current_bytes();
  if (needs_data()) {
    if (loader == nullptr) loader = std::make_unique<DataLoader>(data, layout, replica, step);
    Clock::time_point t = Clock::now();
    batch_ = loader->Next();
    Record(EventKind::kDataWait, Action{ActionKind::kF, -1, -1}, t);
    if (batch_.step != step) {
      return absl::InternalError(
          absl::StrCat(Who(), ": data loader is at step ", batch_.step, ", expected ", step));
    }
  }
  ZeroGrads(params);
  for (StageRt& st : stages) {
    st.saved.assign(M, {});
    st.input.assign(M, Tensor());
    st.output.assign(M, Tensor());
    st.grad_out.assign(M, Tensor());
    st.grad_in.assign(M, Tensor());
    for (size_t b = 0; b < st.buckets.size(); ++b) {
      st.buckets[b].pending = st.bucket_pending0[b];
      st.buckets[b].work.reset();
      st.buckets[b].flat = Tensor();
    }
  }
  losses_.assign(M, 0.0);
  dev_tokens_.assign(M, Tensor());
  dev_targets_.assign(M, Tensor());
  sends_.clear();
  const Program& prog = schedule->programs[pipe];
  auto is_p2p = [](ActionKind k) {
    return k == ActionKind::kSendF || k == ActionKind::kSendB || k == ActionKind::kRecvF ||
           k == ActionKind::kRecvB;
  };
  const bool group_p2p = world->backend() == "nccl";
  for (size_t i = 0; i < prog.actions.size(); ++i) {
    const Action& a = prog.actions[i];
    absl::Status s;
    if (global == opts->inject_failure_rank && step == opts->inject_failure_step &&
        (a.kind == ActionKind::kB || a.kind == ActionKind::kI)) {
      s = absl::InternalError(absl::StrCat(Who(), " ", a.ToString(), ": injected failure"));
      world->Abort(s);
      return world->abort_status();
    }
    try {
      if (group_p2p && is_p2p(a.kind)) {
        size_t end = i + 1;
        while (end < prog.actions.size() && is_p2p(prog.actions[end].kind)) ++end;
        s = RunP2PGroup(prog, i, end);
        i = end - 1;
      } else {
        s = RunAction(a, static_cast<int>(i), step, lr, out);
      }
    } catch (const std::exception& e) {
      s = absl::InternalError(absl::StrCat(Who(), " ", a.ToString(), ": exception: ", e.what()));
    } catch (...) {
      s = absl::InternalError(absl::StrCat(Who(), " ", a.ToString(), ": unknown exception"));
    }
    if (!s.ok()) {
      world->Abort(s);
      return world->abort_status();
    }
  }
  for (StageRt& st : stages) {  // release the step's buffers
    st.saved.clear();
    st.input.clear();
    st.output.clear();
    st.grad_out.clear();
    st.grad_in.clear();
  }
  batch_ = StepBatch{};
  dev_tokens_.clear();
  dev_targets_.clear();
  step_times.wall = Seconds(t0, Clock::now());
  step_times.peak_memory_bytes = alloc->peak_bytes();
  step_times.peak_activation_bytes = alloc->peak_bytes() - start_bytes;
  step_times.static_memory_bytes = static_bytes;
  double used = step_times.compute + step_times.recompute + step_times.p2p_wait +
                step_times.all_reduce + step_times.optimizer + step_times.data_wait;
  step_times.idle = std::max(0.0, step_times.wall - used);
  total.compute += step_times.compute;
  total.recompute += step_times.recompute;
  total.p2p_wait += step_times.p2p_wait;
  total.all_reduce += step_times.all_reduce;
  total.optimizer += step_times.optimizer;
  total.data_wait += step_times.data_wait;
  total.idle += step_times.idle;
  total.wall += step_times.wall;
  total.peak_memory_bytes = std::max(total.peak_memory_bytes, step_times.peak_memory_bytes);
  total.peak_activation_bytes =
      std::max(total.peak_activation_bytes, step_times.peak_activation_bytes);
  return absl::OkStatus();
}

absl::Status RankExecutor::RunAction(const Action& a, int index, int64_t step, float lr,
                                     StepOutcome* out) {
  const int mb = a.micro_batch;
  auto stage_or = [&]() -> absl::StatusOr<StageRt*> {
    StageRt* st = Local(a.virtual_stage);
    if (st == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(Who(), " ", a.ToString(), ": stage ",
                                                     a.virtual_stage, " is not on this rank"));
    }
    if (a.kind != ActionKind::kReduceGrads && (mb < 0 || mb >= layout.micro_batches)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Who(), " ", a.ToString(), ": micro-batch out of range"));
    }
    return st;
  };
  switch (a.kind) {
    case ActionKind::kF: {
      PW_ASSIGN_OR_RETURN(StageRt * st, stage_or());
      Clock::time_point t = Clock::now();
      absl::Status s = Forward(*st, mb);
      Record(EventKind::kCompute, a, t);
      st->f_s += events.back().end - events.back().start;
      ++st->f_n;
      if (!s.ok())
        return absl::Status(s.code(), absl::StrCat(Who(), " ", a.ToString(), ": ", s.message()));
      return absl::OkStatus();
    }
    case ActionKind::kB:
    case ActionKind::kI:
    case ActionKind::kW: {
      PW_ASSIGN_OR_RETURN(StageRt * st, stage_or());
      absl::Status s = Backward(*st, a, index);
      if (!s.ok())
        return absl::Status(s.code(), absl::StrCat(Who(), " ", a.ToString(), ": ", s.message()));
      return absl::OkStatus();
    }
    case ActionKind::kSendF:
    case ActionKind::kSendB:
      return IssueSend(a);
    case ActionKind::kRecvF:
    case ActionKind::kRecvB: {
      PendingRecv r;
      PW_RETURN_IF_ERROR(PostRecv(a, &r));
      return FinishRecv(r);
    }
    case ActionKind::kReduceGrads: {
      PW_ASSIGN_OR_RETURN(StageRt * st, stage_or());
      if (dp_comm != nullptr) {
        for (Bucket& b : st->buckets) {
          // Normally launched by the bucket's last weight gradient.
          if (b.work == nullptr) PW_RETURN_IF_ERROR(Launch(b));
        }
      }
      return absl::OkStatus();
    }
    case ActionKind::kOptimizerStep:
      return Agree(step, lr, out);
  }
  return absl::InternalError("unknown action");
}

absl::StatusOr<Tensor> RankExecutor::Tokens(int mb) {
  if (!on_cuda()) return batch_.inputs[mb];
  if (!dev_tokens_[mb].defined()) {
    const Tensor& h = batch_.inputs[mb];
    Tensor d = Tensor::Empty(h.shape(), h.dtype(), alloc.get());
    PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc.get()}, h, d));
    dev_tokens_[mb] = std::move(d);
  }
  return dev_tokens_[mb];
}

absl::StatusOr<const Tensor*> RankExecutor::Targets(int mb) {
  if (!on_cuda()) return &batch_.targets[mb];
  if (!dev_targets_[mb].defined()) {
    const Tensor& h = batch_.targets[mb];
    Tensor d = Tensor::Empty(h.shape(), h.dtype(), alloc.get());
    PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc.get()}, h, d));
    dev_targets_[mb] = std::move(d);
  }
  return &dev_targets_[mb];
}

absl::Status RankExecutor::IssueSend(const Action& a) {
  const int S = schedule->num_stages;
  const int mb = a.micro_batch;
  StageRt* st = Local(a.virtual_stage);
  if (st == nullptr || mb < 0 || mb >= layout.micro_batches) {
    return absl::InvalidArgumentError(
        absl::StrCat(Who(), " ", a.ToString(), ": stage or micro-batch not on this rank"));
  }
  const bool fwd = a.kind == ActionKind::kSendF;
  const int to_stage = fwd ? a.virtual_stage + 1 : a.virtual_stage - 1;
  if (to_stage < 0 || to_stage >= S) {
    return absl::InvalidArgumentError(
        absl::StrCat(Who(), " ", a.ToString(), ": no stage ", to_stage, " to send to"));
  }
  Tensor& t = fwd ? st->output[mb] : st->grad_in[mb];
  if (!t.defined()) {
    return absl::FailedPreconditionError(
        absl::StrCat(Who(), " ", a.ToString(), ": nothing to send (the ", fwd ? "F" : "backward",
                     " of this micro-batch has not run)"));
  }
  const int peer = PeerOf(to_stage);
  const int64_t tag = P2PTag(S, mb, to_stage, fwd ? kDirF : kDirB);
  Clock::time_point c = Clock::now();
  sends_.push_back(world->Send(t, peer, tag));
  Record(EventKind::kSend, a, c, peer, tag);
  t = Tensor();
  return absl::OkStatus();
}

absl::Status RankExecutor::PostRecv(const Action& a, PendingRecv* r) {
  const int S = schedule->num_stages;
  const int mb = a.micro_batch;
  StageRt* st = Local(a.virtual_stage);
  if (st == nullptr || mb < 0 || mb >= layout.micro_batches) {
    return absl::InvalidArgumentError(
        absl::StrCat(Who(), " ", a.ToString(), ": stage or micro-batch not on this rank"));
  }
  const bool fwd = a.kind == ActionKind::kRecvF;
  const int from_stage = fwd ? a.virtual_stage - 1 : a.virtual_stage + 1;
  if (from_stage < 0 || from_stage >= S) {
    return absl::InvalidArgumentError(
        absl::StrCat(Who(), " ", a.ToString(), ": no stage ", from_stage, " to receive from"));
  }
  r->action = a;
  r->stage = st;
  r->peer = PeerOf(from_stage);
  r->tag = P2PTag(S, mb, a.virtual_stage, fwd ? kDirF : kDirB);
  r->buf = fwd ? Tensor::Empty(st->in_shape, st->in_dtype, alloc.get())
               : Tensor::Empty(st->out_shape, DType::kF32, alloc.get());
  r->start = Clock::now();
  r->work = world->Recv(r->buf, r->peer, r->tag);
  return absl::OkStatus();
}

absl::Status RankExecutor::FinishRecv(PendingRecv& r) {
  absl::Status s = WaitOrAbort(*r.work, absl::StrCat(r.action.ToString(), " from rank ", r.peer));
  Record(EventKind::kRecvWait, r.action, r.start, r.peer, r.tag);
  PW_RETURN_IF_ERROR(s);
  const bool fwd = r.action.kind == ActionKind::kRecvF;
  (fwd ? r.stage->input[r.action.micro_batch] : r.stage->grad_out[r.action.micro_batch]) =
      std::move(r.buf);
  return absl::OkStatus();
}

// A run of consecutive sends and receives as one group (NCCL): every operation is posted
// before any is waited for, so two neighbours that send to each other cannot deadlock in
// their send kernels.
absl::Status RankExecutor::RunP2PGroup(const Program& prog, size_t begin, size_t end) {
  std::vector<PendingRecv> recvs;
  world->GroupStart();
  absl::Status posted;
  for (size_t i = begin; i < end && posted.ok(); ++i) {
    const Action& a = prog.actions[i];
    if (a.kind == ActionKind::kSendF || a.kind == ActionKind::kSendB) {
      posted = IssueSend(a);
    } else {
      recvs.emplace_back();
      posted = PostRecv(a, &recvs.back());
      if (!posted.ok()) recvs.pop_back();
    }
  }
  absl::Status grouped = world->GroupEnd();
  PW_RETURN_IF_ERROR(posted);
  if (!grouped.ok()) {
    return absl::Status(grouped.code(),
                        absl::StrCat(Who(), " grouped send/receive: ", grouped.message()));
  }
  for (PendingRecv& r : recvs) PW_RETURN_IF_ERROR(FinishRecv(r));
  return absl::OkStatus();
}

absl::Status RankExecutor::Forward(StageRt& st, int mb) {
  Tensor x;
  if (st.first) {
    PW_ASSIGN_OR_RETURN(x, Tokens(mb));
  } else {
    x = st.input[mb];
  }
  if (!x.defined()) {
    return absl::FailedPreconditionError("no input activation (its RECV_F has not run)");
  }
  const Tensor* targets = nullptr;
  if (st.last) {
    PW_ASSIGN_OR_RETURN(targets, Targets(mb));
  }
  LayerContext ctx{alloc.get(), targets, ComputeDType(opts->train.precision)};
  Tensor y;
  if (st.recompute) {
    // Keep only the stage input; every layer's saved state is dropped as soon as it is made.
    Tensor h = x;
    for (int i = 0; i < st.stage->size(); ++i) {
      Saved tmp;
      auto r = st.stage->layer(i).Forward(h, ctx, &tmp);
      if (!r.ok()) {
        return absl::Status(r.status().code(),
                            absl::StrCat("layer ", st.begin + i, " (", st.stage->name(i),
                                         ") forward: ", r.status().message()));
      }
      h = *std::move(r);
    }
    y = std::move(h);
    st.input[mb] = x;
  } else {
    PW_ASSIGN_OR_RETURN(y, st.stage->Forward(x, ctx, &st.saved[mb]));
    st.input[mb] = Tensor();
  }
  PW_RETURN_IF_ERROR(Sync());
  if (st.last) {
    float l = y.data<float>()[0];
    // With loss scaling a non-finite loss skips the step everywhere (see Agree); otherwise it
    // is an error.
    if (!std::isfinite(l) && !scaler.enabled()) {
      return absl::InternalError(absl::StrCat("non-finite loss ", l, " at step ", step_,
                                              "; weights not updated on any rank"));
    }
    losses_[mb] = l;
    return absl::OkStatus();
  }
  if (StageRt* next = Local(st.index + 1)) {
    next->input[mb] = std::move(y);  // the next stage is on this rank: no message
  } else {
    st.output[mb] = std::move(y);
  }
  return absl::OkStatus();
}

absl::Status RankExecutor::Backward(StageRt& st, const Action& a, int index) {
  const int mb = a.micro_batch;
  const Tensor* targets = nullptr;
  if (st.last) {
    PW_ASSIGN_OR_RETURN(targets, Targets(mb));
  }
  LayerContext ctx{alloc.get(), targets, ComputeDType(opts->train.precision)};
  const bool final_w = index == st.last_backward;
  std::vector<Saved>& saved = st.saved[mb];
  if (a.kind != ActionKind::kW) {
    if (st.recompute) {
      Tensor x;
      if (st.first) {
        PW_ASSIGN_OR_RETURN(x, Tokens(mb));
      } else {
        x = st.input[mb];
      }
      if (!x.defined()) return absl::FailedPreconditionError("no stage input to recompute from");
      Clock::time_point t = Clock::now();
      absl::StatusOr<Tensor> y = st.stage->Forward(x, ctx, &saved);
      if (y.ok()) PW_RETURN_IF_ERROR(Sync());
      Record(EventKind::kRecompute, a, t);
      st.rc_s += events.back().end - events.back().start;
      PW_RETURN_IF_ERROR(y.status());
      st.input[mb] = Tensor();
    }
    if (saved.size() != static_cast<size_t>(st.stage->size())) {
      return absl::FailedPreconditionError("backward before this micro-batch's forward");
    }
    Tensor dy;
    if (st.last) {
      dy = Tensor::Empty({1}, DType::kF32, host.get());  // a host scalar on every device
      dy.data<float>()[0] =
          scaler.scale() / static_cast<float>(layout.micro_batches * layout.replicas);
    } else {
      dy = st.grad_out[mb];
      if (!dy.defined()) {
        return absl::FailedPreconditionError("no output gradient (its RECV_B has not run)");
      }
    }
    Clock::time_point t = Clock::now();
    Tensor g = dy;
    for (int i = st.stage->size(); i-- > 0;) {
      Layer& layer = st.stage->layer(i);
      auto r = layer.BackwardInput(g, ctx, &saved[i]);
      if (!r.ok()) {
        return absl::Status(r.status().code(),
                            absl::StrCat("layer ", st.begin + i, " (", st.stage->name(i),
                                         ") backward: ", r.status().message()));
      }
      g = *std::move(r);
      if (a.kind == ActionKind::kB) {  // weight gradient right away, layer by layer
        absl::Status s = layer.BackwardWeight(ctx, &saved[i]);
        if (!s.ok()) {
          return absl::Status(s.code(),
                              absl::StrCat("layer ", st.begin + i, " (", st.stage->name(i),
                                           ") weight backward: ", s.message()));
        }
        if (final_w) PW_RETURN_IF_ERROR(LayerWeightDone(st, i));
      }
    }
    PW_RETURN_IF_ERROR(Sync());
    Record(EventKind::kCompute, a, t);
    st.b_s += events.back().end - events.back().start;
    ++st.b_n;
    if (a.kind == ActionKind::kB) saved.clear();
    st.grad_out[mb] = Tensor();
    if (!st.first) {
      if (StageRt* prev = Local(st.index - 1)) {
        prev->grad_out[mb] = std::move(g);
      } else {
        st.grad_in[mb] = std::move(g);
      }
    }
    return absl::OkStatus();
  }
  // W: the weight-gradient half.
  if (saved.size() != static_cast<size_t>(st.stage->size())) {
    return absl::FailedPreconditionError("W before this micro-batch's I");
  }
  Clock::time_point t = Clock::now();
  for (int i = st.stage->size(); i-- > 0;) {
    absl::Status s = st.stage->layer(i).BackwardWeight(ctx, &saved[i]);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("layer ", st.begin + i, " (", st.stage->name(i),
                                                 ") weight backward: ", s.message()));
    }
    if (final_w) PW_RETURN_IF_ERROR(LayerWeightDone(st, i));
  }
  saved.clear();
  PW_RETURN_IF_ERROR(Sync());
  Record(EventKind::kCompute, a, t);
  st.w_s += events.back().end - events.back().start;
  ++st.w_n;
  return absl::OkStatus();
}

absl::Status RankExecutor::LayerWeightDone(StageRt& st, int layer) {
  if (dp_comm == nullptr) return absl::OkStatus();
  int b = st.layer_bucket[layer];
  if (b < 0) return absl::OkStatus();
  if (--st.buckets[b].pending == 0) return Launch(st.buckets[b]);
  return absl::OkStatus();
}

absl::Status RankExecutor::Launch(Bucket& b) {
  const ops::Exec e{alloc.get()};
  b.flat = Tensor::Empty({b.numel}, DType::kF32, alloc.get());
  int64_t offset = 0;
  for (Parameter* p : b.params) {
    PW_RETURN_IF_ERROR(ops::CopyRange(e, p->grad, 0, b.flat, offset, p->grad.numel()));
    offset += p->grad.numel();
  }
  // NCCL orders the all-reduce after the copies with events on its own stream; the local
  // backend reads the buffer from another thread, so the copies must be done first.
  if (dp_comm->backend() != "nccl") PW_RETURN_IF_ERROR(Sync());
  b.work = dp_comm->AllReduce(b.flat);
  return absl::OkStatus();
}

absl::Status RankExecutor::AllReduceHost(Tensor& v, const std::string& what) {
  if (world->backend() != "nccl") {
    std::unique_ptr<Work> w = world->AllReduce(v);
    return WaitOrAbort(*w, what);
  }
  // NCCL reduces device buffers only: stage through the rank's GPU.
  const ops::Exec e{alloc.get()};
  Tensor d = Tensor::Empty(v.shape(), v.dtype(), alloc.get());
  PW_RETURN_IF_ERROR(ops::Copy(e, v, d));
  std::unique_ptr<Work> w = world->AllReduce(d);
  PW_RETURN_IF_ERROR(WaitOrAbort(*w, what));
  return ops::Copy(e, d, v);
}

absl::Status RankExecutor::Agree(int64_t step, float lr, StepOutcome* out) {
  const Action a{ActionKind::kOptimizerStep, 0, 0};
  Clock::time_point t = Clock::now();
  for (size_t i = 0; i < sends_.size(); ++i) {
    PW_RETURN_IF_ERROR(WaitOrAbort(*sends_[i], "send"));
  }
  sends_.clear();
  for (StageRt& st : stages) {
    for (Bucket& b : st.buckets) {
      if (b.work == nullptr) continue;
      PW_RETURN_IF_ERROR(WaitOrAbort(
          *b.work, absl::StrCat("gradient all-reduce of stage ", st.index, " across replicas")));
      int64_t offset = 0;
      for (Parameter* p : b.params) {
        PW_RETURN_IF_ERROR(
            ops::CopyRange(ops::Exec{alloc.get()}, b.flat, offset, p->grad, 0, p->grad.numel()));
        offset += p->grad.numel();
      }
      b.flat = Tensor();
      b.work.reset();
    }
  }
  // The step agreement: every replica's micro-batch losses and every layer's squared gradient
  // norm, each written by exactly one rank (zeros elsewhere, so the sum is exact), summed in a
  // fixed order by every rank.
  const int64_t M = layout.micro_batches, R = layout.replicas, L = graph->num_layers();
  Tensor v = Tensor::Zeros({R * M + L}, DType::kF64, host.get());
  double* d = v.data<double>();
  for (StageRt& st : stages) {
    if (st.last) {
      for (int64_t j = 0; j < M; ++j) d[replica * M + j] = losses_[j];
    }
    if (replica == 0) {
      for (int i = 0; i < st.stage->size(); ++i) {
        PW_ASSIGN_OR_RETURN(d[R * M + st.begin + i],
                            GradSquaredNorm(st.stage->layer(i).Parameters(), alloc.get()));
      }
    }
  }
  PW_RETURN_IF_ERROR(AllReduceHost(v, "step agreement all-reduce"));
  Record(EventKind::kAllReduce, a, t);
  double loss = 0, norm2 = 0;
  for (int64_t i = 0; i < R * M; ++i) loss += d[i];
  for (int64_t i = 0; i < L; ++i) norm2 += d[R * M + i];
  // Every rank sees the same sums, so every rank takes the same decision and keeps the same
  // loss-scaler state.
  const float scale = scaler.scale();
  out->loss = loss / static_cast<double>(R * M);
  out->grad_norm = std::sqrt(norm2) / scale;
  out->loss_scale = scale;
  const bool finite = std::isfinite(out->loss) && std::isfinite(out->grad_norm);
  if (!scaler.Update(finite)) {
    out->skipped = true;  // fp16 overflow: nothing applied anywhere, the scale backed off
    return absl::OkStatus();
  }
  if (!finite) {
    return absl::InternalError(absl::StrCat("step ", step,
                                            ": non-finite gradient norm; weights not updated on "
                                            "any rank"));
  }
  Clock::time_point o = Clock::now();
  PW_RETURN_IF_ERROR(
      ScaleGrads(params, ClipScale(out->grad_norm, opts->train.clip_norm) / scale, alloc.get()));
  PW_RETURN_IF_ERROR(optimizer->Step(lr));
  PW_RETURN_IF_ERROR(Sync());
  Record(EventKind::kOptimizer, a, o);
  return absl::OkStatus();
}

struct Engine::Impl {
  LayerGraph graph;
  EngineOptions options;
  Topology topo;
  Schedule schedule;
  std::vector<int> boundaries;
  BatchLayout layout;
  LrSchedule lr;
  std::shared_ptr<const Dataset> data;
  std::vector<std::unique_ptr<RankExecutor>> ranks;
  int64_t step = 0;
  absl::Status failed;
  double wall = 0;
  int64_t steps_run = 0;
  // Multi-process: this process holds one rank; GatherReports fills the world's reports.
  bool multi_process = false;
  bool gathered = false;
  std::vector<RankTimes> gathered_times;                // by global rank
  std::vector<std::vector<RankEvent>> gathered_events;  // by global rank

  RankExecutor* Find(int global) const {
    for (const auto& r : ranks) {
      if (r->global == global) return r.get();
    }
    return nullptr;
  }

  // Runs fn(rank) on one thread per rank and returns the first error (the world's abort
  // status when a rank aborted).
  template <typename Fn>
  absl::Status OnEveryRank(Fn fn) {
    std::vector<absl::Status> status(ranks.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ranks.size(); ++i) {
      threads.emplace_back([&, i] {
        try {
          status[i] = ranks[i]->BindDevice();
          if (status[i].ok()) status[i] = fn(*ranks[i]);
        } catch (const std::exception& e) {
          status[i] = absl::InternalError(absl::StrCat(ranks[i]->Who(), ": exception: ", e.what()));
        }
        if (!status[i].ok()) ranks[i]->world->Abort(status[i]);
      });
    }
    for (std::thread& t : threads) t.join();
    absl::Status first = ranks[0]->world->abort_status();
    if (!first.ok()) return first;
    for (const absl::Status& s : status) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() {
  // Communicators first: a backend may still hold buffers from any rank's allocator (a
  // receive posted before an abort), and every allocator must outlive them.
  for (auto& r : impl_->ranks) r->dp_comm.reset();
  for (auto& r : impl_->ranks) r->world.reset();
  for (auto& r : impl_->ranks) {
    if (!r->on_cuda()) continue;
    // Device memory is freed on the rank's stream, from this thread: make its GPU current,
    // drop every device tensor, drain the stream, then release the stream's cuBLAS context.
    (void)r->BindDevice();
    r->stages.clear();
    r->optimizer.reset();
    r->params.clear();
    (void)r->Sync();
    ops::ReleaseStream(r->alloc->stream());
  }
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const LayerGraph& graph,
                                                       const EngineOptions& options) {
  return Create(graph, options, nullptr);
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const LayerGraph& graph, const EngineOptions& options,
    std::unique_ptr<Communicator> process_world) {
  const TrainOptions& to = options.train;
  if (options.pp < 1) return absl::InvalidArgumentError("--pp must be >= 1");
  if (options.dp < 1) return absl::InvalidArgumentError("--dp must be >= 1");
  if (to.micro_batches < 1) return absl::InvalidArgumentError("--micro-batches must be >= 1");
  if (to.steps < 0) return absl::InvalidArgumentError("--steps must be >= 0");
  if (!(to.lr > 0) || !std::isfinite(to.lr)) {
    return absl::InvalidArgumentError("--lr must be a positive number");
  }
  if (to.precision == Precision::kFp16) PW_RETURN_IF_ERROR(LossScaler::Validate(to.loss_scale));
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the timeout must be positive");
  }
  if (to.micro_batches > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError("--micro-batches is too large");
  }
  auto impl = std::make_unique<Impl>();
  impl->graph = graph;
  impl->options = options;
  impl->topo = Topology{options.pp, options.dp};
  ScheduleSpec spec{options.schedule, options.pp, static_cast<int>(to.micro_batches),
                    options.chunks};
  PW_ASSIGN_OR_RETURN(impl->schedule, GenerateSchedule(spec));
  PW_RETURN_IF_ERROR(LowerComm(impl->schedule));
  PW_RETURN_IF_ERROR(Validate(impl->schedule));
  const Schedule& sched = impl->schedule;
  const int S = sched.num_stages, L = graph.num_layers();
  if (options.stage_boundaries.empty()) {
    PW_ASSIGN_OR_RETURN(impl->boundaries, BalancedBoundaries(graph, S));
  } else {
    const std::vector<int>& b = options.stage_boundaries;
    if (static_cast<int>(b.size()) != S + 1 || b.front() != 0 || b.back() != L) {
      return absl::InvalidArgumentError(absl::StrCat("stage boundaries must be ", S + 1,
                                                     " layer indices from 0 to ", L, " (got [",
                                                     absl::StrJoin(b, ", "), "])"));
    }
    for (int s = 0; s < S; ++s) {
      if (b[s] >= b[s + 1]) {
        return absl::InvalidArgumentError(
            absl::StrCat("stage ", s, ": layer range [", b[s], ", ", b[s + 1], ") is empty"));
      }
    }
    impl->boundaries = b;
  }
  if (!options.stage_recompute.empty() && static_cast<int>(options.stage_recompute.size()) != S) {
    return absl::InvalidArgumentError(absl::StrCat("per-stage recompute lists ",
                                                   options.stage_recompute.size(),
                                                   " stages; the schedule has ", S));
  }
  impl->layout = {to.micro_batches, graph.shape().batch, graph.shape().seq_len, options.dp};
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Dataset> ds,
                      OpenDataset(to.data, graph.shape().seq_len, to.seed));
  impl->data = std::move(ds);
  impl->lr.peak =
      ScaleLearningRate(to.lr, impl->layout.global_batch(), to.base_batch, to.lr_scaling);
  impl->lr.warmup_steps = to.warmup_steps;
  impl->lr.total_steps = std::max<int64_t>(1, to.steps);
  impl->lr.min_ratio = to.min_lr_ratio;

  // Stage input and output shapes from the layers' shape functions (nothing allocated).
  std::vector<std::vector<int64_t>> shape_at(L + 1);
  shape_at[0] = {graph.shape().batch, graph.shape().seq_len};
  for (int i = 0; i < L; ++i) shape_at[i + 1] = graph.node(i).spec->OutputShape(shape_at[i]);

  // Devices: rank g on cuda_devices[g % n]. NCCL needs one GPU per rank; ranks sharing a GPU
  // use the local backend with device buffers.
  const int world_size = impl->topo.world_size();
  std::vector<int> rank_gpu(world_size, -1);
  bool distinct_gpus = false;
  if (options.device.is_cuda()) {
    const int visible = CudaDeviceCount();
    if (visible == 0) {
      return absl::FailedPreconditionError(
          "--device cuda: no CUDA GPU is visible (no driver, no device, or CUDA_VISIBLE_DEVICES "
          "hides them); run on the CPU with --device cpu");
    }
    std::vector<int> gpus = options.cuda_devices;
    if (gpus.empty()) {
      for (int d = 0; d < visible; ++d) gpus.push_back(d);
    }
    for (int d : gpus) {
      if (d < 0 || d >= visible) {
        return absl::InvalidArgumentError(
            absl::StrCat("CUDA device ", d, " does not exist (", visible, " visible)"));
      }
    }
    for (int g = 0; g < world_size; ++g) rank_gpu[g] = gpus[g % gpus.size()];
    distinct_gpus = static_cast<int>(gpus.size()) >= world_size;
  }
  if (options.comm != "auto" && options.comm != "local" && options.comm != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat(
        "communication backend must be auto, local or nccl, not '", options.comm, "'"));
  }
  // In one process the engine picks the backend; with a launcher's world it is that world's.
  const bool use_nccl =
      process_world != nullptr
          ? process_world->backend() == "nccl"
          : options.comm == "nccl" || (options.comm == "auto" && options.device.is_cuda() &&
                                       distinct_gpus && world_size > 1);
  if (process_world == nullptr && use_nccl && (!options.device.is_cuda() || !distinct_gpus)) {
    return absl::InvalidArgumentError(
        "the NCCL backend needs --device cuda and one GPU per rank (pp x dp GPUs)");
  }
  // A multi-process run: this process is one global rank of a launcher's world.
  int only_rank = -1;
  if (process_world != nullptr) {
    if (process_world->size() != world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the layout needs pp x dp = ", options.pp, " x ", options.dp, " = ", world_size,
          " ranks, but the launcher started ", process_world->size(),
          " processes (start exactly one process per rank: mpirun -np ", world_size, ")"));
    }
    only_rank = process_world->rank();
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  if (process_world != nullptr) {
    if (use_nccl) PW_RETURN_IF_ERROR(CheckFifoOrder(sched));
    comms.resize(world_size);
    comms[only_rank] = std::move(process_world);
  } else if (use_nccl) {
    PW_RETURN_IF_ERROR(CheckFifoOrder(sched));
    PW_ASSIGN_OR_RETURN(comms, CreateNcclWorld(rank_gpu, options.timeout));
  } else {
    comms = CreateLocalWorld(world_size);
  }
  impl->multi_process = only_rank >= 0;
  if (only_rank >= 0) {
    // Processes start their clocks together (to within a barrier), so their trace events line
    // up in one timeline.
    std::unique_ptr<Work> b = comms[only_rank]->Barrier();
    PW_RETURN_IF_ERROR(b->Wait(options.timeout));
  }
  const Clock::time_point epoch = Clock::now();
  for (int g = 0; g < world_size; ++g) {
    if (only_rank >= 0 && g != only_rank) continue;
    auto ex = std::make_unique<RankExecutor>();
    ex->slot = static_cast<int>(impl->ranks.size());
    if (rank_gpu[g] >= 0) {
      // One process per rank picks its GPU itself (cuda_devices[0], e.g. by local rank).
      if (only_rank >= 0) rank_gpu[g] = options.cuda_devices.empty() ? 0 : options.cuda_devices[0];
      ex->cuda_device = rank_gpu[g];
      PW_RETURN_IF_ERROR(ex->BindDevice());
      PW_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(Device::Cuda(rank_gpu[g])));
      ex->stream = std::make_unique<CudaStream>(std::move(stream));
      PW_ASSIGN_OR_RETURN(ex->alloc, CreateCudaAllocator(rank_gpu[g], ex->stream->get()));
    }
    ex->global = g;
    ex->pipe = impl->topo.PipelineRank(g);
    ex->replica = impl->topo.Replica(g);
    ex->topo = impl->topo;
    ex->schedule = &impl->schedule;
    ex->opts = &impl->options;
    ex->graph = &impl->graph;
    ex->data = impl->data;
    ex->layout = impl->layout;
    ex->epoch = epoch;
    ex->world = std::move(comms[g]);
    ex->local.assign(S, -1);
    const Program& prog = sched.programs[ex->pipe];
    for (int s = 0; s < S; ++s) {
      if (sched.stage_rank[s] != ex->pipe) continue;
      StageRt st;
      st.index = s;
      st.begin = impl->boundaries[s];
      st.end = impl->boundaries[s + 1];
      st.first = s == 0;
      st.last = s == S - 1;
      st.recompute =
          (options.stage_recompute.empty() ? options.recompute : options.stage_recompute[s]) ==
          Recompute::kFull;
      // Parameters are initialised on the host (from the seed and their global names), then
      // moved to the rank's device.
      PW_ASSIGN_OR_RETURN(st.stage,
                          graph.Instantiate(st.begin, st.end, to.seed,
                                            ex->on_cuda() ? ex->host.get() : ex->alloc.get()));
      if (ex->on_cuda()) {
        for (Parameter* p : st.stage->Parameters()) {
          Tensor v = Tensor::Empty(p->value.shape(), DType::kF32, ex->alloc.get());
          PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{ex->alloc.get()}, p->value, v));
          p->value = std::move(v);
          p->grad = Tensor::Zeros(p->value.shape(), DType::kF32, ex->alloc.get());
        }
        PW_RETURN_IF_ERROR(ex->Sync());
      }
      st.in_shape = shape_at[st.begin];
      st.in_dtype = st.first ? DType::kI32 : DType::kF32;
      st.out_shape = shape_at[st.end];
      for (size_t i = 0; i < prog.actions.size(); ++i) {
        const Action& a = prog.actions[i];
        if (a.virtual_stage == s && (a.kind == ActionKind::kB || a.kind == ActionKind::kW)) {
          st.last_backward = static_cast<int>(i);
        }
      }
      // Buckets in backward order (last layer first), closed once they reach bucket_bytes.
      st.layer_bucket.assign(st.stage->size(), -1);
      int64_t bytes = 0;
      for (int i = st.stage->size(); i-- > 0;) {
        std::vector<Parameter*> ps = st.stage->layer(i).Parameters();
        if (ps.empty()) continue;
        if (st.buckets.empty() || bytes >= options.bucket_bytes) {
          st.buckets.emplace_back();
          st.bucket_pending0.push_back(0);
          bytes = 0;
        }
        Bucket& b = st.buckets.back();
        for (Parameter* p : ps) {
          b.params.push_back(p);
          b.numel += p->grad.numel();
          bytes += static_cast<int64_t>(p->grad.nbytes());
        }
        ++st.bucket_pending0.back();
        st.layer_bucket[i] = static_cast<int>(st.buckets.size()) - 1;
      }
      ex->local[s] = static_cast<int>(ex->stages.size());
      ex->stages.push_back(std::move(st));
    }
    for (StageRt& st : ex->stages) {
      for (Parameter* p : st.stage->Parameters()) ex->params.push_back(p);
    }
    if (ex->on_cuda() && to.optimizer.kind != OptimizerKind::kAdamW) {
      return absl::InvalidArgumentError("--device cuda supports --optimizer adamw only");
    }
    ex->optimizer = Optimizer::Create(to.optimizer, ex->params, ex->alloc.get());
    if (to.precision == Precision::kFp16) ex->scaler = LossScaler(to.loss_scale);
    ex->static_bytes = ex->alloc->current_bytes();
    ex->total.global_rank = g;
    ex->total.pipeline_rank = ex->pipe;
    ex->total.replica = ex->replica;
    impl->ranks.push_back(std::move(ex));
  }
  if (options.dp > 1) {
    const absl::Duration timeout = options.timeout;
    PW_RETURN_IF_ERROR(impl->OnEveryRank([timeout](RankExecutor& r) -> absl::Status {
      PW_ASSIGN_OR_RETURN(r.dp_comm, r.world->Split(r.pipe, r.replica, timeout));
      return absl::OkStatus();
    }));
  }
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

absl::StatusOr<StepReport> Engine::Step() {
  Impl& m = *impl_;
  if (!m.failed.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the engine stopped after an earlier failure: ", m.failed.message()));
  }
  const float lr = m.lr.At(m.step);
  const int64_t step = m.step;
  std::vector<StepOutcome> outcomes(m.ranks.size());
  Clock::time_point t0 = Clock::now();
  absl::Status s =
      m.OnEveryRank([&](RankExecutor& r) { return r.RunStep(step, lr, &outcomes[r.slot]); });
  if (!s.ok()) {
    m.failed = s;
    return s;
  }
  StepReport rep;
  rep.result.step = step;
  rep.result.loss = outcomes[0].loss;
  rep.result.grad_norm = outcomes[0].grad_norm;
  rep.result.loss_scale = outcomes[0].loss_scale;
  rep.result.skipped = outcomes[0].skipped;
  rep.result.lr = lr;
  rep.result.step_time_s = Seconds(t0, Clock::now());
  rep.result.samples_per_s =
      rep.result.step_time_s > 0 ? m.layout.global_batch() / rep.result.step_time_s : 0;
  for (auto& r : m.ranks) {
    RankTimes t = r->step_times;
    t.global_rank = r->global;
    t.pipeline_rank = r->pipe;
    t.replica = r->replica;
    for (const StageRt& st : r->stages) t.stages.push_back(st.index);
    rep.result.data_wait_s = std::max(rep.result.data_wait_s, t.data_wait);
    rep.ranks.push_back(std::move(t));
  }
  m.wall += rep.result.step_time_s;
  ++m.steps_run;
  ++m.step;
  return rep;
}

int64_t Engine::step() const { return impl_->step; }
int64_t Engine::global_batch() const { return impl_->layout.global_batch(); }
float Engine::PeakLr() const { return impl_->lr.peak; }
const Schedule& Engine::schedule() const { return impl_->schedule; }
const std::vector<int>& Engine::stage_boundaries() const { return impl_->boundaries; }
const Topology& Engine::topology() const { return impl_->topo; }

NamedTensors Engine::Weights() const {
  NamedTensors out;
  for (int s = 0; s < impl_->schedule.num_stages; ++s) {
    // Multi-process: only the stages this process holds (when it is in replica 0).
    RankExecutor* rp = impl_->Find(impl_->topo.GlobalRank(impl_->schedule.stage_rank[s], 0));
    if (rp == nullptr) continue;
    RankExecutor& r = *rp;
    PW_CHECK(r.BindDevice().ok());
    for (Parameter* q : r.Local(s)->stage->Parameters()) {
      if (q->value.device().is_cpu()) {
        out.emplace_back(q->name, q->value.Clone());
      } else {
        // A device that fails a copy of its own weights has failed; internal invariant.
        absl::StatusOr<Tensor> h = r.ToHost(q->value);
        PW_CHECK(h.ok());
        out.emplace_back(q->name, *std::move(h));
      }
    }
  }
  return out;
}

absl::Status Engine::Save(const std::string& dir) const {
  const Impl& m = *impl_;
  if (m.multi_process) {
    return absl::UnimplementedError(
        "--save in a multi-process run is not supported yet: the weights live in different "
        "processes (run the same plan in one process to checkpoint it)");
  }
  internal::ManifestInfo info;
  info.graph = &m.graph;
  info.options = &m.options.train;
  info.layout = m.layout;
  info.pp = m.topo.pp;
  info.dp = m.topo.dp;
  info.chunks = m.schedule.spec.chunks;
  info.schedule = ScheduleKindName(m.schedule.spec.kind);
  info.step = m.step;
  info.optimizer_step = m.ranks[0]->optimizer->step_count();
  info.lr = m.lr;
  info.scaler = &m.ranks[0]->scaler;
  // Replica 0 holds every stage: weights in model order, and every rank's optimizer state.
  NamedTensors model = Weights(), opt;
  for (const auto& r : m.ranks) {
    if (r->replica != 0) continue;
    PW_RETURN_IF_ERROR(r->BindDevice());
    for (auto& [name, t] : r->optimizer->State()) {
      PW_ASSIGN_OR_RETURN(Tensor h, r->ToHost(t));
      opt.emplace_back(name, std::move(h));
    }
  }
  return WriteCheckpoint(dir, internal::BuildManifest(info), model, opt);
}

absl::Status Engine::Resume(const std::string& dir) {
  Impl& m = *impl_;
  PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadCheckpoint(dir));
  PW_ASSIGN_OR_RETURN(internal::ResumePoint at,
                      internal::CheckManifest(dir, ck.manifest_json, m.graph, m.layout,
                                              m.options.train.optimizer.kind));
  for (auto& r : m.ranks) PW_RETURN_IF_ERROR(internal::CheckParameters(dir, ck.model, r->params));
  for (auto& r : m.ranks) {
    PW_RETURN_IF_ERROR(r->BindDevice());
    PW_RETURN_IF_ERROR(r->optimizer->LoadState(ck.optimizer, at.optimizer_step));
  }
  for (auto& r : m.ranks) {
    PW_RETURN_IF_ERROR(r->BindDevice());
    for (Parameter* p : r->params) {
      PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{r->alloc.get()}, ck.model.at(p->name), p->value));
    }
    PW_RETURN_IF_ERROR(r->Sync());
    internal::RestoreLossScaler(at, &r->scaler);
    r->loader.reset();  // restarts at the checkpoint's data position
  }
  m.step = at.step;
  return absl::OkStatus();
}

std::vector<std::vector<RankEvent>> Engine::Events() const {
  if (impl_->gathered) return impl_->gathered_events;
  std::vector<std::vector<RankEvent>> out;
  for (const auto& r : impl_->ranks) out.push_back(r->events);
  return out;
}

RankTimes RankExecutor::Totals() const {
  RankTimes t = total;
  t.static_memory_bytes = static_bytes;
  for (const StageRt& st : stages) {
    t.stages.push_back(st.index);
    auto mean = [](double v, int64_t k) { return k > 0 ? v / k : 0.0; };
    t.stage_f.push_back(mean(st.f_s, st.f_n));
    t.stage_b.push_back(mean(st.b_s + st.rc_s, st.b_n));
    t.stage_w.push_back(mean(st.w_s, st.w_n));
  }
  return t;
}

namespace {

// Every process's `mine`, in world-rank order: two sums over the world (lengths, then the
// zero-padded values, each process writing only its own slot, so the sums are exact).
absl::StatusOr<std::vector<std::vector<double>>> AllGather(RankExecutor& r,
                                                           const std::vector<double>& mine,
                                                           const std::string& what) {
  const int n = r.world->size(), me = r.world->rank();
  Tensor counts = Tensor::Zeros({n}, DType::kF64);
  counts.data<double>()[me] = static_cast<double>(mine.size());
  PW_RETURN_IF_ERROR(r.AllReduceHost(counts, what));
  int64_t longest = 1;
  for (int i = 0; i < n; ++i) {
    longest = std::max(longest, static_cast<int64_t>(counts.data<double>()[i]));
  }
  Tensor flat = Tensor::Zeros({n * longest}, DType::kF64);
  std::copy(mine.begin(), mine.end(), flat.data<double>() + me * longest);
  PW_RETURN_IF_ERROR(r.AllReduceHost(flat, what));
  std::vector<std::vector<double>> out(n);
  for (int i = 0; i < n; ++i) {
    const double* p = flat.data<double>() + i * longest;
    out[i].assign(p, p + static_cast<int64_t>(counts.data<double>()[i]));
  }
  return out;
}

}  // namespace

absl::Status Engine::GatherReports() {
  Impl& m = *impl_;
  if (!m.multi_process) return absl::OkStatus();
  RankExecutor& r = *m.ranks[0];
  PW_RETURN_IF_ERROR(r.BindDevice());
  // Rank times: 14 scalars, then (stage, forward, backward, weight) per stage.
  const RankTimes t = r.Totals();
  std::vector<double> mine = {double(t.global_rank),
                              double(t.pipeline_rank),
                              double(t.replica),
                              t.compute,
                              t.recompute,
                              t.p2p_wait,
                              t.all_reduce,
                              t.optimizer,
                              t.data_wait,
                              t.idle,
                              t.wall,
                              double(t.peak_memory_bytes),
                              double(t.peak_activation_bytes),
                              double(r.static_bytes)};
  for (size_t i = 0; i < t.stages.size(); ++i) {
    mine.insert(mine.end(), {double(t.stages[i]), t.stage_f[i], t.stage_b[i], t.stage_w[i]});
  }
  PW_ASSIGN_OR_RETURN(auto times, AllGather(r, mine, "gathering rank times"));
  // Events: 9 numbers each.
  std::vector<double> ev;
  for (const RankEvent& e : r.events) {
    ev.insert(ev.end(), {double(e.kind), double(e.action.kind), double(e.action.virtual_stage),
                         double(e.action.micro_batch), double(e.peer), double(e.tag),
                         double(e.step), e.start, e.end});
  }
  PW_ASSIGN_OR_RETURN(auto events, AllGather(r, ev, "gathering trace events"));
  m.gathered_times.clear();
  m.gathered_events.clear();
  for (size_t g = 0; g < times.size(); ++g) {
    const std::vector<double>& v = times[g];
    if (v.size() < 14 || (v.size() - 14) % 4 != 0) {
      return absl::InternalError(absl::StrCat("rank ", g, " sent a malformed report"));
    }
    RankTimes x;
    x.global_rank = static_cast<int>(v[0]);
    x.pipeline_rank = static_cast<int>(v[1]);
    x.replica = static_cast<int>(v[2]);
    x.compute = v[3];
    x.recompute = v[4];
    x.p2p_wait = v[5];
    x.all_reduce = v[6];
    x.optimizer = v[7];
    x.data_wait = v[8];
    x.idle = v[9];
    x.wall = v[10];
    x.peak_memory_bytes = static_cast<int64_t>(v[11]);
    x.peak_activation_bytes = static_cast<int64_t>(v[12]);
    x.static_memory_bytes = static_cast<int64_t>(v[13]);
    for (size_t i = 14; i + 3 < v.size(); i += 4) {
      x.stages.push_back(static_cast<int>(v[i]));
      x.stage_f.push_back(v[i + 1]);
      x.stage_b.push_back(v[i + 2]);
      x.stage_w.push_back(v[i + 3]);
    }
    m.gathered_times.push_back(std::move(x));
    std::vector<RankEvent> list;
    const std::vector<double>& e = events[g];
    for (size_t i = 0; i + 8 < e.size(); i += 9) {
      RankEvent re;
      re.kind = static_cast<EventKind>(static_cast<int>(e[i]));
      re.action = Action{static_cast<ActionKind>(static_cast<int>(e[i + 1])),
                         static_cast<int>(e[i + 2]), static_cast<int>(e[i + 3])};
      re.peer = static_cast<int>(e[i + 4]);
      re.tag = static_cast<int64_t>(e[i + 5]);
      re.step = static_cast<int64_t>(e[i + 6]);
      re.start = e[i + 7];
      re.end = e[i + 8];
      list.push_back(re);
    }
    m.gathered_events.push_back(std::move(list));
  }
  m.gathered = true;
  return absl::OkStatus();
}

RunSummary Engine::Summary() const {
  const Impl& m = *impl_;
  RunSummary s;
  s.steps = m.steps_run;
  s.wall_s = m.wall;
  s.measured_step_s = m.steps_run > 0 ? m.wall / m.steps_run : 0;
  const int S = m.schedule.num_stages;
  std::vector<double> f(S, 0), b(S, 0), w(S, 0);
  std::vector<int> n(S, 0);
  double busy = 0, walls = 0, optimizer = 0;
  std::vector<RankTimes> all = m.gathered_times;
  if (!m.gathered) {
    for (const auto& r : m.ranks) all.push_back(r->Totals());
  }
  for (RankTimes& t : all) {
    for (size_t i = 0; i < t.stages.size(); ++i) {
      f[t.stages[i]] += t.stage_f[i];
      b[t.stages[i]] += t.stage_b[i];
      w[t.stages[i]] += t.stage_w[i];
      ++n[t.stages[i]];
    }
    busy += t.compute + t.recompute + t.optimizer;
    walls += t.wall;
    optimizer = std::max(optimizer, m.steps_run > 0 ? t.optimizer / m.steps_run : 0.0);
    s.ranks.push_back(std::move(t));
  }
  s.measured_bubble = walls > 0 ? std::max(0.0, 1.0 - busy / walls) : 0;
  // Bottleneck: the rank with the most compute; name the second cause when waiting dominates.
  double most = -1, mean_compute = 0;
  for (const RankTimes& t : s.ranks) {
    double c = t.compute + t.recompute;
    mean_compute += c / s.ranks.size();
    if (c > most) {
      most = c;
      s.bottleneck_rank = t.global_rank;
    }
  }
  if (m.steps_run > 0) {
    const RankTimes* bp = &s.ranks[0];
    for (const RankTimes& t : s.ranks) {
      if (t.global_rank == s.bottleneck_rank) bp = &t;
    }
    const RankTimes& bt = *bp;
    s.bottleneck_reason = absl::StrFormat(
        "rank %d computes %.1f ms per step (mean over ranks %.1f ms); it waits %.1f ms on P2P, "
        "%.1f ms on all-reduce, %.1f ms on data",
        bt.global_rank, 1e3 * most / m.steps_run, 1e3 * mean_compute / m.steps_run,
        1e3 * bt.p2p_wait / m.steps_run, 1e3 * bt.all_reduce / m.steps_run,
        1e3 * bt.data_wait / m.steps_run);
    SimCosts costs;
    for (int st = 0; st < S; ++st) {
      costs.stage_f.push_back(n[st] ? f[st] / n[st] : 0);
      costs.stage_b.push_back(n[st] ? b[st] / n[st] : 0);
      costs.stage_w.push_back(n[st] ? w[st] / n[st] : 0);
    }
    costs.optimizer_time = optimizer;
    absl::StatusOr<SimResult> sim = Simulate(m.schedule, costs);
    if (sim.ok()) {
      s.predicted_step_s = sim->makespan;
      s.predicted_bubble = sim->bubble_fraction;
    }
  }
  return s;
}

}  // namespace pipewright
