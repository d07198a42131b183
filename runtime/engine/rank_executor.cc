// RankExecutor: the rank's device, clocks, waits and world-wide reductions (rank_executor.h).
#include "runtime/engine/rank_executor.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pipewright::internal {

bool RankExecutor::needs_data() const {
  for (const StageRt& s : stages_) {
    if (s.first || s.last) return true;
  }
  return false;
}

std::string RankExecutor::Who() const {
  return absl::StrFormat("rank %d (pipeline rank %d, replica %d)", global_, pipe_, replica_);
}

int RankExecutor::PeerOf(int stage) const {
  return ctx_->topo.GlobalRank(ctx_->run->schedule.stage_rank[stage], replica_, tensor_);
}

StageRt* RankExecutor::Local(int stage) {
  if (stage < 0 || stage >= static_cast<int>(local_.size()) || local_[stage] < 0) return nullptr;
  return &stages_[local_[stage]];
}

absl::Status RankExecutor::BindDevice() const {
  return on_cuda() ? SetCudaDevice(cuda_device_) : absl::OkStatus();
}

absl::Status RankExecutor::Sync() const {
  return on_cuda() ? SynchronizeStream(alloc_->stream()) : absl::OkStatus();
}

absl::StatusOr<Tensor> RankExecutor::ToHost(const Tensor& t) const {
  if (t.device().is_cpu()) return t;
  Tensor h = Tensor::Empty(t.shape(), t.dtype(), DefaultCpuAllocator());
  PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc_.get()}, t, h));
  return h;
}

double RankExecutor::Now() const { return Seconds(ctx_->epoch, Clock::now()); }

absl::Status RankExecutor::WaitOrAbort(Work& w, const std::string& what) {
  flight_.Waiting(what, Now());
  absl::Status s = w.Wait(ctx_->timeout);
  if (s.ok()) flight_.DoneWaiting();
  if (s.ok()) return s;
  absl::Status first = groups_.world()->abort_status();
  if (!first.ok()) return first;  // another rank failed first: report that
  return absl::Status(s.code(), absl::StrCat(Who(), " ", what, ": ", s.message()));
}

template <typename Op>
absl::Status RankExecutor::HostCollective(const Tensor& in, Tensor& out, const std::string& what,
                                          Op op) {
  if (groups_.world()->capabilities().host_memory) {
    std::unique_ptr<Work> w = op(in, out);
    return WaitOrAbort(*w, what);
  }
  // A device-only backend (NCCL): stage through the rank's GPU (one buffer when in place).
  const ops::Exec e{alloc_.get()};
  Tensor din = Tensor::Empty(in.shape(), in.dtype(), alloc_.get());
  Tensor dout = &in == &out ? din : Tensor::Empty(out.shape(), out.dtype(), alloc_.get());
  PW_RETURN_IF_ERROR(ops::Copy(e, in, din));
  std::unique_ptr<Work> w = op(din, dout);
  PW_RETURN_IF_ERROR(WaitOrAbort(*w, what));
  return ops::Copy(e, dout, out);
}

absl::Status RankExecutor::AllReduceHost(Tensor& v, const std::string& what) {
  return HostCollective(
      v, v, what, [this](const Tensor&, Tensor& out) { return groups_.world()->AllReduce(out); });
}

absl::StatusOr<std::vector<std::string>> RankExecutor::AllGatherBytes(const std::string& mine,
                                                                      const std::string& what) {
  const int n = groups_.world()->size();
  auto gather = [this](const Tensor& in, Tensor& out) {
    return groups_.world()->AllGather(in, out);
  };
  Tensor len = Tensor::Empty({1}, DType::kI32, host_.get());
  len.data<int32_t>()[0] = static_cast<int32_t>(mine.size());
  Tensor lens = Tensor::Empty({n}, DType::kI32, host_.get());
  PW_RETURN_IF_ERROR(HostCollective(len, lens, what, gather));
  int64_t longest = 0;
  for (int i = 0; i < n; ++i) longest = std::max<int64_t>(longest, lens.data<int32_t>()[i]);
  const int64_t words = std::max<int64_t>(1, (longest + 3) / 4);  // bytes packed in i32 words
  Tensor bytes = Tensor::Zeros({words}, DType::kI32, host_.get());
  std::memcpy(bytes.raw(), mine.data(), mine.size());
  Tensor all = Tensor::Empty({n * words}, DType::kI32, host_.get());
  PW_RETURN_IF_ERROR(HostCollective(bytes, all, what, gather));
  std::vector<std::string> out(n);
  for (int i = 0; i < n; ++i) {
    const char* p = static_cast<const char*>(all.raw()) + i * words * 4;
    out[i].assign(p, p + lens.data<int32_t>()[i]);
  }
  return out;
}

