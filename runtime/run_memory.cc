// Memory prediction of a run and its check against the machine (run_memory.h; docs/memory.md,
// "Checked at start").
#include "pipewright/run_memory.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "pipewright/comm.h"
#include "pipewright/device.h"
#include "pipewright/status.h"

namespace pipewright {
namespace {

namespace fs = std::filesystem;

// Byte counts are non-negative and saturate at kMemoryOverflow, as the partitioner's do.
constexpr auto SatAdd = SaturatingAdd;
constexpr auto SatMul = SaturatingMul;

// A cgroup limit this large is no limit (v1 writes "unlimited" as the largest page multiple
// below 2^63).
constexpr int64_t kNoLimit = int64_t{1} << 60;

// The first 64 KiB of a small kernel file (procfs and cgroupfs report size 0, so it is read
// until its end); nullopt when it cannot be opened.
std::optional<std::string> ReadSmallFile(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string text(64 * 1024, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

// "MemTotal:       24683784 kB" -> bytes; 0 when the key is missing.
int64_t MeminfoBytes(const std::string& meminfo, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, key) || !absl::ConsumePrefix(&line, ":")) continue;
    line = absl::StripAsciiWhitespace(line);
    int64_t scale = 1;
    if (absl::ConsumeSuffix(&line, "kB")) scale = 1024;
    int64_t v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &v) || v < 0) return 0;
    return SatMul(v, scale);
  }
  return 0;
}

// The smallest limit in `file` of `dir` and its ancestors up to `root`; 0 when none.
int64_t SmallestLimit(const fs::path& root, const fs::path& dir, const char* file,
                      std::string* source) {
  int64_t best = 0;
  fs::path at = dir;
  for (int depth = 0; depth < 64; ++depth) {  // a cgroup path is never this deep
    if (std::optional<std::string> text = ReadSmallFile(at / file)) {
      int64_t v = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &v) && v > 0 && v < kNoLimit &&
          (best == 0 || v < best)) {
        best = v;
        *source = (at / file).string();
      }
    }
    if (at == root || at.parent_path() == at) break;
    at = at.parent_path();
  }
  return best;
}

absl::Mutex override_mu(absl::kConstInit);
std::optional<HostMemory>& Override() {
  static auto* memory = new std::optional<HostMemory>();
  return *memory;
}

// Bytes of one sample (inputs and targets).
int64_t SampleBytes(const SampleSpec& spec) {
  auto bytes = [](const std::vector<int64_t>& shape, DType dtype) {
    int64_t n = static_cast<int64_t>(DTypeSize(dtype));
    for (int64_t d : shape) n = SatMul(n, std::max<int64_t>(d, 0));
    return n;
  };
  return SatAdd(bytes(spec.input_shape, spec.input_dtype),
                bytes(spec.target_shape, spec.target_dtype));
}

// Step batches a data-loading rank holds at once: the loader builds up to max(prefetch, workers)
// steps ahead (prefetch 2: rank_step.cc; Note [Loader workers] in data.cc) beside the step in
// use.
int64_t LoaderSteps(int data_workers) { return std::max(2, data_workers) + 1; }

