// RankExecutor: one step of the rank's program — the action interpreter, forward, backward and
// the step agreement (rank_executor.h).
#include <cmath>
#include <exception>

#include "absl/strings/str_cat.h"
#include "runtime/engine/rank_executor.h"

namespace pipewright::internal {
namespace {

// `s` with "<who> <action>: " in front of its message.
absl::Status Named(const absl::Status& s, const std::string& who, const Action& a) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(who, " ", a.ToString(), ": ", s.message()));
}

// `s` with "layer <global index> (<name>) <pass>: " in front of its message.
absl::Status InLayer(const absl::Status& s, const StageRt& st, int i, const char* pass) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("layer ", st.begin + i, " (", st.stage->name(i), ") ",
                                             pass, ": ", s.message()));
}

}  // namespace

void RankExecutor::BeginStep(int64_t step) {
  step_ = step;
  step_times_ = RankTimes{};
  tp_.collective_s = 0;
  const int M = ctx_->run->micro_batches();
  ZeroGrads(params_);
  // The masters changed at the last update (Note [16-bit weights once a step]).
  half_weights_.Clear();
  step_events_ = events_.size();
  buckets_.Clear();  // before the strategy drops the last step's Works (BucketWatch)
  for (StageRt& st : stages_) {
    st.saved.assign(M, {});
    st.input.assign(M, Tensor());
    st.output.assign(M, Tensor());
    st.grad_out.assign(M, Tensor());
    st.grad_in.assign(M, Tensor());
  }
  dp_->BeginStep();
  recvs_.clear();
  losses_.assign(M, 0.0);
  dev_inputs_.assign(M, Tensor());
  dev_targets_.assign(M, Tensor());
  sends_.clear();
}

absl::Status RankExecutor::RunStep(int64_t step, float lr, StepOutcome* out) {
  const Clock::time_point t0 = Clock::now();
  alloc_->ResetPeak();
  const int64_t start_bytes = alloc_->current_bytes();
  BeginStep(step);
  if (needs_data()) {
    if (loader_ == nullptr) {
      // Only ranks holding the first or the last stage get here (needs_data): the others
      // neither build batches nor touch the data's pages.
      loader_ = std::make_unique<DataLoader>(data_, ctx_->layout(), replica_, step, /*prefetch=*/2,
                                             ctx_->options->data_workers);
    }
    Clock::time_point t = Clock::now();
    flight_.Begin(step, "DATA (the step's batch from the loader)", Now());
    batch_ = loader_->Next();
    flight_.End(Now());
    Record(EventKind::kDataWait, Action{ActionKind::kF, -1, -1}, t);
    if (batch_.step != step) {
      return absl::InternalError(
          absl::StrCat(Who(), ": data loader is at step ", batch_.step, ", expected ", step));
    }
  }
  const Program& prog = program();
  const TrainTestingHooks& hooks = *ctx_->testing;
  const bool group_p2p = groups_.world()->capabilities().grouped_p2p;
  for (size_t i = 0; i < prog.actions.size(); ++i) {
    const Action& a = prog.actions[i];
    absl::Status s;
    if (global_ == hooks.inject_failure_rank && step == hooks.inject_failure_step &&
        (a.kind == ActionKind::kB || a.kind == ActionKind::kI)) {
      groups_.world()->Abort(
          absl::InternalError(absl::StrCat(Who(), " ", a.ToString(), ": injected failure")));
      return groups_.world()->abort_status();
    }
    try {
      if (group_p2p && IsComm(a.kind)) {
        size_t end = i + 1;
        while (end < prog.actions.size() && IsComm(prog.actions[end].kind)) ++end;
        std::string label = "P2P group";
        for (size_t j = i; j < end; ++j) absl::StrAppend(&label, " ", prog.actions[j].ToString());
        flight_.Begin(step, std::move(label), Now());
        s = RunP2PGroup(i, end);
        i = end - 1;
      } else {
        flight_.Begin(step, a.ToString(), Now());
        s = RunAction(a, static_cast<int>(i), step, lr, out);
      }
      if (s.ok()) flight_.End(Now());
    } catch (const std::exception& e) {
      s = absl::InternalError(absl::StrCat(Who(), " ", a.ToString(), ": exception: ", e.what()));
    } catch (...) {
      s = absl::InternalError(absl::StrCat(Who(), " ", a.ToString(), ": unknown exception"));
    }
    if (!s.ok()) {
      groups_.world()->Abort(s);
      return groups_.world()->abort_status();
    }
  }
  if (absl::Status s = AwaitAllRecvs(); !s.ok()) {
    groups_.world()->Abort(s);
    return groups_.world()->abort_status();
  }
  EndStep(t0, start_bytes);
  return absl::OkStatus();
}

