// The MPI backend's process-wide part (mpi_internal.h): mpi::ToStatus, launcher detection,
// InitMpi/FinalizeMpi, the progress engine (one pass over every open world, and the progress
// thread that runs it while no one waits), and closing groups and worlds.
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "pipewright/status.h"
#include "runtime/comm/mpi.h"
#include "runtime/comm/mpi_internal.h"

namespace pipewright {

namespace mpi {

absl::Status ToStatus(int mpi_error, const char* expr, const char* file, int line) {
  if (mpi_error == MPI_SUCCESS) return absl::OkStatus();
  char text[MPI_MAX_ERROR_STRING + 1] = {};
  int len = 0;
  if (MPI_Error_string(mpi_error, text, &len) != MPI_SUCCESS) {
    std::snprintf(text, sizeof(text), "unknown MPI error");
  }
  int error_class = mpi_error;
  if (MPI_Error_class(mpi_error, &error_class) != MPI_SUCCESS) error_class = MPI_ERR_UNKNOWN;
  const std::string msg = absl::StrCat(expr, " at ", file, ":", line, ": ", text, " (MPI error ",
                                       mpi_error, ", class ", error_class, ")");
  switch (error_class) {
    case MPI_ERR_BUFFER:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_TAG:
    case MPI_ERR_COMM:
    case MPI_ERR_RANK:
    case MPI_ERR_ROOT:
    case MPI_ERR_GROUP:
    case MPI_ERR_OP:
    case MPI_ERR_ARG:
    case MPI_ERR_TRUNCATE:
    case MPI_ERR_INFO:
      return absl::InvalidArgumentError(msg);
    case MPI_ERR_NO_MEM:
      return absl::ResourceExhaustedError(msg);
#ifdef MPIX_ERR_PROC_FAILED
    case MPIX_ERR_PROC_FAILED:
      return absl::UnavailableError(msg);
#endif
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace mpi

namespace mpi_internal {
namespace {

absl::Status ProgressGroup(Group& g, bool* progressed) {
  const bool live = !g.world->aborted;
  PW_RETURN_IF_ERROR(TestSends(g.sends, progressed));
  PW_RETURN_IF_ERROR(ProgressDirect(g, live, progressed));
  PW_RETURN_IF_ERROR(ProgressOverflow(g, live, progressed));
  PW_RETURN_IF_ERROR(ProgressColls(g, live, progressed));
  return absl::OkStatus();
}

// The progress thread: keeps MPI moving while no one waits (without a single-copy transport a
// large message's data moves only while both sides' MPI libraries run; abort notices are picked
// up). While requests are in flight it polls every 20 us, backing off to 200 us while nothing
// completes (a send whose receiver has not come costs a few percent of a core, a transfer while
// the application computes still moves); it backs off to 1 ms while operations wait for messages
// that have not come, polls every 10 ms when idle, and wakes early on new work.
void ProgressLoop(uint64_t generation) {
#ifdef __linux__
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);  // 1 us: short sleeps stay short
#endif
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  absl::Duration sleep = absl::Microseconds(20);
  while (p.progress_generation == generation) {
    const bool progressed = ProgressAllLocked();
    if (progressed) p.cv.SignalAll();
    switch (ActivityLocked()) {
      case Activity::kTransfer:
        // A send waiting for its receiver shows no progress; moving data shows some.
        sleep = progressed ? absl::Microseconds(20)
                           : std::clamp(sleep * 2, absl::Microseconds(20), absl::Microseconds(200));
        break;
      case Activity::kWaiting:
        sleep = std::clamp(sleep * 2, absl::Microseconds(50), absl::Milliseconds(1));
        break;
      case Activity::kIdle:
        sleep = absl::Milliseconds(10);
        break;
    }
    p.cv.WaitWithTimeout(&p.mu, sleep);
  }
}

// The caller joins the returned thread after releasing the mutex.
std::thread StopProgressThreadLocked() {
  ProcessState& p = Proc();
  if (!p.progress.joinable()) return std::thread();
  ++p.progress_generation;
  p.cv.SignalAll();
  return std::move(p.progress);
}

// Gives up on `req` (still active): MPI may still use `keep`, so it is kept forever.
void Abandon(MPI_Request* req, std::shared_ptr<void> keep) {
  if (*req != MPI_REQUEST_NULL) MPI_Request_free(req);
  if (keep) Proc().graveyard.push_back(std::move(keep));
}

void CloseWorldLocked(World& w, std::thread* join) {
  ProcessState& p = Proc();
  w.closed = true;
  const absl::Time deadline = absl::Now() + std::min(w.options.drain_timeout, absl::Seconds(1));
  bool progressed = false;
  while (!w.sends.empty() && TestSends(w.sends, &progressed).ok() && !w.sends.empty() &&
         absl::Now() < deadline) {
    p.cv.WaitWithTimeout(&p.mu, absl::Milliseconds(1));
  }
  for (SendReq& s : w.sends) Abandon(&s.req, s.buf);
  w.sends.clear();
  if (w.control != MPI_COMM_NULL) MPI_Comm_free(&w.control);
  p.worlds.erase(std::remove_if(p.worlds.begin(), p.worlds.end(),
                                [&](const std::shared_ptr<World>& x) { return x.get() == &w; }),
                 p.worlds.end());
  if (p.worlds.empty()) *join = StopProgressThreadLocked();
}

const char* ThreadLevelName(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

// Note [Leaving after a failure]
// MPI_Finalize waits for every process of the job: Open MPI's ends in a fence that completes only
// when all of them have entered it. After a failure some may never come. A stopped (SIGSTOP) or
// hung process is not dead, so the launcher sees nothing wrong, and the ranks that had reported the
// failure waited in MPI_Finalize forever (observed: three ranks and mpirun still alive ten minutes
// after one rank of four was stopped). So FinalizeMpi first takes a roll call: every process sends
// every other one a zero-byte message on MPI_COMM_WORLD (tag kRollCallTag; the backend's traffic
// is on duplicated communicators, so nothing else can match it) and receives theirs, all
// non-blocking. Only when every process has answered is MPI_Finalize entered, and then it cannot
// block for long. A process that failed (a world aborted, or NoteMpiFailure) waits at most
// kMpiExitGrace, then names the processes that did not answer and calls MPI_Abort with its exit
// code: the launcher ends the whole job, the silent process included. A process that did not fail
// waits without bound, as MPI_Finalize would have: the others may still be writing outputs, and
// if one of them has failed, that one ends the job. When every process fails together (an abort
// notice reaches all of them, a wrong -np) they all answer within the grace and exit normally,
// each with its own code.
constexpr int kRollCallTag = 32767;  // every MPI allows tags up to at least 32767 (MPI_TAG_UB)

// The roll call over MPI_COMM_WORLD; returns the ranks that had not answered, or not taken this
// process's message, by `deadline` (or whose requests failed). Releases the mutex while waiting.
std::vector<int> RollCallLocked(absl::Time deadline) {
  ProcessState& p = Proc();
  int rank = 0, size = 1;
  if (MPI_Comm_rank(MPI_COMM_WORLD, &rank) != MPI_SUCCESS ||
      MPI_Comm_size(MPI_COMM_WORLD, &size) != MPI_SUCCESS) {
    return {-1};
  }
  std::vector<MPI_Request> recvs(size, MPI_REQUEST_NULL), sends(size, MPI_REQUEST_NULL);
  std::vector<char> broken(size, 0);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    broken[r] |=
        MPI_Irecv(nullptr, 0, MPI_BYTE, r, kRollCallTag, MPI_COMM_WORLD, &recvs[r]) != MPI_SUCCESS;
    broken[r] |=
        MPI_Isend(nullptr, 0, MPI_BYTE, r, kRollCallTag, MPI_COMM_WORLD, &sends[r]) != MPI_SUCCESS;
  }
  auto test = [&](int r, MPI_Request* req) {
    int flag = 0;
    if (*req == MPI_REQUEST_NULL || broken[r]) return false;
    if (MPI_Test(req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) broken[r] = 1;
    return *req != MPI_REQUEST_NULL && !broken[r];
  };
  while (true) {
    bool left = false;
    for (int r = 0; r < size; ++r) {
      left |= test(r, &recvs[r]);
      left |= test(r, &sends[r]);
    }
    if (!left || absl::Now() >= deadline) break;
    p.cv.WaitWithTimeout(&p.mu, absl::Milliseconds(1));
  }
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    if (broken[r] || recvs[r] != MPI_REQUEST_NULL || sends[r] != MPI_REQUEST_NULL) {
      missing.push_back(r);
    }
  }
  return missing;
}

bool EnvSet(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0';
}

}  // namespace

ProcessState& Proc() {
  static ProcessState* state = new ProcessState;  // never destroyed: usable at exit
  return *state;
}

absl::Status SetErrorsReturn(MPI_Comm comm) {
  return PW_MPI_STATUS(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
}

bool ProgressAllLocked() {
  ProcessState& p = Proc();
  bool progressed = false;
  const std::vector<std::shared_ptr<World>> worlds = p.worlds;
  for (const std::shared_ptr<World>& w : worlds) {
    if (w->closed) continue;
    absl::Status s = TestSends(w->sends, &progressed);
    if (s.ok()) s = ProbeAbortNotices(*w, &progressed);
    if (!s.ok()) AbortLocked(*w, s, /*notify=*/true);
    const std::vector<std::shared_ptr<Group>> groups = w->groups;
    for (const std::shared_ptr<Group>& g : groups) {
      if (g->closed) continue;
      s = ProgressGroup(*g, &progressed);
      if (!s.ok()) {
        AbortLocked(*w, s, /*notify=*/true);
        progressed = true;
      }
    }
  }
  return progressed;
}

Activity ActivityLocked() {
  Activity a = Activity::kIdle;
  for (const std::shared_ptr<World>& w : Proc().worlds) {
    if (w->closed) continue;
    if (!w->sends.empty()) return Activity::kTransfer;
    for (const std::shared_ptr<Group>& g : w->groups) {
      if (g->closed) continue;
      if (!g->sends.empty() || !g->direct_inflight.empty() || !g->overflow_inflight.empty()) {
        return Activity::kTransfer;
      }
      for (const auto& [key, q] : g->direct_pending) {
        if (!q.empty() && q.front()->req != MPI_REQUEST_NULL) return Activity::kTransfer;
      }
      for (const std::shared_ptr<Coll>& c : g->colls) {
        for (MPI_Request r : c->reqs) {
          if (r != MPI_REQUEST_NULL) return Activity::kTransfer;
        }
      }
      if (!g->direct_pending.empty() || !g->overflow_pending.empty() || !g->colls.empty()) {
        a = Activity::kWaiting;
      }
    }
  }
  return a;
}

void StartProgressThreadLocked() {
  ProcessState& p = Proc();
  if (p.progress.joinable()) return;
  p.progress = std::thread(ProgressLoop, ++p.progress_generation);
}

void CloseGroupLocked(const std::shared_ptr<Group>& gp, absl::StatusCode code,
                      absl::string_view reason, std::thread* join) {
  Group& g = *gp;
  if (g.closed) return;
  ProcessState& p = Proc();
  g.closed = true;
  g.closed_status = absl::Status(code, absl::StrCat(g.label, ": ", reason));
  auto fail = [&](Op& op) {
    Complete(op, absl::Status(code, absl::StrCat(op.label, ": ", op.description, ": ", reason)));
  };
  ParkActiveReceives(g);
  for (auto* queues : {&g.direct_pending, &g.overflow_pending}) {
    for (auto& [key, q] : *queues) {
      for (auto& r : q) fail(*r->op);
    }
    queues->clear();
  }
  g.overflow_unexpected.clear();
  for (auto& r : g.direct_inflight) {
    fail(*r->op);
    MPI_Cancel(&r->req);
  }
  for (auto& [peer, fifo] : g.overflow_inflight) {
    for (StagedRecv& s : fifo) MPI_Cancel(&s.req);
  }
  for (auto& c : g.colls) {
    fail(*c->op);
    for (MPI_Request& r : c->reqs) {
      if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
    }
  }
  p.cv.SignalAll();

  // Drain: every request either completes (sends delivered, cancelled receives) or is abandoned.
  const absl::Time deadline =
      absl::Now() + (g.world->aborted ? absl::ZeroDuration() : g.world->options.drain_timeout);
  while (true) {
    bool progressed = false, error = false;
    error |= !TestSends(g.sends, &progressed).ok();
    auto test = [&](MPI_Request* r) {
      int flag = 0;
      if (*r != MPI_REQUEST_NULL && MPI_Test(r, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        error = true;
      }
    };
    bool left = !g.sends.empty();
    for (auto& r : g.direct_inflight) {
      test(&r->req);
      left |= r->req != MPI_REQUEST_NULL;
    }
    for (auto& [peer, fifo] : g.overflow_inflight) {
      for (StagedRecv& s : fifo) {
        test(&s.req);
        left |= s.req != MPI_REQUEST_NULL;
      }
    }
    for (auto& c : g.colls) {
      for (MPI_Request& r : c->reqs) {
        test(&r);
        left |= r != MPI_REQUEST_NULL;
      }
    }
    if (!left || error || absl::Now() >= deadline) break;
    p.cv.WaitWithTimeout(&p.mu, absl::Milliseconds(1));
  }
  for (SendReq& s : g.sends) Abandon(&s.req, s.buf);
  for (auto& r : g.direct_inflight) Abandon(&r->req, r);
  for (auto& [peer, fifo] : g.overflow_inflight) {
    for (StagedRecv& s : fifo) Abandon(&s.req, s.buf);
  }
  for (auto& c : g.colls) {
    for (size_t i = 0; i < c->reqs.size(); ++i) Abandon(&c->reqs[i], c->bufs[i]);
    c->tensor = Tensor();
  }
  g.sends.clear();
  g.direct_inflight.clear();
  g.overflow_inflight.clear();
  g.colls.clear();

  // A Split that gave up may still have MPI_Comm_idup in flight on these communicators: freeing
  // them then is erroneous, so they are kept (a leak, after a failure only).
  bool idup_pending = false;
  for (MPI_Request& r : g.pending_idups) {
    int flag = 0;
    if (r != MPI_REQUEST_NULL && MPI_Test(&r, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
      continue;
    }
    idup_pending = true;
  }
  if (!idup_pending) {
    if (g.p2p != MPI_COMM_NULL) MPI_Comm_free(&g.p2p);
    if (g.coll != MPI_COMM_NULL) MPI_Comm_free(&g.coll);
  }

  World& w = *g.world;
  w.groups.erase(std::remove(w.groups.begin(), w.groups.end(), gp), w.groups.end());
  if (w.groups.empty() && !w.closed) CloseWorldLocked(w, join);
  p.cv.SignalAll();
}

}  // namespace mpi_internal

using mpi_internal::CloseGroupLocked;
using mpi_internal::EnvSet;
using mpi_internal::Group;
using mpi_internal::Proc;
using mpi_internal::ProcessState;
using mpi_internal::RollCallLocked;
using mpi_internal::SetErrorsReturn;
using mpi_internal::StopProgressThreadLocked;
using mpi_internal::ThreadLevelName;
using mpi_internal::World;

bool LaunchedByMpi() {
  if (const char* v = std::getenv("PIPEWRIGHT_MPI"); v != nullptr && v[0] != '\0') {
    std::string s(v);
    for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (s == "0" || s == "off" || s == "false" || s == "no") return false;
    if (s == "1" || s == "on" || s == "true" || s == "yes") return true;
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) return true;
  for (const char* name :
       {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}) {
    if (EnvSet(name)) return true;
  }
  return false;
}

absl::StatusOr<MpiProcess> InitMpi() {
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  if (p.have_info) return p.info;
  if (!p.init_error.ok()) return p.init_error;
  int initialized = 0, finalized = 0;
  PW_MPI_RETURN_IF_ERROR(MPI_Initialized(&initialized));
  PW_MPI_RETURN_IF_ERROR(MPI_Finalized(&finalized));
  if (finalized || p.finalized) {
    return absl::FailedPreconditionError(
        "InitMpi: MPI was finalized; it cannot be initialized again");
  }
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    if (!LaunchedByMpi()) {
      return absl::FailedPreconditionError(
          "InitMpi: this process was not started by an MPI launcher (none of "
          "OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK, PMI_SIZE, MV2_COMM_WORLD_SIZE is set); run "
          "it under mpirun/mpiexec or srun --mpi=pmix, or set PIPEWRIGHT_MPI=1 to start a "
          "single-process MPI world");
    }
    PW_MPI_RETURN_IF_ERROR(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    p.we_initialized = true;
    std::atexit([] { FinalizeMpi(); });
    PW_RETURN_IF_ERROR(SetErrorsReturn(MPI_COMM_WORLD));
  } else {
    PW_MPI_RETURN_IF_ERROR(MPI_Query_thread(&provided));
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    p.init_error = absl::FailedPreconditionError(absl::StrCat(
        "InitMpi: MPI provides only ", ThreadLevelName(provided),
        "; the mpi backend calls MPI from the thread that waits on an operation and from its "
        "progress thread (one at a time, under a lock), which needs at least "
        "MPI_THREAD_SERIALIZED (MPI_THREAD_MULTIPLE was requested)"));
    return p.init_error;
  }
  MpiProcess info;
  info.thread_multiple = provided >= MPI_THREAD_MULTIPLE;
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_rank(MPI_COMM_WORLD, &info.rank));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_size(MPI_COMM_WORLD, &info.size));
  MPI_Comm node = MPI_COMM_NULL;
  PW_MPI_RETURN_IF_ERROR(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, info.rank, MPI_INFO_NULL, &node));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_rank(node, &info.local_rank));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_size(node, &info.local_size));
  PW_MPI_RETURN_IF_ERROR(MPI_Comm_free(&node));
  char name[MPI_MAX_PROCESSOR_NAME + 1] = {};
  int len = 0;
  PW_MPI_RETURN_IF_ERROR(MPI_Get_processor_name(name, &len));
  info.hostname.assign(name, static_cast<size_t>(std::max(len, 0)));
  p.info = info;
  p.have_info = true;
  return info;
}

void FinalizeMpi() {
  ProcessState& p = Proc();
  std::thread join;
  {
    absl::MutexLock lock(&p.mu);
    const std::vector<std::shared_ptr<World>> worlds = p.worlds;
    for (const std::shared_ptr<World>& w : worlds) {
      const std::vector<std::shared_ptr<Group>> groups = w->groups;
      for (const std::shared_ptr<Group>& g : groups) {
        std::thread t;
        CloseGroupLocked(g, absl::StatusCode::kFailedPrecondition,
                         "MPI was finalized (FinalizeMpi)", &t);
        if (t.joinable()) join = std::move(t);
      }
    }
    if (std::thread t = StopProgressThreadLocked(); t.joinable()) join = std::move(t);
  }
  if (join.joinable()) join.join();
  absl::MutexLock lock(&p.mu);
  if (p.we_initialized && !p.finalized) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      // Note [Leaving after a failure].
      const int code = p.failure_exit_code;
      const std::vector<int> missing =
          RollCallLocked(code != 0 ? absl::Now() + kMpiExitGrace : absl::InfiniteFuture());
      if (!missing.empty()) {
        int rank = -1;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        const std::string who =
            absl::StrCat(missing.size() == 1 ? "rank " : "ranks ", absl::StrJoin(missing, ", "));
        const std::string what =
            code != 0 ? absl::StrCat(who, " did not reach the end of the run within ",
                                     absl::FormatDuration(kMpiExitGrace),
                                     " after this process failed (stopped, hung or still busy)")
                      : absl::StrCat("the exit roll call with ", who, " failed in MPI");
        std::fprintf(stderr,
                     "pipewright: rank %d: %s; calling MPI_Abort so that the launcher ends the "
                     "job\n",
                     rank, what.c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, code != 0 ? code : 1);
        _exit(code != 0 ? code : 1);  // MPI_Abort does not return; in case it does
      }
      MPI_Finalize();
    }
    p.finalized = true;
    p.have_info = false;
  }
}

void NoteMpiFailure(int exit_code) {
  ProcessState& p = Proc();
  absl::MutexLock lock(&p.mu);
  if (exit_code != 0) {
    p.failure_exit_code = exit_code;
  } else if (p.failure_exit_code == 0) {
    p.failure_exit_code = 1;
  }
}

}  // namespace pipewright