// PredictRunMemory with `costs` (the model at the run's micro-batch size) and `recompute`.
absl::StatusOr<RunMemoryNeed> Predict(const ModelCosts& whole, const RunSpec& run,
                                      const std::vector<Recompute>& recompute,
                                      const TrainOptions& options, const SampleSpec& sample,
                                      const std::vector<RankPlace>& places) {
  // Under tensor parallelism, what one of the tp ranks holds (the planner's per-device view).
  ModelCosts costs = whole;
  if (run.tensor_parallel > 1) {
    DeviceSpec node;
    node.devices_per_node = run.tensor_parallel;
    PW_ASSIGN_OR_RETURN(
        TensorParallelCosts split,
        ShardForTensorParallel(whole, node, run.tensor_parallel, run.sequence_parallel));
    costs = std::move(split.rank);
  }
  ZeroSharding sharding{options.zero, run.data_parallel, options.bucket_bytes};
  sharding.buffers = options.zero_buffers;
  PW_ASSIGN_OR_RETURN(std::vector<RankMemory> ranks,
                      PredictRankMemory(costs, run.schedule, run.boundaries, recompute,
                                        BytesPerParam(options.precision), sharding));
  RunMemoryNeed need;
  need.micro_batch_size = costs.micro_batch_size;
  need.micro_batches = run.micro_batches();
  const Topology topo{run.pipeline_parallel(), run.data_parallel, run.tensor_parallel};
  const int64_t step_bytes =
      SatMul(SatMul(run.micro_batches(), costs.micro_batch_size), SampleBytes(sample));
  const int last_stage = run.num_stages() - 1;
  for (const RankPlace& p : places) {
    if (p.global_rank < 0 || p.global_rank >= topo.world_size()) {
      return absl::InvalidArgumentError(absl::StrCat("PredictRunMemory: rank ", p.global_rank,
                                                     " is not in the run's ", topo.world_size()));
    }
    RankMemoryNeed r;
    r.global_rank = p.global_rank;
    r.pipeline_rank = topo.PipelineRank(p.global_rank);
    r.replica = topo.Replica(p.global_rank);
    r.cuda_device = p.cuda_device;
    r.model = ranks[r.pipeline_rank];
    const std::vector<int>& st = r.model.stages;
    if (std::find(st.begin(), st.end(), 0) != st.end() ||
        std::find(st.begin(), st.end(), last_stage) != st.end()) {
      r.data_bytes = SatMul(step_bytes, LoaderSteps(options.data_workers));
      // On a GPU the step's micro-batches are copied to the device as well (rank_step.cc).
      if (p.cuda_device >= 0) r.model.memory.total = SatAdd(r.model.memory.total, step_bytes);
    }
    need.ranks.push_back(std::move(r));
  }
  return need;
}

// What `r` needs in all (its device's share and the host's).
int64_t RankTotal(const RankMemoryNeed& r) { return SatAdd(r.model.memory.total, r.data_bytes); }

// The rank of `need` that needs the most.
const RankMemoryNeed* Largest(const RunMemoryNeed& need) {
  const RankMemoryNeed* best = nullptr;
  for (const RankMemoryNeed& r : need.ranks) {
    if (best == nullptr || RankTotal(r) > RankTotal(*best)) best = &r;
  }
  return best;
}

// What the ranks on each GPU need there (device -> bytes).
std::map<int, int64_t> GpuBytes(const RunMemoryNeed& need) {
  std::map<int, int64_t> on;
  for (const RankMemoryNeed& r : need.ranks) {
    if (r.cuda_device >= 0) on[r.cuda_device] = SatAdd(on[r.cuda_device], r.model.memory.total);
  }
  return on;
}

// Whether `need` fits `host_limit` bytes of host memory and every GPU's total memory
// (`gpu_total`: device -> bytes). Unknown memory (0) is no limit; an overflowing count never
// fits.
bool Fits(const RunMemoryNeed& need, int64_t host_limit, const std::map<int, int64_t>& gpu_total) {
  const int64_t host_need = need.host_bytes();
  if (host_need == kMemoryOverflow || (host_limit > 0 && host_need > host_limit)) return false;
  for (const auto& [device, bytes] : GpuBytes(need)) {
    if (bytes == kMemoryOverflow) return false;
    auto it = gpu_total.find(device);
    if (it != gpu_total.end() && it->second > 0 && bytes > it->second) return false;
  }
  return true;
}

// The larger of what `need` takes on the host and on its fullest GPU.
int64_t Peak(const RunMemoryNeed& need) {
  int64_t t = need.host_bytes();
  for (const auto& [device, bytes] : GpuBytes(need)) t = std::max(t, bytes);
  return t;
}

