// The Engine: set-up of every rank this process runs, the step, checkpoints (engine.h). The
// ranks' work is in rank_step.cc / rank_p2p.cc, the reports in reports.cc.
#include "pipewright/engine.h"

#include <sched.h>

#include <cmath>
#include <cstdlib>
#include <exception>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipewright/checkpoint.h"
#include "pipewright/cpu.h"
#include "pipewright/run_memory.h"
#include "runtime/engine/engine_impl.h"
#include "runtime/train_state.h"

namespace pipewright {

using internal::Clock;
using internal::RankExecutor;
using internal::StageRt;

internal::RankExecutor* Engine::Impl::Find(int global) const {
  for (const auto& r : ranks) {
    if (r->global == global) return r.get();
  }
  return nullptr;
}

namespace {

// A tied weight whose owner and copy are on different pipeline ranks (Note [Tied parameters]).
struct CrossRankTie {
  std::string owner;  // the owner parameter's global name
  int owner_pipe = 0, copy_pipe = 0;
};

std::vector<CrossRankTie> CrossRankTies(const LayerGraph& graph, const RunSpec& run) {
  auto pipe_of = [&](int layer) {
    for (int s = 0; s < run.num_stages(); ++s) {
      if (layer < run.boundaries[s + 1]) return run.schedule.stage_rank[s];
    }
    return -1;
  };
  std::vector<CrossRankTie> ties;
  for (int i = 0; i < graph.num_layers(); ++i) {
    const LayerSpec& spec = *graph.node(i).spec;
    if (spec.tied_parameter().empty()) continue;
    for (int o = 0; o < i; ++o) {
      if (graph.node(o).name != spec.tied_to()) continue;
      if (pipe_of(o) != pipe_of(i)) ties.push_back({spec.tied_parameter(), pipe_of(o), pipe_of(i)});
    }
  }
  return ties;
}

// What asynchronous DP needs of the world and the model besides what ValidateTrainOptions checks
// (Note [Async DP] in async_dp.cc).
absl::Status CheckAsync(const TrainOptions& o, const World& world,
                        const std::vector<RankEndpoint>& endpoints,
                        const std::vector<CrossRankTie>& ties) {
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

// CPU cores this process may run on: its affinity (taskset, a cgroup's cpuset, a launcher's
// binding), else every core of the machine.
int UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
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
// the layers' shape functions (nothing allocated).
std::vector<std::vector<int64_t>> BoundaryShapes(const LayerGraph& graph, const SampleSpec& spec) {
  const int L = graph.num_layers();
  std::vector<std::vector<int64_t>> at(L + 1);
  at[0] = {graph.shape().batch};
  at[0].insert(at[0].end(), spec.input_shape.begin(), spec.input_shape.end());
  for (int i = 0; i < L; ++i) at[i + 1] = graph.node(i).spec->OutputShape(at[i]);
  return at;
}

// The rank's device: on CUDA its GPU, a stream and a stream-ordered allocator.
absl::Status PlaceOnDevice(RankExecutor& ex, int cuda_device) {
  if (cuda_device < 0) return absl::OkStatus();
  ex.cuda_device = cuda_device;
  PW_RETURN_IF_ERROR(ex.BindDevice());
  PW_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(Device::Cuda(cuda_device)));
  ex.stream = std::make_unique<CudaStream>(std::move(stream));
  PW_ASSIGN_OR_RETURN(ex.alloc, CreateCudaAllocator(cuda_device, ex.stream->get()));
  return absl::OkStatus();
}

// Instantiates virtual stage `s` on `ex`: only its layers, initialised on the host from the seed
// and their global names, then moved to the rank's device.
absl::StatusOr<StageRt> BuildStage(RankExecutor& ex, const Engine::Impl& m, int s,
                                   const std::vector<std::vector<int64_t>>& shape_at,
                                   DType input_dtype) {
  const RunSpec& run = m.run;
  StageRt st;
  st.index = s;
  st.begin = run.boundaries[s];
  st.end = run.boundaries[s + 1];
  st.first = s == 0;
  st.last = s == run.num_stages() - 1;
  st.recompute = run.recompute[s];
  PW_ASSIGN_OR_RETURN(st.stage, m.graph.Instantiate(st.begin, st.end, m.options.seed,
                                                    ex.on_cuda() ? ex.host.get() : ex.alloc.get()));
  if (ex.on_cuda()) {
    for (Parameter* p : st.stage->Parameters()) {
      Tensor v = Tensor::Empty(p->value.shape(), DType::kF32, ex.alloc.get());
      PW_RETURN_IF_ERROR(ops::Copy(ops::Exec{ex.alloc.get()}, p->value, v));
      p->value = std::move(v);
      p->grad = Tensor::Zeros(p->value.shape(), DType::kF32, ex.alloc.get());
    }
    for (const TiedLink& t : st.stage->tied()) {  // a linked copy: its gradient on the device
      t.copy->grad = Tensor::Zeros(t.copy->value.shape(), DType::kF32, ex.alloc.get());
    }
    PW_RETURN_IF_ERROR(st.stage->LinkTied());  // to the owners' device tensors
    PW_RETURN_IF_ERROR(ex.Sync());
  }
  st.in_shape = shape_at[st.begin];
  st.in_dtype = st.first ? input_dtype : DType::kF32;
  st.out_shape = shape_at[st.end];
  const Program& prog = ex.program();
  for (size_t i = 0; i < prog.actions.size(); ++i) {
    const Action& a = prog.actions[i];
    if (a.virtual_stage == s && (a.kind == ActionKind::kB || a.kind == ActionKind::kW)) {
      st.last_backward = static_cast<int>(i);
    }
  }
  return st;
}

// One rank of this process: its device, its stages and loss scaler (the data-parallel strategy,
// with the optimizer, comes once the data-parallel groups exist: ConnectReplicas).
absl::StatusOr<std::unique_ptr<RankExecutor>> BuildRank(
    Engine::Impl& m, RankEndpoint endpoint, const std::vector<std::vector<int64_t>>& shape_at) {
  auto ex = std::make_unique<RankExecutor>();
  ex->slot = static_cast<int>(m.ranks.size());
  ex->ctx = &m.ctx;
  ex->data = m.data;
  ex->global = endpoint.global_rank;
  ex->pipe = m.ctx.topo.PipelineRank(ex->global);
  ex->replica = m.ctx.topo.Replica(ex->global);
  ex->groups = internal::ProcessGroups(std::move(endpoint.comm));
  ex->pool = std::make_unique<cpu::ThreadPool>(m.threads_per_rank);
  PW_RETURN_IF_ERROR(PlaceOnDevice(*ex, endpoint.cuda_device));
  const int S = m.run.num_stages();
  ex->local.assign(S, -1);
  for (int s = 0; s < S; ++s) {
    if (m.run.schedule.stage_rank[s] != ex->pipe) continue;
    PW_ASSIGN_OR_RETURN(StageRt st, BuildStage(*ex, m, s, shape_at, m.data->Spec().input_dtype));
    ex->local[s] = static_cast<int>(ex->stages.size());
    ex->stages.push_back(std::move(st));
  }
  // Tied copies whose owner is in another of this rank's stages (V schedules put the first and
  // last stage on one rank) are linked like those within a stage.
  std::vector<Parameter*> trained;
  for (StageRt& st : ex->stages) {
    for (Parameter* p : st.stage->Parameters()) trained.push_back(p);
    for (const TiedLink& t : st.stage->tied()) ex->tied_local.push_back(t);
  }
  PW_ASSIGN_OR_RETURN(std::vector<TiedLink> across, LinkTiedParameters(trained));
  for (Parameter* p : trained) {
    bool linked = false;
    for (const TiedLink& t : across) linked = linked || t.copy == p;
    if (!linked) ex->params.push_back(p);
  }
  ex->tied_local.insert(ex->tied_local.end(), across.begin(), across.end());
  const TrainOptions& to = m.options;
  if (ex->on_cuda() && to.optimizer.kind != OptimizerKind::kAdamW) {
    return absl::InvalidArgumentError(
        "a CUDA rank (WorldOptions.device = cuda) supports TrainOptions.optimizer.kind = adamw "
        "only");
  }
  if (to.precision == Precision::kFp16) ex->scaler = LossScaler(to.loss_scale);
  ex->total.global_rank = ex->global;
  ex->total.pipeline_rank = ex->pipe;
  ex->total.replica = ex->replica;
  ex->total.threads = ex->pool->size();
  return ex;
}

std::pair<int, int> PipePair(const CrossRankTie& t) {
  return {std::min(t.owner_pipe, t.copy_pipe), std::max(t.owner_pipe, t.copy_pipe)};
}

// The pairs of pipeline ranks that share a tied weight, each once, in the order of `ties`.
std::vector<std::pair<int, int>> TiePairs(const std::vector<CrossRankTie>& ties) {
  std::vector<std::pair<int, int>> pairs;
  for (const CrossRankTie& t : ties) {
    if (std::find(pairs.begin(), pairs.end(), PipePair(t)) == pairs.end()) {
      pairs.push_back(PipePair(t));
    }
  }
  return pairs;
}

// This rank's end of every tie across ranks, over its embedding group (groups.tie).
absl::Status LinkRemoteTies(RankExecutor& r, const std::vector<CrossRankTie>& ties) {
  const std::vector<std::pair<int, int>> pairs = TiePairs(ties);
  for (const CrossRankTie& t : ties) {
    if (r.pipe != t.owner_pipe && r.pipe != t.copy_pipe) continue;
    const size_t k = std::find(pairs.begin(), pairs.end(), PipePair(t)) - pairs.begin();
    Parameter* mine = nullptr;
    for (Parameter* p : r.params) {
      if (r.pipe == t.owner_pipe ? p->name == t.owner && p->tied_to.empty()
                                 : p->tied_to == t.owner) {
        mine = p;
      }
    }
    if (mine == nullptr) {
      return absl::InternalError(
          absl::StrCat(r.Who(), ": holds no end of the tied weight ", t.owner));
    }
    r.tied_remote.push_back({mine, r.groups.tie(k)});
  }
  return absl::OkStatus();
}

// Splits every rank's groups off the world (ProcessGroups::Connect: collective, one thread per
// rank) and gives each rank its data-parallel strategy over them.
absl::Status ConnectReplicas(Engine::Impl& m) {
  const absl::Duration timeout = m.ctx.timeout;
  const int64_t bucket_bytes = m.options.bucket_bytes;
  const GradCompression compression = m.options.grad_compression;
  const bool async = m.options.dp_mode == DpMode::kAsync;
  const int zero = m.options.zero;
  const Topology topo = m.ctx.topo;
  const std::vector<CrossRankTie> ties = CrossRankTies(m.graph, m.run);
  internal::GroupNeeds needs;
  needs.tie_pairs = TiePairs(ties);
  needs.pipeline = async;
  return m.OnEveryRank([=](RankExecutor& r) -> absl::Status {
    PW_RETURN_IF_ERROR(r.groups.Connect(topo, r.global, needs, timeout));
    PW_RETURN_IF_ERROR(LinkRemoteTies(r, ties));
    internal::DataParallelParams params;
    for (StageRt& st : r.stages) {
      internal::GradSyncStage gs{st.index, {}};
      for (int i = 0; i < st.stage->size(); ++i) {
        gs.layers.push_back(st.stage->layer(i).Parameters());
        for (const Parameter* p : gs.layers.back()) {
          if (!p->tied_to.empty()) params.tied.insert(p);
        }
      }
      params.stages.push_back(std::move(gs));
    }
    for (const TiedLink& t : r.tied_local) params.tied.insert({t.owner, t.copy});
    for (const RankExecutor::RemoteTie& t : r.tied_remote) params.tied.insert(t.param);
    params.trained = r.params;
    if (async) {
      r.dp = internal::CreateAsync(r.DpContext(), std::move(params));
    } else if (zero > 0) {
      PW_ASSIGN_OR_RETURN(r.dp, internal::CreateSharded(r.DpContext(), std::move(params), zero));
    } else {
      std::unique_ptr<internal::GradSync> sync;
      if (compression.kind == GradCompression::Kind::kPowerSgd) {
        sync = internal::CreatePowerSgd(r.SyncContext(), params.stages, bucket_bytes,
                                        compression.rank);
      } else {
        sync = internal::CreateBucketedAllReduce(r.SyncContext(), params.stages, bucket_bytes,
                                                 compression);
      }
      r.dp = internal::CreateReplicated(r.DpContext(), std::move(params), std::move(sync));
    }
    // What the rank holds before any step: weights, gradients, optimizer state.
    PW_RETURN_IF_ERROR(r.Sync());
    r.static_bytes = r.alloc->current_bytes();
    return absl::OkStatus();
  });
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
  m.ctx.topo = Topology{m.run.pipeline_parallel(), m.run.data_parallel};
  m.ctx.timeout = m.world->options().timeout;
  m.lr.peak = ScaleLearningRate(options.lr, m.ctx.layout().global_batch(), options.base_batch,
                                options.lr_scaling);
  m.lr.warmup_steps = options.warmup_steps;
  m.lr.total_steps = std::max<int64_t>(1, options.steps);
  m.lr.min_ratio = options.min_lr_ratio;

  PW_ASSIGN_OR_RETURN(std::vector<RankEndpoint> endpoints, m.world->Connect(m.ctx.topo));
  PW_RETURN_IF_ERROR(CheckAsync(m.options, *m.world, endpoints, CrossRankTies(m.graph, m.run)));
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
  const auto shape_at = BoundaryShapes(graph, m.data->Spec());
  m.threads_per_rank =
      ThreadsPerRank(m.options, *m.world, static_cast<int>(std::max<size_t>(1, endpoints.size())));
  // The ranks split their products over their own threads; OpenBLAS's own (process-wide) would
  // multiply with them, and would change the products' bits with their count.
  if (!m.world->options().device.is_cuda()) SetCpuKernelThreads(1);
  for (RankEndpoint& e : endpoints) {
    PW_ASSIGN_OR_RETURN(std::unique_ptr<RankExecutor> ex, BuildRank(m, std::move(e), shape_at));
    m.ranks.push_back(std::move(ex));
  }
  // What the pools got (fewer threads only when the system refused to start more).
  if (!m.ranks.empty()) m.threads_per_rank = m.ranks.front()->pool->size();
  PW_RETURN_IF_ERROR(ConnectReplicas(m));
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  // Communicators first: a backend may still hold buffers from any rank's allocator (a
  // receive posted before an abort), and every allocator must outlive them.
  for (auto& r : impl_->ranks) r->groups.ResetGroups();
  for (auto& r : impl_->ranks) r->groups.ResetWorld();
  for (auto& r : impl_->ranks) {
    if (!r->on_cuda()) continue;
    // Device memory is freed on the rank's stream, from this thread: make its GPU current,
    // drop every device tensor, drain the stream, then release the stream's cuBLAS context.
    (void)r->BindDevice();
    r->dp.reset();
    r->stages.clear();
    r->params.clear();
    (void)r->Sync();
    ops::ReleaseStream(r->alloc->stream());
  }
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
  rep.result.stop_requested = outcomes[0].stop_requested;
  rep.result.lr = lr;
  rep.result.step_time_s = internal::Seconds(t0, Clock::now());
  rep.result.samples_per_s =
      rep.result.step_time_s > 0 ? m.ctx.layout().global_batch() / rep.result.step_time_s : 0;
  for (auto& r : m.ranks) {
    RankTimes t = r->step_times;
    t.global_rank = r->global;
    t.pipeline_rank = r->pipe;
    t.replica = r->replica;
    t.threads = r->total.threads;
    for (const StageRt& st : r->stages) t.stages.push_back(st.index);
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
  absl::Status s = m.OnEveryRank([&](RankExecutor& r) { return r.RunAsync(run, &end[r.slot]); });
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
  for (auto& r : m.ranks) rep.applied_by_rank.emplace_back(r->global, r->AsyncApplied());
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
  return r != nullptr ? r->params : std::vector<Parameter*>{};
}

int64_t Engine::RankMemoryBytes(int global_rank) const {
  RankExecutor* r = impl_->Find(global_rank);
  return r != nullptr ? r->alloc->current_bytes() : 0;
}

int64_t Engine::RankPeakMemoryBytes(int global_rank) const {
  RankExecutor* r = impl_->Find(global_rank);
  return r != nullptr ? r->alloc->peak_bytes() : 0;
}

NamedTensors Engine::Weights() const {
  const Impl& m = *impl_;
  NamedTensors out;
  for (int s = 0; s < m.run.num_stages(); ++s) {
    // Multi-process: only the stages this process holds (when it is in replica 0).
    RankExecutor* rp = m.Find(m.ctx.topo.GlobalRank(m.run.schedule.stage_rank[s], 0));
    if (rp == nullptr) continue;
    RankExecutor& r = *rp;
    PW_CHECK(r.BindDevice().ok());
    for (Parameter* q : r.Local(s)->stage->Parameters()) {
      if (!q->tied_to.empty()) continue;  // stored once, as its owner
      // A device that fails a copy of its own weights has failed; internal invariant.
      absl::StatusOr<Tensor> h = r.ToHost(q->value);
      PW_CHECK(h.ok());
      out.emplace_back(q->name, q->value.device().is_cpu() ? h->Clone() : *std::move(h));
    }
  }
  return out;
}

namespace {

// A checkpoint's gradient-compression state resumes only into the same compression and replica
// count; a checkpoint without any starts a compressed run from fresh state (nothing is lost).
absl::Status CheckGradSyncResume(const std::string& dir, const internal::ResumePoint& at,
                                 const GradCompression& run, int dp) {
  if (at.grad_compression.empty()) return absl::OkStatus();
  const std::string name = GradCompressionName(run);
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
  info.chunks = m.run.schedule.spec.chunks;
  info.schedule = m.run.ScheduleName();
  info.step = m.step;
  info.optimizer_step = m.ranks[0]->dp->optimizer_steps();
  info.lr = m.lr;
  info.scaler = &m.ranks[0]->scaler;
  // Replica 0 holds every stage: weights in model order; every rank's optimizer state comes to
  // its stage's replica 0 (a sharded strategy gathers it there: collective, so every rank of the
  // process takes part at once).
  NamedTensors model = Weights(), opt;
  std::vector<NamedTensors> state(m.ranks.size()), sync(m.ranks.size());
  PW_RETURN_IF_ERROR(const_cast<Impl&>(m).OnEveryRank([&](RankExecutor& r) -> absl::Status {
    PW_ASSIGN_OR_RETURN(state[r.slot], r.dp->OptimizerState());
    PW_ASSIGN_OR_RETURN(NamedTensors mine, r.dp->SyncState());
    // Every replica's compression state (its own error buffers), under "replica<R>/".
    for (auto& [name, t] : mine) {
      sync[r.slot].emplace_back(absl::StrCat("replica", r.replica, "/", name), std::move(t));
    }
    return absl::OkStatus();
  }));
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
  if (!model.empty()) files.emplace_back(absl::StrCat("model-p", r.pipe, ".safetensors"), &model);
  if (!opt.empty()) files.emplace_back(absl::StrCat("optimizer-p", r.pipe, ".safetensors"), &opt);
  if (!all_sync.empty()) {
    files.emplace_back(absl::StrCat("grad_sync-r", r.global, ".safetensors"), &all_sync);
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
    PW_RETURN_IF_ERROR(CheckGradSyncResume(ck.path, at, m.options.grad_compression, m.ctx.topo.dp));
    for (auto& r : m.ranks) {
      PW_RETURN_IF_ERROR(internal::CheckParameters(ck.path, ck.model, r->params));
    }
    return absl::OkStatus();
  };
  PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadCheckpoint(dir, nullptr, accept));
  for (auto& r : m.ranks) {
    PW_RETURN_IF_ERROR(r->BindDevice());
    PW_RETURN_IF_ERROR(r->dp->LoadOptimizerState(ck.optimizer, at.optimizer_step));
    if (!at.grad_compression.empty()) {
      absl::Status s = r->dp->LoadSyncState(ck.grad_sync, absl::StrCat("replica", r->replica, "/"));
      if (!s.ok()) {
        return absl::Status(s.code(),
                            absl::StrCat(ck.path, "/grad_sync.safetensors: ", s.message()));
      }
    }
  }
  for (auto& r : m.ranks) {
    PW_RETURN_IF_ERROR(r->BindDevice());
    for (Parameter* p : r->params) {
      PW_RETURN_IF_ERROR(
          ops::Copy(ops::Exec{r->alloc.get()}, ck.model.at(StoredName(*p)), p->value));
    }
    PW_RETURN_IF_ERROR(r->Sync());
    internal::RestoreLossScaler(at, &r->scaler);
    r->loader.reset();  // restarts at the checkpoint's data position
  }
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
