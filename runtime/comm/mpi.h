// The MPI communicator backend: one rank per process, CPU buffers (docs/mpi_backend.md).
//
// Runtime-internal: programs reach it through Launch (include/pipewright/launch.h), which
// initialises MPI and makes the world under a launcher (runtime/launch.cc). This
// header does not include <mpi.h>: it compiles in every build; without MPI the functions below
// come from runtime/comm/no_mpi.cc and fail with FailedPrecondition "built without MPI".
//
// Typical use, in every process of an `mpirun -np N` job:
//
//   if (LaunchedByMpi()) {
//     PW_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> world, CreateMpiWorld());
//     ...  // world->rank() is this process's rank in MPI_COMM_WORLD
//   }
//   FinalizeMpi();  // optional: registered at exit when pipewright initialised MPI
#ifndef PIPEWRIGHT_RUNTIME_COMM_MPI_H_
#define PIPEWRIGHT_RUNTIME_COMM_MPI_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"

namespace pipewright {

// True when this process was started by an MPI launcher, judged from the environment only (MPI
// is never initialised to find out):
//  - PIPEWRIGHT_MPI=0|off|false forces false, PIPEWRIGHT_MPI=1|on|true forces true (the latter
//    lets a plain `./prog` initialise MPI as a singleton world of one process);
//  - otherwise true when MPI is already initialised (and not finalised) in this process, or when
//    the environment has the variables a launcher sets for MPI's wire-up: OMPI_COMM_WORLD_SIZE
//    (Open MPI's mpirun), PMIX_RANK (PMIx launchers: Open MPI 5, `srun --mpi=pmix`), PMI_RANK or
//    PMI_SIZE (MPICH/Hydra, Intel MPI, `srun --mpi=pmi2`), MV2_COMM_WORLD_SIZE (MVAPICH).
//  - SLURM_PROCID / SLURM_NTASKS alone do not count: a plain `srun` without an MPI plugin sets no
//    PMI variables, and MPI_Init there would make every task a separate world of size 1.
// Always false in a build without MPI.
bool LaunchedByMpi();

// This process's place in the MPI job.
struct MpiProcess {
  int rank = 0;        // in MPI_COMM_WORLD
  int size = 1;        // of MPI_COMM_WORLD
  int local_rank = 0;  // among the processes of this node (MPI_COMM_TYPE_SHARED)
  int local_size = 1;
  std::string hostname;  // MPI_Get_processor_name
  // True when MPI granted MPI_THREAD_MULTIPLE. False: it granted MPI_THREAD_SERIALIZED; the
  // backend still works (it makes all its MPI calls under one process-wide lock), but the
  // application must not call MPI itself, from any thread, while pipewright communicators exist.
  bool thread_multiple = false;
};

// Initialises MPI once per process (MPI_Init_thread asking for MPI_THREAD_MULTIPLE) and returns
// the process's place; later calls return the same value. Collective over MPI_COMM_WORLD on its
// first call (MPI_Comm_split_type). Sets MPI_ERRORS_RETURN on MPI_COMM_WORLD when pipewright
// initialised MPI, and registers FinalizeMpi to run at exit. When the application initialised MPI
// itself, only the thread level is checked and the application keeps ownership (it finalises).
// Fails with FailedPrecondition when:
//  - MPI is not initialised and LaunchedByMpi() is false (MPI_Init is not attempted);
//  - MPI grants less than MPI_THREAD_SERIALIZED: the backend calls MPI from the thread waiting on
//    an operation and from its progress thread (one at a time), which FUNNELED/SINGLE forbid;
//  - MPI was already finalised (it cannot be initialised twice).
absl::StatusOr<MpiProcess> InitMpi();

// Closes every live MPI communicator of this process (their pending operations fail with
// FailedPrecondition, later calls on them too), stops the progress thread and, when pipewright
// initialised MPI, takes the exit roll call and calls MPI_Finalize. Idempotent; safe at exit and
// without InitMpi.
//
// The roll call (Note [Leaving after a failure] in mpi_process.cc): every process tells every
// other one that it reached FinalizeMpi, so MPI_Finalize, which waits for every process, is only
// entered once all of them are there. A process that did not fail waits for the others as long as
// it takes. A process that failed (NoteMpiFailure, or any of its MPI worlds was aborted) waits at
// most kMpiExitGrace; if some process has not come by then (stopped, hung, deadlocked), it prints
// which ones ("rank 1 did not reach the end of the run ...") and calls MPI_Abort with its exit
// code, so the launcher ends the whole job instead of every survivor waiting in MPI_Finalize.
void FinalizeMpi();

// How long a failed process waits for the others at exit before MPI_Abort (FinalizeMpi).
inline constexpr absl::Duration kMpiExitGrace = absl::Seconds(5);

// Marks this process as failed, to exit with `exit_code`: FinalizeMpi then bounds its wait for
// the other processes by kMpiExitGrace and uses the code for MPI_Abort. 0 means "failed, no
// particular code": it keeps a code set before, else 1. Aborting an MPI world or an NCCL world
// marks the process failed too (as with 0). Callable in any process; it matters only where
// pipewright initialised MPI. No-op in a build without MPI.
void NoteMpiFailure(int exit_code);

// Knobs of one MPI world; the defaults are right for normal use, the others exist mostly for
// tests. Every process must pass the same values.
struct MpiWorldOptions {
  // Tags in [0, max_direct_tag] travel as that MPI tag; larger ones share one reserved MPI tag
  // and are matched by the header of each message (docs/mpi_backend.md). Negative: MPI_TAG_UB - 1.
  // Clamped to MPI_TAG_UB - 1.
  int64_t max_direct_tag = -1;
  // Largest byte count passed to MPI as one count of MPI_BYTE; larger messages use a derived
  // datatype (MPI counts are int). Clamped to [1, INT_MAX].
  int64_t max_block_bytes = INT64_MAX;
  // How long destroying a communicator waits for its sends to complete (a receiver that never
  // takes a large message would otherwise keep its buffer forever); 0 after an abort.
  absl::Duration drain_timeout = absl::Seconds(10);
};

// A Communicator over MPI_COMM_WORLD for this process's rank (kind() == kMpi). Calls InitMpi()
// first. Collective: every process of the job calls it (MPI_Comm_dup, blocking). Each call makes
// an independent world (its own duplicated MPI communicators and abort state). The communicator
// and its Split results must be used by one thread at a time, like every Communicator; Work
// handles may be waited on from any thread.
absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiWorld(const MpiWorldOptions& options = {});

namespace mpi {
// OK for MPI_SUCCESS; else the failed expression, file:line, MPI_Error_string and the error class
// (InvalidArgument for argument classes, ResourceExhausted for MPI_ERR_NO_MEM, Unavailable for a
// failed process, Internal otherwise).
absl::Status ToStatus(int mpi_error, const char* expr, const char* file, int line);
}  // namespace mpi

}  // namespace pipewright

#endif  // PIPEWRIGHT_RUNTIME_COMM_MPI_H_