// What would fit instead, tried with the same model: full recomputation, then the largest
// halved micro-batch size at the same number of micro-batches. Suggestions fit what is available
// now (MemAvailable, when known), not only the physical memory the check compares with.
std::string Alternatives(const ModelCosts& costs, const RunSpec& run, const TrainOptions& options,
                         const SampleSpec& sample, const std::vector<RankPlace>& places,
                         const HostMemory& host, const std::map<int, int64_t>& gpu_total) {
  int64_t budget = host.limit_bytes();
  if (host.available_bytes > 0 && (budget == 0 || host.available_bytes < budget)) {
    budget = host.available_bytes;
  }
  std::vector<std::string> ideas;
  const std::vector<Recompute> full(run.recompute.size(), Recompute::kFull);
  if (run.recompute != full) {
    absl::StatusOr<RunMemoryNeed> n = Predict(costs, run, full, options, sample, places);
    if (n.ok() && Fits(*n, budget, gpu_total)) {
      ideas.push_back(absl::StrCat("RunSpec.recompute = full (", FormatBytes(Peak(*n)), ")"));
    }
  }
  for (int64_t b = costs.micro_batch_size / 2; b >= 1; b /= 2) {
    absl::StatusOr<RunMemoryNeed> n =
        Predict(costs.WithMicroBatchSize(b), run, run.recompute, options, sample, places);
    if (n.ok() && Fits(*n, budget, gpu_total)) {
      ideas.push_back(absl::StrCat("MicroBatchShape.batch = ", b, " (", FormatBytes(Peak(*n)),
                                   "; more ScheduleSpec.micro_batches keep the global batch)"));
      break;
    }
  }
  if (!ideas.empty()) return absl::StrCat("would fit: ", absl::StrJoin(ideas, "; or "));
  return "neither RunSpec.recompute = full nor a smaller MicroBatchShape.batch (down to 1) would "
         "fit; try TrainOptions.precision = bf16, a smaller model, or more pipeline stages over "
         "several processes or machines (mpirun; docs/cluster.md)";
}

// "weights 0.9 MiB, gradients …, optimizer …, activations 1.2 GiB for 4 micro-batches of 8
// sequences, data batches …".
std::string DescribeRank(const RankMemoryNeed& r, int64_t micro_batch_size) {
  const StageMemory& m = r.model.memory;
  const std::string held = absl::StrJoin(r.model.held, "+");
  std::string s = absl::StrCat("weights ", FormatBytes(m.params), ", gradients ",
                               FormatBytes(m.grads), ", optimizer ", FormatBytes(m.optimizer),
                               ", activations ", FormatBytes(m.activations), " for ", held,
                               " micro-batch", held == "1" ? "" : "es", " of ", micro_batch_size,
                               " sequence", micro_batch_size == 1 ? "" : "s");
  if (r.data_bytes > 0) absl::StrAppend(&s, ", data batches ", FormatBytes(r.data_bytes));
  if (r.cuda_device >= 0) absl::StrAppend(&s, "; on GPU ", r.cuda_device);
  return s;
}

// What a run needs in all: FormatBytes, and why a count ran past 64 bits.
std::string NeedBytes(int64_t bytes) {
  return bytes == kMemoryOverflow ? "more than 8 EiB (its byte counts overflow 64-bit integers)"
                                  : FormatBytes(bytes);
}

// An overflowing count is a bad request on any machine; anything else does not fit this one.
absl::Status Refuse(int64_t need, const std::string& message) {
  if (need == kMemoryOverflow) return absl::InvalidArgumentError(message);
  return absl::FailedPreconditionError(message);
}

}  // namespace

int64_t HostMemory::limit_bytes() const {
  if (total_bytes > 0 && cgroup_limit_bytes > 0) return std::min(total_bytes, cgroup_limit_bytes);
  return std::max(total_bytes, cgroup_limit_bytes);
}

std::string HostMemory::Describe() const {
  const int64_t limit = limit_bytes();
  if (limit == 0) return "unknown memory (no MemTotal, no cgroup limit)";
  if (cgroup_limit_bytes > 0 && cgroup_limit_bytes == limit) {
    return absl::StrCat(FormatBytes(limit), " (cgroup limit, ", cgroup_file, "; MemTotal ",
                        total_bytes > 0 ? FormatBytes(total_bytes) : "unknown", ")");
  }
  return absl::StrCat(FormatBytes(limit), " (MemTotal; cgroup: ",
                      cgroup_limit_bytes > 0
                          ? absl::StrCat(FormatBytes(cgroup_limit_bytes), ", ", cgroup_file)
                          : "none",
                      ")");
}

