// What the host offers this process, for the layers that size their own thread pools (the
// engine's threads per rank, the plan search's workers).
#ifndef PIPEWRIGHT_HOST_H_
#define PIPEWRIGHT_HOST_H_

#include <sched.h>

#include <algorithm>
#include <thread>

namespace pipewright {

// CPU cores this process may run on: its affinity (taskset, a cgroup's cpuset, a launcher's
// binding), else every core of the machine; at least 1.
inline int UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace pipewright

#endif  // PIPEWRIGHT_HOST_H_
