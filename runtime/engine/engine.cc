// The Engine: set-up of every rank this process runs, the step, checkpoints (engine.h). The
// ranks' work is in rank_step.cc / rank_p2p.cc, the reports in reports.cc.
#include "pipewright/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipewright/checkpoint.h"
#include "pipewright/cpu.h"
#include "pipewright/host.h"
#include "pipewright/run_memory.h"
#include "runtime/engine/engine_impl.h"
#include "runtime/train_state.h"

namespace pipewright {

using internal::Clock;
using internal::RankExecutor;
using internal::StageRt;

internal::RankExecutor* Engine::Impl::Find(int global) const {
  for (const auto& r : ranks) {
    if (r->global() == global) return r.get();
  }
  return nullptr;
}

namespace {

// What asynchronous DP needs of the world and the model besides what ValidateTrainOptions checks
// (Note [Async DP] in async_dp.cc).
absl::Status CheckAsync(const TrainOptions& o, const World& world,
                        const std::vector<RankEndpoint>& endpoints,
                        const std::vector<internal::CrossRankTie>& ties) {
  if (o.dp_mode != DpMode::kAsync) return absl::OkStatus();
  if (world.options().device.is_cuda()) {
    return absl::InvalidArgumentError(
        "TrainOptions.dp_mode = async runs on the CPU only (WorldOptions.device = cpu)");
  }
  if (!ties.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TrainOptions.dp_mode = async does not support a tied weight split across pipeline "
        "ranks (",
        ties[0].owner, " on pipeline rank ", ties[0].owner_pipe, " and ", ties[0].copy_pipe,
        "): the owners would update its two copies apart; put them on one rank or untie them"));
  }
  if (!endpoints.empty() && !endpoints[0].comm->capabilities().concurrent_p2p) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TrainOptions.dp_mode = async needs a backend that takes point-to-point operations from "
        "two threads (local, mpi); ",
        CommBackendName(endpoints[0].comm->kind()), " does not"));
  }
  return absl::OkStatus();
}

// What tensor parallelism does not combine with (docs/runtime.md, "Tensor parallelism"): the
// layers' shapes are checked as the stages are built (each spec names its layer).
absl::Status CheckTensorParallel(const TrainOptions& o, const LayerGraph& graph,
                                 const RunSpec& run) {
  const int T = run.tensor_parallel;
  if (T == 1) return absl::OkStatus();
  const std::string tp = absl::StrCat("RunSpec.tensor_parallel = ", T);
  if (o.dp_mode == DpMode::kAsync) {
    return absl::InvalidArgumentError(
        absl::StrCat("TrainOptions.dp_mode = async does not combine with ", tp,
                     ": the owners of the asynchronous updates hold whole tensors"));
  }
  if (run.sequence_parallel) {
    // Note [Sequence parallelism]: every activation between layers must be one the built-in
    // layers split along the sequence (a GPT or a Llama: embedding, blocks, final norm, LM head,
    // loss).
    for (int i = 0; i < graph.num_layers(); ++i) {
      const LayerNode& n = graph.node(i);
      const std::string kind = n.spec->kind();
      const bool ok = i == 0 ? kind == "embedding" || kind == "token_embedding"
                             : kind == "transformer_block" || kind == "llama_block" ||
                                   kind == "layernorm" || kind == "rmsnorm" || kind == "lm_head" ||
                                   kind == "cross_entropy";
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            "RunSpec.sequence_parallel: layer ", i, " '", n.name, "' (", kind,
            ") does not take sequence-split activations; it supports GPT and Llama models (an "
            "embedding, then blocks, norms, the LM head and the loss)"));
      }
    }
    if (graph.shape().seq_len % T != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("RunSpec.sequence_parallel: the sequence length ", graph.shape().seq_len,
                       " does not split over ", tp, " ranks"));
    }
  }
  for (int s = 1; s < run.num_stages(); ++s) {
    const LayerNode& n = graph.node(run.boundaries[s] - 1);
    if (n.spec->kind() == "lm_head") {
      return absl::InvalidArgumentError(absl::StrCat(
          "RunSpec.boundaries: stage ", s, " starts after the LM head '", n.name, "'; with ", tp,
          " each rank holds only its part of the logits, so the head and the loss must share a "
          "stage"));
    }
  }
  return absl::OkStatus();
}

