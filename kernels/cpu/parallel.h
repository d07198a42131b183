// Threads for the CPU kernels of one rank (internal).
//
// Each rank owns a ThreadPool: the rank's own thread plus `size() - 1` workers. The engine makes
// a rank's pool current on the thread that runs the rank (ScopedCurrentPool), and the kernels
// split their loops over it with ParallelFor. Ranks in one process never share workers, so a
// rank's kernels cannot wait on another rank's.
//
//   // y[i] = f(x[i]) over the current pool (inline when there is none)
//   ParallelFor(n, /*grain=*/4096, [&](int64_t begin, int64_t end) {
//     for (int64_t i = begin; i < end; ++i) y[i] = f(x[i]);
//   });
//
// Note [ParallelFor partition]. The range [0, n) is cut into blocks of `grain` indices (the last
// one shorter) and the parts are contiguous runs of whole blocks, as even as possible: part p of
// P = min(threads, blocks) covers blocks [blocks * p / P, blocks * (p + 1) / P). The cut depends
// only on (n, grain, threads), never on timing; every part boundary is a multiple of `grain`, so
// a grain that is a multiple of the vector width keeps each part's vector loop aligned with the
// whole loop's. Kernels that write disjoint outputs per index therefore compute the same bits
// with any number of threads; a reduction across parts would not, so ParallelFor offers none.
//
// Note [Pool wake-up]. A call publishes its job by bumping an epoch counter. Idle workers spin on
// it for 50 us (kernels come back to back in a layer's forward and backward, and a futex wake
// costs several microseconds), then sleep on it (std::atomic::wait, a futex on Linux); the caller
// wakes sleepers only when some are asleep. The caller runs part 0 itself, takes any part no
// worker has claimed yet, then waits for the rest the same way. A call allocates nothing. Jobs
// are noexcept loops: a throwing job terminates the process.
#ifndef PIPEWRIGHT_KERNELS_CPU_PARALLEL_H_
#define PIPEWRIGHT_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

namespace pipewright::cpu {

class ThreadPool {
 public:
  // The thread that calls Run plus threads - 1 workers, started here and idle until Run;
  // `threads` is clamped to [1, 255]. Fewer when the system refuses to start more threads.
  explicit ThreadPool(int threads);
  // Stops and joins the workers. Must not run concurrently with Run.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(ctx, part) once for every part in [0, parts), parts <= size(), and returns when
  // every part is done. The calling thread runs part 0; workers 1 .. parts - 1 are woken for
  // the others, and whoever is free first claims the next part (Note [Claiming parts] in
  // parallel.cc). One caller at a time (the rank's thread); fn must not throw. While it runs,
  // ParallelFor on the calling thread (a nested loop) runs inline.
  void Run(int parts, void (*fn)(void* ctx, int part), void* ctx) noexcept;

 private:
  void WorkerLoop(int index) noexcept;
  // Claims and runs parts of the job published as epoch word `word` until none is left.
  void RunClaimedParts(uint32_t word) noexcept;

  // The job: written by Run before it publishes the epoch word, read only by the workers that
  // take part (Note [Pool epoch word] in parallel.cc).
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> epoch_{0};  // sequence << 8 | parts of the latest job
  std::atomic<uint64_t> claim_{0};  // epoch word << 32 | next part to claim
  std::atomic<int> done_{0};        // parts of the current job finished
  std::atomic<int> sleepers_{0};    // workers blocked (or about to block) on epoch_
  std::vector<std::thread> workers_;
};

// The calling thread's pool for ParallelFor: the one a ScopedCurrentPool set, or nullptr (none,
// or inside a part of a parallel loop, where nested loops run inline).
ThreadPool* CurrentPool();
// Threads ParallelFor would use on this thread: CurrentPool()->size(), or 1.
int CurrentThreads();

// Makes `pool` (may be null) the calling thread's pool until destruction, then restores the
// previous one.
class ScopedCurrentPool {
 public:
  explicit ScopedCurrentPool(ThreadPool* pool);
  ~ScopedCurrentPool();
  ScopedCurrentPool(const ScopedCurrentPool&) = delete;
  ScopedCurrentPool& operator=(const ScopedCurrentPool&) = delete;

 private:
  ThreadPool* previous_;
};

// Parts that ParallelFor(n, grain, ...) uses with `threads` threads (Note [ParallelFor
// partition]): min(threads, ceil(n / grain)), 0 when n <= 0.
int ParallelParts(int64_t n, int64_t grain, int threads);
// Index range [first, second) of part `part` of `parts` of [0, n) in blocks of `grain`.
std::pair<int64_t, int64_t> ParallelPartRange(int64_t n, int64_t grain, int parts, int part);

// fn(part, begin, end) for each part of [0, n) (Note [ParallelFor partition]) on the current
// pool; inline (fn(0, 0, n)) when it has one thread or n <= grain. Parts run concurrently: fn
// must only write what its range owns, and must not throw.
template <typename Fn>
void ParallelForParts(int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  ThreadPool* pool = CurrentPool();
  const int parts = ParallelParts(n, grain, pool != nullptr ? pool->size() : 1);
  if (parts <= 1) {
    fn(0, int64_t{0}, n);
    return;
  }
  struct Job {
    Fn* fn;
    int64_t n, grain;
    int parts;
  } job{&fn, n, grain, parts};
  pool->Run(
      parts,
      [](void* ctx, int part) {
        const Job& j = *static_cast<const Job*>(ctx);
        const auto [begin, end] = ParallelPartRange(j.n, j.grain, j.parts, part);
        (*j.fn)(part, begin, end);
      },
      &job);
}

// fn(begin, end) for each part of [0, n); see ParallelForParts.
template <typename Fn>
void ParallelFor(int64_t n, int64_t grain, Fn&& fn) {
  ParallelForParts(n, grain, [&fn](int, int64_t begin, int64_t end) { fn(begin, end); });
}

}  // namespace pipewright::cpu

#endif  // PIPEWRIGHT_KERNELS_CPU_PARALLEL_H_