GradSyncContext RankExecutor::SyncContext() {
  GradSyncContext c;
  c.dp = groups_.data_parallel();
  c.alloc = alloc_.get();
  // Every wait of the strategy's is a point where the rank sees bucket collectives complete
  // (Note [Bucket spans]).
  c.wait = [this](Work& w, const std::string& what) {
    buckets_.Poll();
    PW_RETURN_IF_ERROR(WaitOrAbort(w, what));
    buckets_.Waited(w);
    return absl::OkStatus();
  };
  c.sync_device = [this] { return Sync(); };
  c.buckets = &buckets_;
  return c;
}

DataParallelContext RankExecutor::DpContext() {
  const GradSyncContext g = SyncContext();
  DataParallelContext c;
  c.dp = g.dp;
  c.replica = replica_;
  c.replicas = ctx_->topo.dp;
  c.tensor_rank = tensor_;
  c.alloc = g.alloc;
  c.wait = g.wait;
  c.sync_device = g.sync_device;
  c.buckets = g.buckets;
  c.optimizer = ctx_->options->optimizer;
  c.bucket_bytes = ctx_->options->bucket_bytes;
  c.zero_buffers = ctx_->options->zero_buffers;
  return c;
}

void RankExecutor::Record(EventKind kind, const Action& a, Clock::time_point start, int peer,
                          int64_t tag) {
  RankEvent e;
  e.kind = kind;
  e.action = a;
  e.peer = peer;
  e.tag = tag;
  e.step = step_;
  e.start = Seconds(ctx_->epoch, start);
  const TrainTestingHooks& h = *ctx_->testing;
  if ((kind == EventKind::kCompute || kind == EventKind::kRecompute) &&
      replica_ == h.slow_replica && h.slow_factor > 1) {
    // A straggler (TrainTestingHooks): this replica computes slow_factor times slower.
    std::this_thread::sleep_for((Clock::now() - start) * (h.slow_factor - 1));
  }
  e.end = Seconds(ctx_->epoch, Clock::now());
  events_.push_back(e);
  buckets_.Poll();  // the end of an interval: see which buckets completed (Note [Bucket spans])
  const double d = e.end - e.start;
  switch (kind) {
    case EventKind::kCompute:
      step_times_.compute += d;
      break;
    case EventKind::kRecompute:
      step_times_.recompute += d;
      break;
    case EventKind::kSend:
    case EventKind::kRecvWait:
      step_times_.p2p_wait += d;
      break;
    case EventKind::kAllReduce:
      step_times_.all_reduce += d;
      break;
    case EventKind::kAgreement:
      step_times_.agreement += d;
      break;
    case EventKind::kOptimizer:
      step_times_.optimizer += d;
      break;
    case EventKind::kDataWait:
      step_times_.data_wait += d;
      break;
    case EventKind::kBucket:  // overlaps the rest: no category (RecordBuckets)
      break;
  }
}

void RankExecutor::RecordBuckets() {
  std::vector<RankEvent> spans;
  for (const BucketWatch::Span& b : buckets_.Take()) {
    RankEvent e;
    e.kind = EventKind::kBucket;
    e.action = Action{ActionKind::kReduceGrads, b.stage, -1};
    e.tag = b.bucket;
    e.step = step_;
    e.start = Seconds(ctx_->epoch, b.posted);
    e.end = Seconds(ctx_->epoch, b.done);
    e.collective = b.collective;
    spans.push_back(e);
  }
  if (spans.empty()) return;
  std::stable_sort(spans.begin(), spans.end(),
                   [](const RankEvent& a, const RankEvent& b) { return a.start < b.start; });
  // Merged into the step's events by start (Engine::Events' order), each list keeping its own.
  std::vector<RankEvent> step(events_.begin() + static_cast<std::ptrdiff_t>(step_events_),
                              events_.end());
  events_.resize(step_events_);
  size_t i = 0, k = 0;
  while (i < step.size() || k < spans.size()) {
    const bool span = k < spans.size() && (i == step.size() || spans[k].start < step[i].start);
    events_.push_back(span ? spans[k++] : step[i++]);
  }
}