// Processes of a launcher's world on this node, as the launcher's environment says (Open MPI,
// MPICH's Hydra, Slurm); all of the world's processes when it says nothing.
int ProcessesOnNode(const World& world) {
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    const char* v = std::getenv(var);
    int n = 0;
    if (v != nullptr && absl::SimpleAtoi(v, &n) && n > 0) return n;
  }
  return world.process_count();
}

// TrainOptions::threads_per_rank, 0 resolved: the usable cores shared by the ranks of this
// process (and of the other processes on the node), at least 1; 1 for ranks on GPUs.
int ThreadsPerRank(const TrainOptions& o, const World& world, int ranks_here) {
  if (o.threads_per_rank > 0) return o.threads_per_rank;
  if (world.options().device.is_cuda()) return 1;
  const int sharers =
      std::max(1, ranks_here) * (world.multi_process() ? ProcessesOnNode(world) : 1);
  return std::max(1, UsableCores() / sharers);
}

// Samples are sequences of the length the model was staged for (its MicroBatchShape).
absl::Status CheckData(const Dataset& data, const LayerGraph& graph) {
  const SampleSpec spec = data.Spec();
  if (spec.input_shape.empty() || spec.input_shape[0] != graph.shape().seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("the data (", data.Describe(), ") gives samples of shape [",
                     absl::StrJoin(spec.input_shape, ", "), "], but ", graph.name(),
                     " was staged for sequences of ", graph.shape().seq_len,
                     " (the first sample dimension must be the sequence length)"));
  }
  return absl::OkStatus();
}

// Activation shape at every layer boundary of one micro-batch, from the data's input shape and
// the layers' shape functions (nothing allocated): what one rank holds, so under sequence
// parallelism the activations [B, T, C] between layers (not the logits) are [B, T / tp, C].
std::vector<std::vector<int64_t>> BoundaryShapes(const LayerGraph& graph, const SampleSpec& spec,
                                                 const RunSpec& run) {
  const int L = graph.num_layers();
  std::vector<std::vector<int64_t>> at(L + 1);
  at[0] = {graph.shape().batch};
  at[0].insert(at[0].end(), spec.input_shape.begin(), spec.input_shape.end());
  for (int i = 0; i < L; ++i) at[i + 1] = graph.node(i).spec->OutputShape(at[i]);
  if (run.sequence_parallel) {
    for (int i = 1; i < L; ++i) {
      if (at[i].size() == 3 && graph.node(i - 1).spec->kind() != "lm_head") {
        at[i][1] /= run.tensor_parallel;
      }
    }
  }
  return at;
}

