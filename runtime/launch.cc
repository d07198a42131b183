// World and Launch (launch.h): where the ranks run, and process start-up under a launcher.
#include "pipewright/launch.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/comm/mpi.h"

namespace pipewright {

struct World::Impl {
  WorldOptions options;
  // A launcher's world: this process's communicator over every process, and what it was
  // bootstrapped through (the MPI world under NCCL), kept alive as long as it is.
  std::unique_ptr<Communicator> process;
  std::unique_ptr<Communicator> keep_alive;
  int rank = 0, size = 1;
  bool multi_process = false;
  bool connected = false;
  std::string description = "this process";
};

World::World(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
World::World(World&&) noexcept = default;
World& World::operator=(World&&) noexcept = default;
World::~World() = default;

bool World::multi_process() const { return impl_->multi_process; }
int World::process_rank() const { return impl_->rank; }
int World::process_count() const { return impl_->size; }
const WorldOptions& World::options() const { return impl_->options; }
const std::string& World::description() const { return impl_->description; }

namespace {

absl::Status CheckTimeout(const WorldOptions& o) {
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the timeout must be positive");
  }
  return absl::OkStatus();
}

// The GPUs the ranks of one process run on: the requested ones, or every visible one.
absl::StatusOr<std::vector<int>> UsableGpus(const WorldOptions& o) {
  const int visible = CudaDeviceCount();
  if (visible == 0) {
    return absl::FailedPreconditionError(
        "WorldOptions.device = cuda: no CUDA GPU is visible (no driver, no device, or "
        "CUDA_VISIBLE_DEVICES hides them); run on the CPU with WorldOptions.device = cpu");
  }
  std::vector<int> gpus = o.cuda_devices;
  if (gpus.empty()) {
    for (int d = 0; d < visible; ++d) gpus.push_back(d);
  }
  for (int d : gpus) {
    if (d < 0 || d >= visible) {
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA device ", d, " does not exist (", visible, " visible)"));
    }
  }
  return gpus;
}

// Every rank of `topology` as a thread of this process: rank g on gpus[g % n] (CUDA), talking
// through NCCL when each has a GPU of its own (or when asked), else the local backend.
absl::StatusOr<std::vector<RankEndpoint>> ConnectThreads(const WorldOptions& o,
                                                         const Topology& topology) {
  const int n = topology.world_size();
  std::vector<int> rank_gpu(n, -1);
  bool distinct_gpus = false;
  if (o.device.is_cuda()) {
    PW_ASSIGN_OR_RETURN(std::vector<int> gpus, UsableGpus(o));
    for (int g = 0; g < n; ++g) rank_gpu[g] = gpus[g % gpus.size()];
    distinct_gpus = static_cast<int>(gpus.size()) >= n;
  }
  const bool nccl = o.comm == CommBackend::kNccl ||
                    (!o.comm.has_value() && o.device.is_cuda() && distinct_gpus && n > 1);
  if (nccl && (!o.device.is_cuda() || !distinct_gpus)) {
    return absl::InvalidArgumentError(
        "the NCCL backend needs WorldOptions.device = cuda and one GPU per rank (pp x dp GPUs)");
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  if (nccl) {
    PW_ASSIGN_OR_RETURN(comms, CreateNcclWorld(rank_gpu, o.timeout));
  } else {
    comms = CreateLocalWorld(n);
  }
  std::vector<RankEndpoint> out;
  for (int g = 0; g < n; ++g) out.push_back(RankEndpoint{g, rank_gpu[g], std::move(comms[g])});
  return out;
}

// The NCCL unique id is NCCL_UNIQUE_ID_BYTES = 128 bytes; MPI broadcasts it as 32 i32 words.
constexpr size_t kNcclIdBytes = 128;

// NCCL bootstrapped through `mpi`: rank 0 makes the id, MPI broadcasts it, each process drives
// `gpu`. A failure on any process aborts the MPI world, so no process waits for it.
absl::StatusOr<std::unique_ptr<Communicator>> BootstrapNccl(Communicator& mpi,
                                                            const MpiProcess& proc, int gpu,
                                                            absl::Duration timeout) {
  Tensor id = Tensor::Zeros({static_cast<int64_t>(kNcclIdBytes / 4)}, DType::kI32);
  if (proc.rank == 0) {
    absl::StatusOr<std::string> uid = NcclUniqueId();
    absl::Status made = uid.status();
    if (made.ok() && uid->size() != kNcclIdBytes) {
      made = absl::InternalError(absl::StrCat("NCCL unique id of ", uid->size(), " bytes"));
    }
    if (!made.ok()) {
      mpi.Abort(made);
      return made;
    }
    std::memcpy(id.raw(), uid->data(), kNcclIdBytes);
  }
  std::unique_ptr<Work> b = mpi.Broadcast(id, 0);
  PW_RETURN_IF_ERROR(b->Wait(timeout));
  absl::StatusOr<std::unique_ptr<Communicator>> nccl =
      CreateNcclCommunicator(std::string(static_cast<const char*>(id.raw()), kNcclIdBytes),
                             proc.rank, proc.size, gpu, timeout);
  if (!nccl.ok()) mpi.Abort(nccl.status());
  return nccl;
}

}  // namespace

absl::StatusOr<World> World::InProcess(WorldOptions options) {
  PW_RETURN_IF_ERROR(CheckTimeout(options));
  if (options.comm == CommBackend::kMpi) {
    return absl::InvalidArgumentError(
        "the MPI backend connects processes started by a launcher (mpirun -np N); ranks that "
        "are threads of one process use the local or NCCL backend");
  }
  if (options.device.is_cuda()) PW_RETURN_IF_ERROR(UsableGpus(options).status());
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  return World(std::move(impl));
}

absl::StatusOr<World> World::OfProcess(std::unique_ptr<Communicator> comm, WorldOptions options,
                                       std::unique_ptr<Communicator> keep_alive) {
  PW_RETURN_IF_ERROR(CheckTimeout(options));
  if (comm == nullptr) return absl::InvalidArgumentError("World::OfProcess: no communicator");
  auto impl = std::make_unique<Impl>();
  impl->rank = comm->rank();
  impl->size = comm->size();
  impl->multi_process = true;
  impl->description = absl::StrCat("rank ", impl->rank);
  impl->options = std::move(options);
  impl->process = std::move(comm);
  impl->keep_alive = std::move(keep_alive);
  return World(std::move(impl));
}

absl::StatusOr<std::vector<RankEndpoint>> World::Connect(const Topology& topology) {
  Impl& m = *impl_;
  if (m.connected) {
    return absl::FailedPreconditionError("this World is already connected to an engine");
  }
  m.connected = true;
  if (!m.multi_process) return ConnectThreads(m.options, topology);
  // Checked on every process before any communication, so a wrong -np fails fast everywhere.
  if (m.size != topology.world_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank %d: the layout needs pp x dp = %d x %d = %d processes, but %d were started "
        "(mpirun -np %d)",
        m.rank, topology.pp, topology.dp, topology.world_size(), m.size, topology.world_size()));
  }
  const int gpu = !m.options.device.is_cuda()      ? -1
                  : m.options.cuda_devices.empty() ? 0
                                                   : m.options.cuda_devices[0];
  std::vector<RankEndpoint> out;
  out.push_back(RankEndpoint{m.rank, gpu, std::move(m.process)});
  m.process.reset();
  return out;
}

