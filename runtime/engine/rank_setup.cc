// RankExecutor: the making of a rank (its device, stages, tied weights, process groups and
// data-parallel strategy), its checkpoint state, and its release (rank_executor.h).
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/engine/rank_executor.h"

namespace pipewright::internal {

absl::Status RankExecutor::PlaceOnDevice(int cuda_device) {
  if (cuda_device < 0) return absl::OkStatus();
  cuda_device_ = cuda_device;
  PW_RETURN_IF_ERROR(BindDevice());
  PW_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(Device::Cuda(cuda_device)));
  stream_ = std::make_unique<CudaStream>(std::move(stream));
  PW_ASSIGN_OR_RETURN(alloc_, CreateCudaAllocator(cuda_device, stream_->get()));
  return absl::OkStatus();
}

absl::StatusOr<StageRt> RankExecutor::BuildStage(int s,
                                                 const std::vector<std::vector<int64_t>>& shape_at,
                                                 DType input_dtype) {
  const RunSpec& run = *ctx_->run;
  StageRt st;
  st.index = s;
  st.begin = run.boundaries[s];
  st.end = run.boundaries[s + 1];
  st.first = s == 0;
  st.last = s == run.num_stages() - 1;
  st.recompute = run.recompute[s];
  PW_ASSIGN_OR_RETURN(st.stage, ctx_->graph->Instantiate(st.begin, st.end, ctx_->options->seed,
                                                         on_cuda() ? host_.get() : alloc_.get(),
                                                         tensor_, ctx_->topo.tp));
  if (on_cuda()) {
    for (Parameter* p : st.stage->Parameters()) {
      Tensor v = Tensor::Empty(p->value.shape(), DType::kF32, alloc_.get());
      PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc_.get()}, p->value, v));
      p->value = std::move(v);
      p->grad = Tensor::Zeros(p->value.shape(), DType::kF32, alloc_.get());
    }
    for (const TiedLink& t : st.stage->tied()) {  // a linked copy: its gradient on the device
      t.copy->grad = Tensor::Zeros(t.copy->value.shape(), DType::kF32, alloc_.get());
    }
    PW_RETURN_IF_ERROR(st.stage->LinkTied());  // to the owners' device tensors
    PW_RETURN_IF_ERROR(Sync());
  }
  st.in_shape = shape_at[st.begin];
  st.in_dtype = st.first ? input_dtype : DType::kF32;
  st.out_shape = shape_at[st.end];
  const Program& prog = program();
  for (size_t i = 0; i < prog.actions.size(); ++i) {
    const Action& a = prog.actions[i];
    if (a.virtual_stage == s && (a.kind == ActionKind::kB || a.kind == ActionKind::kW)) {
      st.last_backward = static_cast<int>(i);
    }
  }
  return st;
}

absl::StatusOr<std::unique_ptr<RankExecutor>> RankExecutor::Create(
    const RunContext* ctx, std::shared_ptr<const Dataset> data, RankEndpoint endpoint, int slot,
    int threads, const std::vector<std::vector<int64_t>>& shape_at) {
  const TrainOptions& to = *ctx->options;
  if (endpoint.cuda_device >= 0 && to.optimizer.kind != OptimizerKind::kAdamW) {
    return absl::InvalidArgumentError(
        "a CUDA rank (WorldOptions.device = cuda) supports TrainOptions.optimizer.kind = adamw "
        "only");
  }
  std::unique_ptr<RankExecutor> r(new RankExecutor());
  r->slot_ = slot;
  r->ctx_ = ctx;
  r->data_ = std::move(data);
  r->global_ = endpoint.global_rank;
  r->pipe_ = ctx->topo.PipelineRank(r->global_);
  r->replica_ = ctx->topo.Replica(r->global_);
  r->tensor_ = ctx->topo.TensorRank(r->global_);
  r->groups_ = ProcessGroups(std::move(endpoint.comm));
  r->pool_ = std::make_unique<cpu::ThreadPool>(threads);
  PW_RETURN_IF_ERROR(r->PlaceOnDevice(endpoint.cuda_device));
  const RunSpec& run = *ctx->run;
  const int S = run.num_stages();
  r->local_.assign(S, -1);
  for (int s = 0; s < S; ++s) {
    if (run.schedule.stage_rank[s] != r->pipe_) continue;
    PW_ASSIGN_OR_RETURN(StageRt st, r->BuildStage(s, shape_at, r->data_->Spec().input_dtype));
    r->local_[s] = static_cast<int>(r->stages_.size());
    r->stages_.push_back(std::move(st));
  }
  std::vector<Parameter*> all;
  std::vector<TiedLink> within;
  for (StageRt& st : r->stages_) {
    for (Parameter* p : st.stage->Parameters()) all.push_back(p);
    for (const TiedLink& t : st.stage->tied()) within.push_back(t);
  }
  PW_ASSIGN_OR_RETURN(r->ties_, TiedWeights::Link(std::move(within), all, &r->params_));
  for (const Parameter* p : all) {
    if (p->shard.sharded() && p->tied_to.empty()) r->shards_[p->name] = p->shard;
  }
  if (to.precision == Precision::kFp16) r->scaler_ = LossScaler(to.loss_scale);
  r->total_.global_rank = r->global_;
  r->total_.pipeline_rank = r->pipe_;
  r->total_.replica = r->replica_;
  r->total_.tensor_rank = r->tensor_;
  r->total_.threads = r->pool_->size();
  return r;
}