absl::Status RankExecutor::RunAction(const Action& a, int index, int64_t step, float lr,
                                     StepOutcome* out) {
  if (a.kind == ActionKind::kOptimizerStep) return Agree(step, lr, out);
  if (IsComm(a.kind)) {
    if (a.kind == ActionKind::kSendF || a.kind == ActionKind::kSendB) return IssueSend(a);
    PendingRecv r;
    PW_RETURN_IF_ERROR(PostRecv(a, &r));
    recvs_.push_back(std::move(r));
    return absl::OkStatus();
  }
  StageRt* st = Local(a.virtual_stage);
  if (st == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(Who(), " ", a.ToString(), ": stage ",
                                                   a.virtual_stage, " is not on this rank"));
  }
  if (a.kind == ActionKind::kReduceGrads) {
    PW_RETURN_IF_ERROR(dp_->StageReady(local_[a.virtual_stage]));
    buckets_.Poll();
    return absl::OkStatus();
  }
  if (a.micro_batch < 0 || a.micro_batch >= ctx_->run->micro_batches()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Who(), " ", a.ToString(), ": micro-batch out of range"));
  }
  switch (a.kind) {
    case ActionKind::kF: {
      PW_RETURN_IF_ERROR(AwaitRecv(*st, a.micro_batch, /*forward=*/true));
      Clock::time_point t = Clock::now();
      absl::Status s = Forward(*st, a.micro_batch);
      Record(EventKind::kCompute, a, t);
      st->f_s += events_.back().end - events_.back().start;
      ++st->f_n;
      return Named(s, Who(), a);
    }
    case ActionKind::kB:
    case ActionKind::kI:
      PW_RETURN_IF_ERROR(AwaitRecv(*st, a.micro_batch, /*forward=*/false));
      return Named(Backward(*st, a, index), Who(), a);
    case ActionKind::kW:
      return Named(WeightBackward(*st, a, index), Who(), a);
    default:
      return absl::InternalError(absl::StrCat(Who(), " ", a.ToString(), ": unknown action"));
  }
}

absl::StatusOr<Tensor> RankExecutor::Inputs(int mb) {
  if (!on_cuda()) return batch_.inputs[mb];
  if (!dev_inputs_[mb].defined()) {
    const Tensor& h = batch_.inputs[mb];
    Tensor d = Tensor::Empty(h.shape(), h.dtype(), alloc_.get());
    PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc_.get()}, h, d));
    dev_inputs_[mb] = std::move(d);
  }
  return dev_inputs_[mb];
}

absl::StatusOr<const Tensor*> RankExecutor::Targets(int mb) {
  if (!on_cuda()) return &batch_.targets[mb];
  if (!dev_targets_[mb].defined()) {
    const Tensor& h = batch_.targets[mb];
    Tensor d = Tensor::Empty(h.shape(), h.dtype(), alloc_.get());
    PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc_.get()}, h, d));
    dev_targets_[mb] = std::move(d);
  }
  return &dev_targets_[mb];
}

absl::StatusOr<LayerContext> RankExecutor::ContextFor(const StageRt& st, int mb) {
  const Tensor* targets = nullptr;
  if (st.last) {
    PW_ASSIGN_OR_RETURN(targets, Targets(mb));
  }
  LayerContext lc{alloc_.get(), targets, ComputeDType(ctx_->options->precision)};
  lc.selective_recompute = st.recompute == Recompute::kSelective;
  if (tp_.comm != nullptr) lc.tp = &tp_;
  if (dp_ != nullptr) lc.gradients = dp_->observer(local_[st.index]);
  if (lc.compute_dtype != DType::kF32 && !ctx_->testing->half_weights_every_use) {
    lc.half_weights = &half_weights_;
  }
  return lc;
}