HostMemory ReadHostMemory(const std::string& proc, const std::string& sys) {
  HostMemory m;
  if (std::optional<std::string> meminfo = ReadSmallFile(fs::path(proc) / "meminfo")) {
    m.total_bytes = MeminfoBytes(*meminfo, "MemTotal");
    m.available_bytes = MeminfoBytes(*meminfo, "MemAvailable");
  }
  std::optional<std::string> cgroups = ReadSmallFile(fs::path(proc) / "self/cgroup");
  if (!cgroups) return m;
  // Lines "ID:CONTROLLERS:PATH": "0::PATH" is the v2 hierarchy; a v1 line whose controllers
  // include "memory" names the memory controller's cgroup.
  const fs::path root = fs::path(sys) / "fs/cgroup";
  for (absl::string_view line : absl::StrSplit(*cgroups, '\n')) {
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    const fs::path rel = fs::path(std::string(f[2])).relative_path();
    std::string source;
    int64_t limit = 0;
    if (f[0] == "0" && f[1].empty()) {
      limit = SmallestLimit(root, root / rel, "memory.max", &source);
    } else {
      const std::vector<absl::string_view> controllers = absl::StrSplit(f[1], ',');
      if (std::find(controllers.begin(), controllers.end(), "memory") == controllers.end()) {
        continue;
      }
      limit =
          SmallestLimit(root / "memory", root / "memory" / rel, "memory.limit_in_bytes", &source);
    }
    if (limit > 0 && (m.cgroup_limit_bytes == 0 || limit < m.cgroup_limit_bytes)) {
      m.cgroup_limit_bytes = limit;
      m.cgroup_file = source;
    }
  }
  return m;
}

HostMemory ThisHostMemory() {
  {
    absl::MutexLock lock(&override_mu);
    if (Override().has_value()) return *Override();
  }
  return ReadHostMemory();
}

void SetHostMemoryForTesting(std::optional<HostMemory> memory) {
  absl::MutexLock lock(&override_mu);
  Override() = std::move(memory);
}

std::string FormatBytes(int64_t bytes) {
  if (bytes == kMemoryOverflow) return "more than 8 EiB";
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  const char* const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes) / 1024;
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", v, units[u]);
}

int64_t RankMemoryNeed::host_bytes() const {
  return cuda_device >= 0 ? data_bytes : SatAdd(model.memory.total, data_bytes);
}

int64_t RunMemoryNeed::host_bytes() const {
  int64_t t = 0;
  for (const RankMemoryNeed& r : ranks) t = SatAdd(t, r.host_bytes());
  return t;
}

std::string RunMemoryNeed::Describe() const {
  const RankMemoryNeed* big = Largest(*this);
  if (big == nullptr) return "nothing on this process (it runs no ranks)";
  if (ranks.size() == 1) {
    return absl::StrCat(NeedBytes(host_bytes()), " on this process (rank ", big->global_rank, ": ",
                        DescribeRank(*big, micro_batch_size), ")");
  }
  return absl::StrCat(NeedBytes(host_bytes()), " on this process (", ranks.size(),
                      " ranks; the largest, rank ", big->global_rank, ": ",
                      DescribeRank(*big, micro_batch_size), ")");
}

absl::StatusOr<RunMemoryNeed> PredictRunMemory(const LayerGraph& graph, const RunSpec& run,
                                               const TrainOptions& options,
                                               const SampleSpec& sample,
                                               const std::vector<RankPlace>& places) {
  return Predict(ToModelCosts(graph), run, run.recompute, options, sample, places);
}