bool StartedByLauncher() { return LaunchedByMpi(); }

void NoteFailedExit(int exit_code) { NoteMpiFailure(exit_code); }

absl::StatusOr<World> Launch(const WorldOptions& options) {
  PW_RETURN_IF_ERROR(CheckTimeout(options));
  if (!StartedByLauncher()) return World::InProcess(options);
  PW_ASSIGN_OR_RETURN(MpiProcess proc, InitMpi());
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> mpi, CreateMpiWorld());
  if (!options.device.is_cuda()) {
    absl::StatusOr<World> w = World::OfProcess(std::move(mpi), options);
    if (w.ok()) w->impl_->description = absl::StrCat("rank ", proc.rank, " (", proc.hostname, ")");
    return w;
  }
  // NCCL bootstrapped through MPI; each process drives the GPU of its rank on the node.
  const int gpus = CudaDeviceCount();
  if (gpus == 0) {
    absl::Status s = absl::FailedPreconditionError(
        absl::StrCat("rank ", proc.rank, " (", proc.hostname,
                     "): WorldOptions.device = cuda but no CUDA GPU is visible"));
    mpi->Abort(s);
    return s;
  }
  WorldOptions o = options;
  const int gpu = o.cuda_devices.empty() ? proc.local_rank % gpus : o.cuda_devices[0];
  o.cuda_devices = {gpu};
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nccl,
                      BootstrapNccl(*mpi, proc, gpu, options.timeout));
  absl::StatusOr<World> w = World::OfProcess(std::move(nccl), o, std::move(mpi));
  if (w.ok()) {
    w->impl_->description =
        absl::StrCat("rank ", proc.rank, " (", proc.hostname, ", GPU ", gpu, ")");
  }
  return w;
}

}  // namespace pipewright