// Splits every rank's groups off the world (ProcessGroups::Connect: collective, one thread per
// rank) and gives each rank its data-parallel strategy over them.
absl::Status ConnectReplicas(Engine::Impl& m) {
  const std::vector<internal::CrossRankTie> ties = internal::CrossRankTies(m.graph, m.run);
  internal::GroupNeeds needs;
  needs.tie_pairs = internal::TiePairs(ties);
  needs.pipeline = m.options.dp_mode == DpMode::kAsync;
  return m.OnEveryRank([&](RankExecutor& r) { return r.Connect(needs, ties); });
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const LayerGraph& graph, RunSpec run,
                                                       const TrainOptions& options,
                                                       std::shared_ptr<const Dataset> data,
                                                       World world) {
  PW_RETURN_IF_ERROR(CheckRunSpec(run, graph.num_layers()));
  PW_RETURN_IF_ERROR(ValidateTrainOptions(options, run.data_parallel));
  if (data == nullptr) return absl::InvalidArgumentError("Engine::Create: no dataset");
  PW_RETURN_IF_ERROR(CheckData(*data, graph));
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.graph = graph;
  m.run = std::move(run);
  m.options = options;
  m.data = std::move(data);
  m.world = std::make_unique<World>(std::move(world));
  m.ctx.graph = &m.graph;
  m.ctx.run = &m.run;
  m.ctx.options = &m.options;
  m.ctx.testing = &m.testing;
  m.ctx.topo = Topology{m.run.pipeline_parallel(), m.run.data_parallel, m.run.tensor_parallel};
  m.ctx.timeout = m.world->options().timeout;
  m.lr.peak = ScaleLearningRate(options.lr, m.ctx.layout().global_batch(), options.base_batch,
                                options.lr_scaling);
  m.lr.warmup_steps = options.warmup_steps;
  m.lr.total_steps = std::max<int64_t>(1, options.steps);
  m.lr.min_ratio = options.min_lr_ratio;

  PW_RETURN_IF_ERROR(CheckTensorParallel(m.options, m.graph, m.run));
  PW_ASSIGN_OR_RETURN(std::vector<RankEndpoint> endpoints, m.world->Connect(m.ctx.topo));
  PW_RETURN_IF_ERROR(
      CheckAsync(m.options, *m.world, endpoints, internal::CrossRankTies(m.graph, m.run)));
  if (!endpoints.empty() && !endpoints[0].comm->capabilities().tagged_p2p) {
    PW_RETURN_IF_ERROR(CheckFifoOrder(m.run.schedule));
  }
  // Before any rank allocates: the ranks of this process must fit its memory (run_memory.h).
  std::vector<RankPlace> places;
  for (const RankEndpoint& e : endpoints) places.push_back({e.global_rank, e.cuda_device});
  PW_RETURN_IF_ERROR(
      CheckRunMemory(m.graph, m.run, m.options, m.data->Spec(), places, ThisHostMemory()));
  if (m.world->multi_process()) {
    // Processes start their clocks together (to within a barrier), so their trace events line
    // up in one timeline.
    std::unique_ptr<Work> b = endpoints[0].comm->Barrier();
    PW_RETURN_IF_ERROR(b->Wait(m.ctx.timeout));
  }
  m.ctx.epoch = Clock::now();
  const auto shape_at = BoundaryShapes(graph, m.data->Spec(), m.run);
  m.threads_per_rank =
      ThreadsPerRank(m.options, *m.world, static_cast<int>(std::max<size_t>(1, endpoints.size())));
  // The ranks split their products over their own threads; OpenBLAS's own (process-wide) would
  // multiply with them, and would change the products' bits with their count.
  if (!m.world->options().device.is_cuda()) SetCpuKernelThreads(1);
  for (RankEndpoint& e : endpoints) {
    PW_ASSIGN_OR_RETURN(
        std::unique_ptr<RankExecutor> ex,
        RankExecutor::Create(&m.ctx, m.data, std::move(e), static_cast<int>(m.ranks.size()),
                             m.threads_per_rank, shape_at));
    m.ranks.push_back(std::move(ex));
  }
  // What the pools got (fewer threads only when the system refused to start more).
  if (!m.ranks.empty()) m.threads_per_rank = m.ranks.front()->pool()->size();
  PW_RETURN_IF_ERROR(ConnectReplicas(m));
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  // Communicators first: a backend may still hold buffers from any rank's allocator (a
  // receive posted before an abort), and every allocator must outlive them.
  for (auto& r : impl_->ranks) r->ReleaseGroups();
  for (auto& r : impl_->ranks) r->ReleaseWorld();
  for (auto& r : impl_->ranks) r->ReleaseDevice();
}

absl::StatusOr<StepReport> Engine::Step() {
  Impl& m = *impl_;
  if (!m.failed.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the engine stopped after an earlier failure: ", m.failed.message()));
  }
  if (m.options.dp_mode == DpMode::kAsync) {
    return absl::FailedPreconditionError(
        "Engine::Step is one synchronous step of every replica; this engine runs asynchronous "
        "DP (use RunAsync)");
  }
  const float lr = m.lr.At(m.step);
  const int64_t step = m.step;
  std::vector<internal::StepOutcome> outcomes(m.ranks.size());
  const Clock::time_point t0 = Clock::now();
  absl::Status s =
      m.OnEveryRank([&](RankExecutor& r) { return r.RunStep(step, lr, &outcomes[r.slot()]); });
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
  rep.result.stop_requested = outcomes[0].stop_requested;
  rep.result.lr = lr;
  rep.result.step_time_s = internal::Seconds(t0, Clock::now());
  rep.result.samples_per_s =
      rep.result.step_time_s > 0 ? m.ctx.layout().global_batch() / rep.result.step_time_s : 0;
  for (auto& r : m.ranks) {
    RankTimes t = r->StepTimes();
    rep.result.data_wait_s = std::max(rep.result.data_wait_s, t.data_wait);
    rep.ranks.push_back(std::move(t));
  }
  m.wall += rep.result.step_time_s;
  ++m.steps_run;
  ++m.step;
  return rep;
}