absl::Status RankExecutor::Connect(const GroupNeeds& needs, const std::vector<CrossRankTie>& ties) {
  const TrainOptions& to = *ctx_->options;
  PW_RETURN_IF_ERROR(groups_.Connect(ctx_->topo, global_, needs, ctx_->timeout));
  if (groups_.tensor_parallel() != nullptr) {
    tp_ = TensorParallelGroup{groups_.tensor_parallel(), tensor_, ctx_->topo.tp, ctx_->timeout,
                              ctx_->run->sequence_parallel};
  }
  PW_RETURN_IF_ERROR(ties_.LinkRemote(pipe_, ties, params_, groups_, Who()));
  DataParallelParams params;
  for (StageRt& st : stages_) {
    GradSyncStage gs{st.index, {}};
    for (int i = 0; i < st.stage->size(); ++i) {
      gs.layers.push_back(st.stage->layer(i).Parameters());
      gs.groups.push_back(st.stage->layer(i).ParameterGroups());
      for (const Parameter* p : gs.layers.back()) {
        if (!p->tied_to.empty()) params.tied.insert(p);
      }
    }
    params.stages.push_back(std::move(gs));
  }
  ties_.AddTo(&params.tied);
  params.trained = params_;
  if (to.dp_mode == DpMode::kAsync) {
    dp_ = CreateAsync(DpContext(), std::move(params));
  } else if (to.zero > 0) {
    PW_ASSIGN_OR_RETURN(dp_, CreateSharded(DpContext(), std::move(params), to.zero));
  } else {
    std::unique_ptr<GradSync> sync;
    const GradCompression& c = to.grad_compression;
    if (c.kind == GradCompression::Kind::kPowerSgd) {
      sync = CreatePowerSgd(SyncContext(), params.stages, to.bucket_bytes, c.rank);
    } else {
      sync = CreateBucketedAllReduce(SyncContext(), params.stages, to.bucket_bytes, c);
    }
    dp_ = CreateReplicated(DpContext(), std::move(params), std::move(sync));
  }
  // What the rank holds before any step: weights, gradients, optimizer state.
  PW_RETURN_IF_ERROR(Sync());
  static_bytes_ = alloc_->current_bytes();
  return absl::OkStatus();
}

absl::Status RankExecutor::AppendWeights(int stage, NamedTensors* out) const {
  const StageRt* st = const_cast<RankExecutor*>(this)->Local(stage);
  if (st == nullptr) {
    return absl::InternalError(absl::StrCat(Who(), " holds no virtual stage ", stage));
  }
  PW_RETURN_IF_ERROR(BindDevice());
  for (Parameter* q : st->stage->Parameters()) {
    if (!q->tied_to.empty()) continue;  // stored once, as its owner
    PW_ASSIGN_OR_RETURN(Tensor h, ToHost(q->value));
    out->emplace_back(q->name, q->value.device().is_cpu() ? h.Clone() : std::move(h));
  }
  return absl::OkStatus();
}

const TensorShard* RankExecutor::ShardOfStored(const std::string& name) const {
  auto it = shards_.find(name);
  const size_t dot = name.find('.');
  if (it == shards_.end() && dot != std::string::npos) it = shards_.find(name.substr(dot + 1));
  return it == shards_.end() ? nullptr : &it->second;
}

std::string RankExecutor::SyncStatePrefix() const {
  // Each tensor-parallel part compresses its own gradients.
  return ctx_->topo.tp > 1 ? absl::StrCat("replica", replica_, ".tp", tensor_, "/")
                           : absl::StrCat("replica", replica_, "/");
}

absl::Status RankExecutor::CollectState(NamedTensors* optimizer, NamedTensors* sync) {
  PW_ASSIGN_OR_RETURN(*optimizer, dp_->OptimizerState());
  PW_ASSIGN_OR_RETURN(NamedTensors mine, dp_->SyncState());
  // Every replica's compression state (its own error buffers), under "replica<R>/".
  sync->clear();
  for (auto& [name, t] : mine) {
    sync->emplace_back(absl::StrCat(SyncStatePrefix(), name), std::move(t));
  }
  return absl::OkStatus();
}

absl::Status RankExecutor::Restore(const Checkpoint& ck, const ResumePoint& at) {
  PW_RETURN_IF_ERROR(BindDevice());
  // Checkpoints hold whole tensors: this rank's tensor-parallel parts are cut from them.
  std::map<std::string, Tensor> optimizer = ck.optimizer;
  for (auto& [name, t] : optimizer) {
    if (const TensorShard* shard = ShardOfStored(name)) {
      PW_ASSIGN_OR_RETURN(t, SlicePart(t, *shard));
    }
  }
  PW_RETURN_IF_ERROR(dp_->LoadOptimizerState(optimizer, at.optimizer_step));
  if (!at.grad_compression.empty()) {
    absl::Status s = dp_->LoadSyncState(ck.grad_sync, SyncStatePrefix());
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(ck.path, "/grad_sync.safetensors: ", s.message()));
    }
  }
  for (Parameter* p : params_) {
    const Tensor& whole = ck.model.at(StoredName(*p));
    if (!p->shard.sharded()) {
      PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc_.get()}, whole, p->value));
      continue;
    }
    PW_ASSIGN_OR_RETURN(Tensor part, SlicePart(whole, p->shard));
    PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{alloc_.get()}, part, p->value));
  }
  PW_RETURN_IF_ERROR(Sync());
  RestoreLossScaler(at, &scaler_);
  loader_.reset();  // restarts at the checkpoint's data position
  return absl::OkStatus();
}

void RankExecutor::ReleaseDevice() {
  if (!on_cuda()) return;
  // Device memory is freed on the rank's stream, from this thread: make its GPU current, drop
  // every device tensor, drain the stream, then release the stream's cuBLAS context.
  (void)BindDevice();
  dp_.reset();
  stages_.clear();
  params_.clear();
  ties_ = TiedWeights();
  (void)Sync();
  ops::ReleaseStream(alloc_->stream());
}

}  // namespace pipewright::internal
