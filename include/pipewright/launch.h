// Where a run's ranks live: the World. Launch() owns process start-up — MPI initialisation
// under a launcher and the NCCL bootstrap — so a library user starts a multi-process run the
// same way the CLI does:
//
//   PW_ASSIGN_OR_RETURN(World world, Launch(Device::Cpu(), absl::Seconds(60)));
//   PW_ASSIGN_OR_RETURN(auto engine, Engine::Create(graph, run, options, data, std::move(world)));
//
// Run under `mpirun -np N` (or `srun --mpi=pmix`), every process gets a World holding one rank
// of N: its communicator is the MPI backend on the CPU, or NCCL bootstrapped through MPI with
// `--device cuda` (rank 0 makes the unique id, MPI broadcasts it, each process drives the GPU of
// its rank on the node). Run plainly, the World is this process alone, and the Engine runs every
// rank as a thread of it, talking through the local backend (or NCCL between GPUs).
#ifndef PIPEWRIGHT_LAUNCH_H_
#define PIPEWRIGHT_LAUNCH_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/device.h"

namespace pipewright {

struct WorldOptions {
  // The ranks' device: CPU, or CUDA (which GPUs: cuda_devices).
  Device device = Device::Cpu();
  // A receive, collective or data wait that takes longer fails the step on every rank.
  absl::Duration timeout = absl::Seconds(60);
  // In one process: the backend between the rank threads. nullopt (auto) = NCCL when every rank
  // has a GPU of its own, else local (a whole pipeline on one GPU uses the local backend with
  // device buffers). kMpi is for launcher worlds only. Ignored in a launcher's world, whose
  // backend Launch chose.
  std::optional<CommBackend> comm;
  // CUDA GPUs. In one process rank g runs on cuda_devices[g % n] (empty = every visible GPU). In
  // a launcher's world this process's GPU is cuda_devices[0] (empty = its rank on the node
  // modulo the visible GPUs).
  std::vector<int> cuda_devices;
};

// One rank this process runs: its global rank, its GPU (-1 on the CPU) and its communicator over
// every rank of the run.
struct RankEndpoint {
  int global_rank = 0;
  int cuda_device = -1;
  std::unique_ptr<Communicator> comm;
};

class World;
absl::StatusOr<World> Launch(const WorldOptions& options);

class World {
 public:
  // Every rank of the run is a thread of this process. InvalidArgument for a comm that cannot
  // serve threads (kMpi) or NCCL without CUDA; FailedPrecondition for CUDA without a GPU.
  static absl::StatusOr<World> InProcess(WorldOptions options);
  // This process is rank comm->rank() of comm->size() processes, each running one rank; `comm`
  // spans them all (e.g. CreateMpiWorld, or NCCL). `keep_alive` (optional) is held as long as
  // the World or the engine it goes to (a bootstrap communicator that `comm` was made through).
  static absl::StatusOr<World> OfProcess(std::unique_ptr<Communicator> comm, WorldOptions options,
                                         std::unique_ptr<Communicator> keep_alive = nullptr);

  World(World&&) noexcept;
  World& operator=(World&&) noexcept;
  ~World();

  bool multi_process() const;
  int process_rank() const;                             // 0 in one process
  int process_count() const;                            // 1 in one process
  bool is_root() const { return process_rank() == 0; }  // the process that prints and saves
  const WorldOptions& options() const;
  // Which process this is, for messages: "this process", or "rank 2 (node7, GPU 1)".
  const std::string& description() const;

  // The communicators of a run laid out as `topology`: one endpoint per global rank this process
  // runs (all of them in one process; its own in a launcher's world). Called once (by
  // Engine::Create); later calls fail. In a launcher's world the process count must be
  // topology.world_size(), checked before any communication, so a wrong -np fails on every
  // process with InvalidArgument "rank R: the layout needs pp x dp = P x D = N processes, but M
  // were started (mpirun -np N)".
  absl::StatusOr<std::vector<RankEndpoint>> Connect(const Topology& topology);

  struct Impl;

 private:
  friend absl::StatusOr<World> Launch(const WorldOptions& options);
  explicit World(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// True when this process was started by an MPI launcher (mpirun, srun with PMI/PMIx), judged
// from the environment (docs/cluster.md); PIPEWRIGHT_MPI=0|1 forces it.
bool StartedByLauncher();

// The World of this process: under a launcher, initialises MPI (once per process; finalised at
// exit), makes the MPI communicator, and with a CUDA device bootstraps NCCL through it; otherwise
// World::InProcess. Collective across the launcher's processes. Errors name the process
// ("rank 2 (node7): --device cuda but no CUDA GPU is visible") and abort the others' MPI world,
// so no process is left waiting.
absl::StatusOr<World> Launch(const WorldOptions& options);
inline absl::StatusOr<World> Launch(Device device, absl::Duration timeout) {
  WorldOptions o;
  o.device = device;
  o.timeout = timeout;
  return Launch(o);
}

// Tells the launcher machinery that this process is about to exit after a failure, with
// `exit_code` (non-zero). Under a launcher, the exit then waits at most a few seconds
// (kMpiExitGrace, 5 s) for the other processes to finish too, and if some never do (stopped,
// hung), names them and ends the whole job with MPI_Abort(exit_code) instead of waiting for them
// forever in MPI_Finalize (docs/cluster.md, "Errors"). A failure that aborted the MPI world has
// the same effect; this also covers failures that did not (NCCL, set-up). No-op otherwise.
void NoteFailedExit(int exit_code);

}  // namespace pipewright

#endif  // PIPEWRIGHT_LAUNCH_H_