absl::StatusOr<AsyncReport> Engine::RunAsync(int64_t until_step) {
  Impl& m = *impl_;
  if (!m.failed.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the engine stopped after an earlier failure: ", m.failed.message()));
  }
  if (m.options.dp_mode != DpMode::kAsync) {
    return absl::FailedPreconditionError("RunAsync needs TrainOptions.dp_mode = async");
  }
  AsyncReport rep;
  rep.first_step = m.step;
  if (until_step <= m.step) return rep;
  const int D = m.ctx.topo.dp;
  RankExecutor::AsyncRun run;
  run.lr = m.lr;
  run.first_ticket = m.step * D;
  run.end_ticket = until_step * D;
  std::unique_ptr<internal::AsyncCoordinator> coord;
  if (m.Find(0) != nullptr) {
    coord = std::make_unique<internal::AsyncCoordinator>(D, m.options.staleness, run.first_ticket,
                                                         run.end_ticket);
    run.coord = coord.get();
  }
  std::vector<int64_t> end(m.ranks.size(), run.first_ticket);
  const Clock::time_point t0 = Clock::now();
  absl::Status s = m.OnEveryRank([&](RankExecutor& r) { return r.RunAsync(run, &end[r.slot()]); });
  if (!s.ok()) {
    m.failed = s;
    return s;
  }
  rep.wall_s = internal::Seconds(t0, Clock::now());
  rep.steps = m.ranks.empty() ? 0 : (end[0] - run.first_ticket) / D;
  if (coord != nullptr) {
    AsyncReport c = coord->Report();
    rep.stop_requested = c.stop_requested;
    rep.replicas = std::move(c.replicas);
    rep.updates = std::move(c.updates);
    for (size_t i = 0; i < rep.updates.size(); ++i) {
      rep.updates[i].lr = m.lr.At((run.first_ticket + static_cast<int64_t>(i)) / D);
    }
  }
  for (auto& r : m.ranks) rep.applied_by_rank.emplace_back(r->global(), r->AsyncApplied());
  m.step += rep.steps;
  m.steps_run += rep.steps;
  m.wall += rep.wall_s;
  return rep;
}

absl::Status Engine::SetTestingHooks(const TrainTestingHooks& hooks) {
  PW_RETURN_IF_ERROR(ValidateTrainTestingHooks(hooks, impl_->run.data_parallel));
  impl_->testing = hooks;
  return absl::OkStatus();
}

int64_t Engine::step() const { return impl_->step; }
int64_t Engine::global_batch() const { return impl_->ctx.layout().global_batch(); }
int Engine::threads_per_rank() const { return impl_->threads_per_rank; }
float Engine::PeakLr() const { return impl_->lr.peak; }
const RunSpec& Engine::run() const { return impl_->run; }
const Topology& Engine::topology() const { return impl_->ctx.topo; }
bool Engine::multi_process() const { return impl_->world->multi_process(); }
bool Engine::is_root() const { return impl_->world->is_root(); }

std::vector<Parameter*> Engine::RankParameters(int global_rank) const {
  RankExecutor* r = impl_->Find(global_rank);
  return r != nullptr ? r->params() : std::vector<Parameter*>{};
}

int64_t Engine::RankMemoryBytes(int global_rank) const {
  RankExecutor* r = impl_->Find(global_rank);
  return r != nullptr ? r->memory_bytes() : 0;
}

int64_t Engine::RankPeakMemoryBytes(int global_rank) const {
  RankExecutor* r = impl_->Find(global_rank);
  return r != nullptr ? r->peak_memory_bytes() : 0;
}

