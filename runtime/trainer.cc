// The single-stage Trainer: the Engine with one rank running a one-stage 1F1B program
// (train.h).
#include <atomic>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "pipewright/engine.h"
#include "pipewright/train.h"

namespace pipewright {
namespace {
constexpr int kMaxPowerSgdRank = 1024;
std::atomic<bool> stop_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free, "RequestStop must be async-signal-safe");
}  // namespace

void RequestStop() { stop_requested.store(true, std::memory_order_relaxed); }
bool StopRequested() { return stop_requested.load(std::memory_order_relaxed); }
void ClearStopRequest() { stop_requested.store(false, std::memory_order_relaxed); }

absl::StatusOr<DpMode> ParseDpMode(absl::string_view name) {
  if (name == "sync") return DpMode::kSync;
  if (name == "async") return DpMode::kAsync;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown TrainOptions.dp_mode '", name, "' (sync, async)"));
}

std::string GradCompressionName(const GradCompression& c) {
  switch (c.kind) {
    case GradCompression::Kind::kNone:
      return "none";
    case GradCompression::Kind::kBf16:
      return "bf16";
    case GradCompression::Kind::kPowerSgd:
      return absl::StrCat("powersgd:", c.rank);
  }
  return "?";
}

absl::StatusOr<GradCompression> ParseGradCompression(absl::string_view name) {
  if (name == "none") return GradCompression::None();
  if (name == "bf16") return GradCompression::Bf16();
  constexpr absl::string_view kPowerSgd = "powersgd:";
  if (absl::StartsWith(name, kPowerSgd)) {
    const absl::string_view digits = name.substr(kPowerSgd.size());
    int rank = 0;
    if (!absl::SimpleAtoi(digits, &rank) || rank < 1 || rank > kMaxPowerSgdRank) {
      return absl::InvalidArgumentError(absl::StrCat("TrainOptions.grad_compression = ", name,
                                                     ": the PowerSGD rank must be an integer in "
                                                     "[1, ",
                                                     kMaxPowerSgdRank, "] (e.g. powersgd:4)"));
    }
    return GradCompression::PowerSgd(rank);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown TrainOptions.grad_compression '", name, "' (none, bf16, powersgd:R)"));
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const LayerGraph& graph,
                                                         int64_t micro_batches,
                                                         const TrainOptions& options,
                                                         std::shared_ptr<const Dataset> data) {
  if (micro_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Trainer::Create: micro_batches = ", micro_batches, ": must be >= 1"));
  }
  if (data == nullptr) data = SyntheticDataset(graph.shape().seq_len, options.seed);
  PW_ASSIGN_OR_RETURN(Schedule schedule, GenerateSchedule({ScheduleKind::k1F1B, 1,
                                                           static_cast<int>(micro_batches), 1}));
  PW_ASSIGN_OR_RETURN(RunSpec run, RunSpecFromSchedule(graph, std::move(schedule), 1));
  PW_ASSIGN_OR_RETURN(World world, World::InProcess({}));
  PW_ASSIGN_OR_RETURN(
      std::unique_ptr<Engine> engine,
      Engine::Create(graph, std::move(run), options, std::move(data), std::move(world)));
  return std::unique_ptr<Trainer>(new Trainer(std::move(engine)));
}

Trainer::Trainer(std::unique_ptr<Engine> engine) : engine_(std::move(engine)) {}
Trainer::~Trainer() = default;

absl::StatusOr<StepResult> Trainer::Step() {
  PW_ASSIGN_OR_RETURN(StepReport r, engine_->Step());
  return r.result;
}

int64_t Trainer::step() const { return engine_->step(); }
int64_t Trainer::global_batch() const { return engine_->global_batch(); }
float Trainer::PeakLr() const { return engine_->PeakLr(); }
absl::Status Trainer::Save(const std::string& dir) const { return engine_->Save(dir); }
absl::Status Trainer::Resume(const std::string& dir) { return engine_->Resume(dir); }
int64_t Trainer::peak_memory_bytes() const { return engine_->RankPeakMemoryBytes(0); }
int64_t Trainer::current_memory_bytes() const { return engine_->RankMemoryBytes(0); }
std::vector<Parameter*> Trainer::Parameters() const { return engine_->RankParameters(0); }

}  // namespace pipewright