void RankExecutor::EndStep(Clock::time_point t0, int64_t start_bytes) {
  RecordBuckets();
  for (StageRt& st : stages_) {  // release the step's buffers
    st.saved.clear();
    st.input.clear();
    st.output.clear();
    st.grad_out.clear();
    st.grad_in.clear();
  }
  batch_ = StepBatch{};
  dev_inputs_.clear();
  dev_targets_.clear();
  RankTimes& t = step_times_;
  t.wall = Seconds(t0, Clock::now());
  t.peak_memory_bytes = alloc_->peak_bytes();
  t.peak_activation_bytes = alloc_->peak_bytes() - start_bytes;
  t.static_memory_bytes = static_bytes_;
  t.optimizer_state_bytes = dp_->OptimizerStateBytes();
  t.gradient_bytes = dp_->GradientBytes();
  const GradSyncBytes bytes = dp_->StepBytes();
  t.grad_bytes_sent += bytes.sent;
  t.grad_bytes_uncompressed += bytes.uncompressed;
  // The tensor-parallel collectives ran inside the layers' passes: out of compute first.
  t.tensor_parallel = tp_.collective_s;
  const double from_compute = std::min(t.compute, t.tensor_parallel);
  t.compute -= from_compute;
  t.recompute -= std::min(t.recompute, t.tensor_parallel - from_compute);
  const double used = t.compute + t.recompute + t.tensor_parallel + t.p2p_wait + t.all_reduce +
                      t.agreement + t.optimizer + t.data_wait;
  t.idle = std::max(0.0, t.wall - used);
  total_.compute += t.compute;
  total_.recompute += t.recompute;
  total_.tensor_parallel += t.tensor_parallel;
  total_.p2p_wait += t.p2p_wait;
  total_.all_reduce += t.all_reduce;
  total_.agreement += t.agreement;
  total_.optimizer += t.optimizer;
  total_.data_wait += t.data_wait;
  total_.idle += t.idle;
  total_.wall += t.wall;
  total_.grad_bytes_sent += t.grad_bytes_sent;
  total_.grad_bytes_uncompressed += t.grad_bytes_uncompressed;
  total_.peak_memory_bytes = std::max(total_.peak_memory_bytes, t.peak_memory_bytes);
  total_.peak_activation_bytes = std::max(total_.peak_activation_bytes, t.peak_activation_bytes);
}

RankTimes RankExecutor::StepTimes() const {
  RankTimes t = step_times_;
  t.global_rank = global_;
  t.pipeline_rank = pipe_;
  t.replica = replica_;
  t.tensor_rank = tensor_;
  t.threads = total_.threads;
  for (const StageRt& st : stages_) t.stages.push_back(st.index);
  return t;
}

RankTimes RankExecutor::Totals() const {
  RankTimes t = total_;
  t.global_rank = global_;
  t.pipeline_rank = pipe_;
  t.replica = replica_;
  t.tensor_rank = tensor_;
  t.static_memory_bytes = static_bytes_;
  t.optimizer_state_bytes = dp_->OptimizerStateBytes();
  t.gradient_bytes = dp_->GradientBytes();
  for (const StageRt& st : stages_) {
    t.stages.push_back(st.index);
    auto mean = [](double v, int64_t k) { return k > 0 ? v / k : 0.0; };
    t.stage_f.push_back(mean(st.f_s, st.f_n));
    t.stage_b.push_back(mean(st.b_s + st.rc_s, st.b_n));
    t.stage_w.push_back(mean(st.w_s, st.w_n));
  }
  return t;
}

absl::Status RankExecutor::MergeTensorParallel(NamedTensors* named, const std::string& what) {
  Communicator* g = groups_.tensor_parallel();
  if (g == nullptr) return absl::OkStatus();
  NamedTensors out;
  for (auto& [name, t] : *named) {
    const TensorShard* shard = ShardOfStored(name);
    if (shard == nullptr) {  // whole on every rank: rank 0's
      if (tensor_ == 0) out.emplace_back(name, std::move(t));
      continue;
    }
    const int64_t n = t.numel();
    Tensor all = Tensor::Empty({ctx_->topo.tp * n}, DType::kF32, host_.get());
    PW_RETURN_IF_ERROR(
        HostCollective(t, all, absl::StrCat(what, ": tensor-parallel parts of ", name),
                       [g](const Tensor& in, Tensor& o) { return g->AllGather(in, o); }));
    if (tensor_ != 0) continue;
    std::vector<Tensor> parts;
    for (int r = 0; r < ctx_->topo.tp; ++r) {
      PW_ASSIGN_OR_RETURN(Tensor v, all.View(r * n, t.shape()));
      parts.push_back(std::move(v));
    }
    PW_ASSIGN_OR_RETURN(Tensor whole, MergeParts(parts, *shard));
    out.emplace_back(name, std::move(whole));
  }
  *named = std::move(out);
  return absl::OkStatus();
}

}  // namespace pipewright::internal