NamedTensors Engine::Weights() const {
  const Impl& m = *impl_;
  const int T = m.ctx.topo.tp;
  NamedTensors out;
  for (int s = 0; s < m.run.num_stages(); ++s) {
    // Multi-process: only the stages this process holds (when it is in replica 0), and under
    // tensor parallelism only those whose every part it holds.
    std::vector<RankExecutor*> parts;
    for (int t = 0; t < T; ++t) {
      parts.push_back(m.Find(m.ctx.topo.GlobalRank(m.run.schedule.stage_rank[s], 0, t)));
    }
    if (std::count(parts.begin(), parts.end(), nullptr) > 0) continue;
    // A device that fails a copy of its own weights has failed; internal invariant.
    std::vector<NamedTensors> held(T);
    for (int t = 0; t < T; ++t) PW_CHECK(parts[t]->AppendWeights(s, &held[t]).ok());
    for (size_t i = 0; i < held[0].size(); ++i) {
      const TensorShard* shard = parts[0]->ShardOfStored(held[0][i].first);
      if (shard == nullptr) {
        out.push_back(std::move(held[0][i]));
        continue;
      }
      std::vector<Tensor> pieces;
      for (int t = 0; t < T; ++t) pieces.push_back(held[t][i].second);
      absl::StatusOr<Tensor> whole = MergeParts(pieces, *shard);
      PW_CHECK(whole.ok());  // parts of one layer, built alike
      out.emplace_back(held[0][i].first, *std::move(whole));
    }
  }
  return out;
}

namespace {

// A checkpoint's gradient-compression state resumes only into the same compression and replica
// count; a checkpoint without any starts a compressed run from fresh state (nothing is lost).
absl::Status CheckGradSyncResume(const std::string& dir, const internal::ResumePoint& at,
                                 const GradCompression& run, int dp, int tp) {
  if (at.grad_compression.empty()) return absl::OkStatus();
  const std::string name = GradCompressionName(run);
  if (at.grad_compression == name && at.grad_sync_dp == dp && at.grad_sync_tp != tp) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, "/manifest.json: the checkpoint holds the error-feedback state of each of ",
        at.grad_sync_tp, " tensor-parallel parts (RunSpec.tensor_parallel = ", at.grad_sync_tp,
        "); this run has RunSpec.tensor_parallel = ", tp,
        ", which would drop it (resume with the same tensor_parallel)"));
  }
  if (at.grad_compression != name || at.grad_sync_dp != dp) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir,
                     "/manifest.json: the checkpoint holds the error-feedback state of "
                     "TrainOptions.grad_compression = ",
                     at.grad_compression, " at dp = ", at.grad_sync_dp,
                     "; this run uses TrainOptions.grad_compression = ", name, " at dp = ", dp,
                     ", which would drop it (resume with the same compression and dp)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Engine::Save(const std::string& dir) const {
  const Impl& m = *impl_;
  internal::ManifestInfo info;
  info.graph = &m.graph;
  info.options = &m.options;
  info.data_source = m.data->Describe();
  info.layout = m.ctx.layout();
  info.pp = m.ctx.topo.pp;
  info.dp = m.ctx.topo.dp;
  info.tp = m.ctx.topo.tp;
  info.sequence_parallel = m.run.sequence_parallel;
  info.chunks = m.run.schedule.spec.chunks;
  info.schedule = m.run.ScheduleName();
  info.step = m.step;
  info.optimizer_step = m.ranks[0]->optimizer_steps();
  info.lr = m.lr;
  info.scaler = &m.ranks[0]->scaler();
  // Replica 0 holds every stage: weights in model order; every rank's optimizer state comes to
  // its stage's replica 0 (a sharded strategy gathers it there: collective, so every rank of the
  // process takes part at once), and tensor-parallel parts to tensor-parallel rank 0 (whole
  // tensors: checkpoints do not depend on the layout).
  const int S = m.run.num_stages();
  std::vector<NamedTensors> state(m.ranks.size()), sync(m.ranks.size());
  std::vector<std::vector<NamedTensors>> weights(m.ranks.size(), std::vector<NamedTensors>(S));
  PW_RETURN_IF_ERROR(const_cast<Impl&>(m).OnEveryRank([&](RankExecutor& r) -> absl::Status {
    PW_RETURN_IF_ERROR(r.CollectState(&state[r.slot()], &sync[r.slot()]));
    if (r.replica() != 0) return absl::OkStatus();
    for (int s = 0; s < S; ++s) {
      if (m.run.schedule.stage_rank[s] != r.pipe()) continue;
      NamedTensors& w = weights[r.slot()][s];
      PW_RETURN_IF_ERROR(r.AppendWeights(s, &w));
      PW_RETURN_IF_ERROR(r.MergeTensorParallel(&w, "writing a checkpoint"));
    }
    return r.MergeTensorParallel(&state[r.slot()], "writing a checkpoint");
  }));
  NamedTensors model, opt;
  for (int s = 0; s < S; ++s) {
    for (auto& per_rank : weights) {
      for (auto& named : per_rank[s]) model.push_back(std::move(named));
    }
  }
  NamedTensors all_sync;
  for (size_t i = 0; i < m.ranks.size(); ++i) {
    for (auto& named : state[i]) opt.push_back(std::move(named));
    for (auto& named : sync[i]) all_sync.push_back(std::move(named));
  }
  const std::string manifest = internal::BuildManifest(info);
  if (!m.world->multi_process()) return WriteCheckpoint(dir, manifest, model, opt, all_sync);
  // Under a launcher this process holds one rank: it writes that rank's files, the root the
  // manifest (Note [Collective checkpoints]); tensors are found by name whatever the files.
  internal::RankExecutor& r = *m.ranks[0];
  std::vector<std::pair<std::string, const NamedTensors*>> files;
  if (!model.empty()) files.emplace_back(absl::StrCat("model-p", r.pipe(), ".safetensors"), &model);
  if (!opt.empty()) files.emplace_back(absl::StrCat("optimizer-p", r.pipe(), ".safetensors"), &opt);
  if (!all_sync.empty()) {
    files.emplace_back(absl::StrCat("grad_sync-r", r.global(), ".safetensors"), &all_sync);
  }
  return WriteCheckpointCollective(
      dir, manifest, files, m.world->is_root(),
      [&r](const std::string& mine) { return r.AllGatherBytes(mine, "writing a checkpoint"); });
}

