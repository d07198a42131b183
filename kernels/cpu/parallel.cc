// The per-rank thread pool and ParallelFor's partition (parallel.h).
//
// Note [Pool epoch word]. Run publishes a job by storing one 32-bit word: a sequence number in
// the high 24 bits and the job's part count in the low 8 (hence the pool's size limit of
// kMaxThreads). A worker learns from that single load both that there is a new job and whether
// it is asked to help (its index < parts).
//
// Note [Claiming parts]. The parts are fixed by the job; who runs which is not. The caller runs
// part 0, then everyone claims the next unclaimed part from claim_, a 64-bit word holding the
// job's epoch word above the next part's index, by compare-and-swap. A worker that wakes late,
// or that another process's thread kept off its core, finds its part already taken by a thread
// that was free, so one slow thread does not stall the rank for long. A claim succeeds only
// while the word still names the worker's job, and the job's function and context are read only
// after a successful claim: Run cannot return (and write the next job) until every part it
// handed out is done, so they are still that job's. A worker that missed a job, even several,
// touches none of them.
#include "kernels/cpu/parallel.h"

#include <chrono>
#include <system_error>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pipewright::cpu {
namespace {

constexpr int kMaxThreads = 255;
constexpr uint32_t kPartsMask = 0xFF;
constexpr uint32_t kSequenceStep = 0x100;
// How long an idle thread polls before it sleeps (Note [Pool wake-up]).
constexpr auto kSpin = std::chrono::microseconds(50);

thread_local ThreadPool* current_pool = nullptr;
thread_local bool in_part = false;  // running a part of a parallel loop: nested loops go inline

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls `done` for up to kSpin; whether it became true.
template <typename Pred>
bool SpinUntil(Pred done) {
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t i = 1;; ++i) {
    if (done()) return true;
    CpuRelax();
    if ((i & 63) == 0 && std::chrono::steady_clock::now() - start > kSpin) return false;
  }
}

// Marks the calling thread as running a part, for nested ParallelFor.
class InPart {
 public:
  InPart() : previous_(in_part) { in_part = true; }
  ~InPart() { in_part = previous_; }

 private:
  bool previous_;
};

}  // namespace

ThreadPool::ThreadPool(int threads) {
  const int want = std::clamp(threads, 1, kMaxThreads);
  workers_.reserve(want - 1);
  for (int w = 1; w < want; ++w) {
    try {
      workers_.emplace_back([this, w] { WorkerLoop(w); });
    } catch (const std::system_error&) {
      break;  // the system will not start more threads: run with those it did
    }
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_relaxed);
  epoch_.store(epoch_.load(std::memory_order_relaxed) + kSequenceStep, std::memory_order_seq_cst);
  epoch_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Run(int parts, void (*fn)(void*, int), void* ctx) noexcept {
  parts = std::min(parts, size());
  if (parts <= 0) return;
  if (parts == 1) {
    InPart guard;
    fn(ctx, 0);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  const uint32_t word = ((epoch_.load(std::memory_order_relaxed) & ~kPartsMask) + kSequenceStep) |
                        static_cast<uint32_t>(parts);
  claim_.store(uint64_t{word} << 32 | 1, std::memory_order_relaxed);  // part 0 is the caller's
  epoch_.store(word, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) epoch_.notify_all();
  {
    InPart guard;
    fn(ctx, 0);
    done_.fetch_add(1, std::memory_order_acq_rel);
    RunClaimedParts(word);
  }
  const auto all_done = [&] { return done_.load(std::memory_order_acquire) == parts; };
  if (SpinUntil(all_done)) return;
  for (int done; (done = done_.load(std::memory_order_acquire)) != parts;) {
    done_.wait(done, std::memory_order_acquire);
  }
}

void ThreadPool::RunClaimedParts(uint32_t word) noexcept {
  const int parts = static_cast<int>(word & kPartsMask);
  uint64_t claim = claim_.load(std::memory_order_acquire);
  while ((claim >> 32) == word && static_cast<int>(claim & 0xFFFFFFFF) < parts) {
    if (!claim_.compare_exchange_weak(claim, claim + 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
      continue;  // `claim` now holds the current word
    }
    fn_(ctx_, static_cast<int>(claim & 0xFFFFFFFF));
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == parts) done_.notify_one();
    claim = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::WorkerLoop(int index) noexcept {
  uint32_t seen = 0;  // the epoch word when the pool started
  for (;;) {
    const bool woke = SpinUntil([&] { return epoch_.load(std::memory_order_acquire) != seen; });
    if (!woke) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      while (epoch_.load(std::memory_order_seq_cst) == seen) {
        epoch_.wait(seen, std::memory_order_seq_cst);
      }
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    seen = epoch_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_relaxed)) return;
    if (index >= static_cast<int>(seen & kPartsMask)) continue;  // not asked to help
    RunClaimedParts(seen);
  }
}

ThreadPool* CurrentPool() { return in_part ? nullptr : current_pool; }

int CurrentThreads() {
  const ThreadPool* pool = CurrentPool();
  return pool != nullptr ? pool->size() : 1;
}

ScopedCurrentPool::ScopedCurrentPool(ThreadPool* pool) : previous_(current_pool) {
  current_pool = pool;
}

ScopedCurrentPool::~ScopedCurrentPool() { current_pool = previous_; }

int ParallelParts(int64_t n, int64_t grain, int threads) {
  if (n <= 0) return 0;
  grain = std::max<int64_t>(grain, 1);
  const int64_t blocks = (n - 1) / grain + 1;
  return static_cast<int>(std::clamp<int64_t>(blocks, 1, std::max(threads, 1)));
}

std::pair<int64_t, int64_t> ParallelPartRange(int64_t n, int64_t grain, int parts, int part) {
  grain = std::max<int64_t>(grain, 1);
  const int64_t blocks = (n - 1) / grain + 1;
  const int64_t first = blocks * part / parts, last = blocks * (part + 1) / parts;
  return {std::min(n, first * grain), std::min(n, last * grain)};
}

}  // namespace pipewright::cpu