absl::Status RankExecutor::Forward(StageRt& st, int mb) {
  Tensor x;
  if (st.first) {
    PW_ASSIGN_OR_RETURN(x, Inputs(mb));
  } else {
    x = st.input[mb];
  }
  if (!x.defined()) {
    return absl::FailedPreconditionError("no input activation (its RECV_F has not run)");
  }
  PW_ASSIGN_OR_RETURN(const LayerContext lc, ContextFor(st, mb));
  Tensor y;
  if (st.recompute == Recompute::kFull) {
    // Keep only the stage input; every layer's saved state is dropped as soon as it is made.
    Tensor h = x;
    for (int i = 0; i < st.stage->size(); ++i) {
      Saved tmp;
      absl::StatusOr<Tensor> r = st.stage->layer(i).Forward(h, lc, &tmp);
      PW_RETURN_IF_ERROR(InLayer(r.status(), st, i, "forward"));
      h = *std::move(r);
    }
    y = std::move(h);
    st.input[mb] = x;
  } else {
    PW_ASSIGN_OR_RETURN(y, st.stage->Forward(x, lc, &st.saved[mb]));
    st.input[mb] = Tensor();
  }
  PW_RETURN_IF_ERROR(Sync());
  if (st.last) {
    const float l = y.data<float>()[0];
    // With loss scaling a non-finite loss skips the step everywhere (see Agree); otherwise it
    // is an error.
    if (!std::isfinite(l) && !scaler_.enabled()) {
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

// B (input and weight gradients, layer by layer) or I (input gradients only).
absl::Status RankExecutor::Backward(StageRt& st, const Action& a, int index) {
  const int mb = a.micro_batch;
  PW_ASSIGN_OR_RETURN(const LayerContext lc, ContextFor(st, mb));
  const bool final_w = index == st.last_backward;
  std::vector<Saved>& saved = st.saved[mb];
  if (st.recompute == Recompute::kFull) {
    Tensor x;
    if (st.first) {
      PW_ASSIGN_OR_RETURN(x, Inputs(mb));
    } else {
      x = st.input[mb];
    }
    if (!x.defined()) return absl::FailedPreconditionError("no stage input to recompute from");
    Clock::time_point t = Clock::now();
    absl::StatusOr<Tensor> y = st.stage->Forward(x, lc, &saved);
    if (y.ok()) PW_RETURN_IF_ERROR(Sync());
    Record(EventKind::kRecompute, a, t);
    st.rc_s += events_.back().end - events_.back().start;
    PW_RETURN_IF_ERROR(y.status());
    st.input[mb] = Tensor();
  }
  if (saved.size() != static_cast<size_t>(st.stage->size())) {
    return absl::FailedPreconditionError("backward before this micro-batch's forward");
  }
  Tensor dy;
  if (st.last) {
    const BatchLayout l = ctx_->layout();
    dy = Tensor::Empty({1}, DType::kF32, host_.get());  // a host scalar on every device
    // The mean over the batch of the replicas one step's gradient spans: the global batch, or
    // (asynchronous DP: each replica's gradient is an update of its own) the replica's.
    dy.data<float>()[0] =
        scaler_.scale() / static_cast<float>(l.micro_batches * dp_->gradient_replicas());
  } else {
    dy = st.grad_out[mb];
    if (!dy.defined()) {
      return absl::FailedPreconditionError("no output gradient (its RECV_B has not run)");
    }
  }
  Clock::time_point t = Clock::now();
  const bool whole = a.kind == ActionKind::kB;
  if (whole) PW_RETURN_IF_ERROR(dp_->BeginBackward(local_[st.index], final_w));
  Tensor g = dy;
  for (int i = st.stage->size(); i-- > 0;) {
    Layer& layer = st.stage->layer(i);
    // B: the weight gradient right away, layer by layer (Layer::Backward, which a composite
    // layer runs sublayer by sublayer: Note [Backward by layer] in transformer.cc); I: the
    // input gradient only, W later.
    absl::StatusOr<Tensor> r =
        whole ? layer.Backward(g, lc, &saved[i]) : layer.BackwardInput(g, lc, &saved[i]);
    PW_RETURN_IF_ERROR(InLayer(r.status(), st, i, "backward"));
    g = *std::move(r);
    if (whole) {
      PW_RETURN_IF_ERROR(dp_->GradReady(local_[st.index], i, final_w));
      buckets_.Poll();  // a launch point: see which buckets completed (Note [Bucket spans])
    }
  }
  PW_RETURN_IF_ERROR(Sync());
  Record(EventKind::kCompute, a, t);
  st.b_s += events_.back().end - events_.back().start;
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

// W: the weight-gradient half, after the same micro-batch's I.
absl::Status RankExecutor::WeightBackward(StageRt& st, const Action& a, int index) {
  const int mb = a.micro_batch;
  PW_ASSIGN_OR_RETURN(const LayerContext lc, ContextFor(st, mb));
  std::vector<Saved>& saved = st.saved[mb];
  if (saved.size() != static_cast<size_t>(st.stage->size())) {
    return absl::FailedPreconditionError("W before this micro-batch's I");
  }
  const bool final_w = index == st.last_backward;
  Clock::time_point t = Clock::now();
  PW_RETURN_IF_ERROR(dp_->BeginBackward(local_[st.index], final_w));
  for (int i = st.stage->size(); i-- > 0;) {
    PW_RETURN_IF_ERROR(
        InLayer(st.stage->layer(i).BackwardWeight(lc, &saved[i]), st, i, "weight backward"));
    PW_RETURN_IF_ERROR(dp_->GradReady(local_[st.index], i, final_w));
    buckets_.Poll();
  }
  saved.clear();
  PW_RETURN_IF_ERROR(Sync());
  Record(EventKind::kCompute, a, t);
  st.w_s += events_.back().end - events_.back().start;
  ++st.w_n;
  return absl::OkStatus();
}

// Note [Step agreement]. The losses of every replica that takes this step and this rank's share
// of the squared gradient norm (DataParallel::AddSquaredNorm: exact fixed-point limbs, Note
// [Exact norm] in exact_sum.cc) go into one vector, each loss written by exactly one rank (zeros
// elsewhere, so the sum is exact), summed in a fixed order over the ranks that step together:
// the world, or under asynchronous DP the replica's own pipeline. Every one of them then sees
// the same sums and takes the same decision — clip by the same factor, step or skip, stop after
// this step or go on — and keeps the same loss-scaler state. The norm is the exact sum of
// per-chunk squares rounded once, so it is bit-identical at any pipeline depth, replica count or
// ZeRO stage.
absl::Status RankExecutor::Agree(int64_t step, float lr, StepOutcome* out) {
  const Action a{ActionKind::kOptimizerStep, 0, 0};
  Clock::time_point t = Clock::now();
  PW_RETURN_IF_ERROR(WaitSends());
  PW_RETURN_IF_ERROR(dp_->Finish());
  // The tie reduction, after the data-parallel one: every tied gradient becomes owner + copy.
  PW_RETURN_IF_ERROR(ties_.Reduce(
      alloc_.get(), [this](Work& w, const std::string& what) { return WaitOrAbort(w, what); }));
  // Waiting for the reductions is all-reduce time where there are any: a dp = 1 run without
  // ties across ranks has none (its agreement is its own column).
  if (ctx_->topo.dp > 1 || ties_.communicates()) Record(EventKind::kAllReduce, a, t);
  t = Clock::now();
  const bool together = dp_->replicas_step_together();
  const int64_t M = ctx_->layout().micro_batches, R = together ? ctx_->layout().replicas : 1;
  const int64_t me = together ? replica_ : 0;
  constexpr int64_t K = ExactSum::kSlots;
  // The last entry counts the ranks whose process was asked to stop (train.h, RequestStop).
  Tensor v = Tensor::Zeros({R * M + K + 1}, DType::kF64, host_.get());
  double* d = v.data<double>();
  for (StageRt& st : stages_) {
    if (st.last && tensor_ == 0) {  // the tensor-parallel ranks hold the same loss
      for (int64_t j = 0; j < M; ++j) d[me * M + j] = losses_[j];
    }
  }
  ExactSum norm;
  PW_RETURN_IF_ERROR(dp_->AddSquaredNorm(&norm));
  norm.ToSlots(d + R * M);
  d[R * M + K] = StopRequested() ? 1.0 : 0.0;
  if (together) {
    PW_RETURN_IF_ERROR(AllReduceHost(v, "step agreement all-reduce"));
  } else if (groups_.pipeline() != nullptr) {
    std::unique_ptr<Work> w = groups_.pipeline()->AllReduce(v);
    PW_RETURN_IF_ERROR(WaitOrAbort(*w, "the replica's step agreement"));
  }
  Record(EventKind::kAgreement, a, t);
  out->stop_requested = d[R * M + K] > 0;
  double loss = 0;
  for (int64_t i = 0; i < R * M; ++i) loss += d[i];
  const double norm2 = ExactSum::FromSlots(d + R * M).Round();
  const float scale = scaler_.scale();
  out->loss = loss / static_cast<double>(R * M);
  out->grad_norm = std::sqrt(norm2) / scale;
  out->loss_scale = scale;
  const bool finite = std::isfinite(out->loss) && std::isfinite(out->grad_norm);
  if (!scaler_.Update(finite)) {
    out->skipped = true;  // fp16 overflow: nothing applied anywhere, the scale backed off
    return absl::OkStatus();
  }
  if (!finite) {
    return absl::InternalError(
        absl::StrCat("step ", step, ": non-finite gradient norm; weights not updated on any rank"));
  }
  Clock::time_point o = Clock::now();
  // Clipping (and fp16's unscaling) as the optimizer reads the gradients.
  PW_RETURN_IF_ERROR(dp_->Step(lr, ClipScale(out->grad_norm, ctx_->options->clip_norm) / scale));
  PW_RETURN_IF_ERROR(Sync());
  Record(EventKind::kOptimizer, a, o);
  if (dp_->syncs_parameters()) {
    Clock::time_point b = Clock::now();
    PW_RETURN_IF_ERROR(dp_->SyncParameters());
    Record(EventKind::kAllReduce, a, b);
  }
  return absl::OkStatus();
}

}  // namespace pipewright::internal