absl::Status CheckRunMemory(const LayerGraph& graph, const RunSpec& run,
                            const TrainOptions& options, const SampleSpec& sample,
                            const std::vector<RankPlace>& places, const HostMemory& host) {
  const ModelCosts costs = ToModelCosts(graph);
  PW_ASSIGN_OR_RETURN(RunMemoryNeed need,
                      Predict(costs, run, run.recompute, options, sample, places));
  // Each GPU's total memory, where the device says (0: unknown).
  std::map<int, int64_t> gpu_total;
  for (const auto& [device, bytes] : GpuBytes(need)) {
    absl::StatusOr<CudaDeviceInfo> info = GetCudaDeviceInfo(device);
    gpu_total[device] = info.ok() ? info->total_memory_bytes : 0;
  }
  if (Fits(need, host.limit_bytes(), gpu_total)) return absl::OkStatus();
  const std::string alternatives =
      Alternatives(costs, run, options, sample, places, host, gpu_total);
  const int64_t host_need = need.host_bytes();
  if (host_need == kMemoryOverflow || (host.limit_bytes() > 0 && host_need > host.limit_bytes())) {
    return Refuse(host_need, absl::StrCat("the run needs ", need.Describe(), "; this machine has ",
                                          host.Describe(), "; ", alternatives));
  }
  for (const auto& [device, bytes] : GpuBytes(need)) {
    if (bytes != kMemoryOverflow && bytes <= gpu_total[device]) continue;
    std::vector<int> on;
    const RankMemoryNeed* big = nullptr;
    for (const RankMemoryNeed& r : need.ranks) {
      if (r.cuda_device != device) continue;
      on.push_back(r.global_rank);
      if (big == nullptr || r.model.memory.total > big->model.memory.total) big = &r;
    }
    return Refuse(bytes, absl::StrCat("the run needs ", NeedBytes(bytes), " on GPU ", device,
                                      " (rank", on.size() == 1 ? " " : "s ",
                                      absl::StrJoin(on, ", "), "; rank ", big->global_rank, ": ",
                                      DescribeRank(*big, need.micro_batch_size), "); GPU ", device,
                                      " has ", FormatBytes(gpu_total[device]), "; ", alternatives));
  }
  return absl::OkStatus();
}

absl::Status CheckEvaluationMemory(const LayerGraph& graph, const SampleSpec& sample,
                                   int64_t batches, int64_t checkpoint_bytes,
                                   const HostMemory& host) {
  const ModelCosts costs = ToModelCosts(graph);
  // One stage of every layer running one micro-batch, forward only: fp32 weights and gradients
  // (Instantiate makes both), no optimizer state, one micro-batch's saved activations.
  PW_ASSIGN_OR_RETURN(Schedule one, GenerateSchedule({ScheduleKind::k1F1B, 1, 1, 1}));
  PW_ASSIGN_OR_RETURN(std::vector<RankMemory> ranks,
                      PredictRankMemory(costs, one, {0, costs.num_layers()}, {Recompute::kNone},
                                        ParamBytes{4, 4, 0}));
  const StageMemory& m = ranks[0].memory;
  // Every held-out batch's inputs and targets are kept (EvalResult::inputs, targets).
  const int64_t data =
      SatMul(SatMul(std::max<int64_t>(batches, 0), costs.micro_batch_size), SampleBytes(sample));
  const int64_t need = SatAdd(SatAdd(m.total, data), std::max<int64_t>(checkpoint_bytes, 0));
  const int64_t limit = host.limit_bytes();
  if (need != kMemoryOverflow && (limit == 0 || need <= limit)) return absl::OkStatus();
  const bool model_fits = m.total != kMemoryOverflow && (limit == 0 || m.total <= limit);
  return Refuse(
      need,
      absl::StrCat("evaluating ", graph.name(), " needs ", NeedBytes(need),
                   " on this process (weights ", FormatBytes(m.params), ", gradients ",
                   FormatBytes(m.grads), ", activations ", FormatBytes(m.activations),
                   " for one micro-batch of ", costs.micro_batch_size,
                   " sequences, checkpoint tensors ", FormatBytes(checkpoint_bytes), ", ", batches,
                   " held-out batches ", FormatBytes(data), "); this machine has ", host.Describe(),
                   model_fits ? "; evaluate fewer batches"
                              : "; the model alone does not fit: evaluate it on a machine "
                                "with more memory"));
}

}  // namespace pipewright