absl::Status Engine::Resume(const std::string& dir, ResumeInfo* info) {
  Impl& m = *impl_;
  internal::RunSettings settings;
  settings.seed = m.options.seed;
  settings.data_source = m.data->Describe();
  settings.lr = m.lr;
  settings.optimizer = m.options.optimizer;
  settings.precision = m.options.precision;
  settings.layout = m.ctx.layout();
  // Everything a checkpoint must satisfy before any weight or optimizer state is touched, as
  // ReadCheckpoint's test: a checkpoint that fails it (another model, seed, shape) is skipped
  // for an older one that passes, with a warning (Note [Semantic fallback] in docs/checkpoint.md).
  internal::ResumePoint at;
  auto accept = [&](const Checkpoint& ck) -> absl::Status {
    PW_ASSIGN_OR_RETURN(at,
                        internal::CheckManifest(ck.path, ck.manifest_json, m.graph, m.ctx.layout(),
                                                m.options.optimizer.kind, &settings));
    PW_RETURN_IF_ERROR(
        CheckGradSyncResume(ck.path, at, m.options.grad_compression, m.ctx.topo.dp, m.ctx.topo.tp));
    for (auto& r : m.ranks) {
      PW_RETURN_IF_ERROR(internal::CheckParameters(ck.path, ck.model, r->params()));
    }
    return absl::OkStatus();
  };
  PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadCheckpoint(dir, nullptr, accept));
  for (auto& r : m.ranks) PW_RETURN_IF_ERROR(r->Restore(ck, at));
  m.step = at.step;
  if (info != nullptr) {
    info->path = ck.path;
    info->step = at.step;
    info->warnings = std::move(ck.warnings);
    info->warnings.insert(info->warnings.end(), at.warnings.begin(), at.warnings.end());
  }
  return absl::OkStatus();
}

}  // namespace pipewright
