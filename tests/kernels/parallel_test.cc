// Tests for the per-rank thread pool and ParallelFor (kernels/cpu/parallel.h), for cpu::Gemm's
// split over the pool, and for the CPU ops' promise that their results do not depend on the
// thread count (Note [CPU ops on the rank's threads] in runtime/ops/ops.cc).
#include "kernels/cpu/parallel.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "pipewright/ops.h"
#include "tests/kernels/kernel_test_util.h"

namespace pipewright::cpu {
namespace {

using kernel_test::RandomVec;

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ParallelPartition, PartsAreContiguousBalancedAndGrainAligned) {
  for (int64_t n : {1, 2, 3, 7, 16, 17, 63, 64, 65, 100, 1000, 4097, 100003}) {
    for (int64_t grain : {1, 2, 3, 16, 64, 1000}) {
      for (int threads : {1, 2, 3, 4, 5, 8, 255}) {
        const int parts = ParallelParts(n, grain, threads);
        const int64_t blocks = (n + grain - 1) / grain;
        ASSERT_EQ(parts, std::min<int64_t>(threads, blocks)) << n << " " << grain << " " << threads;
        int64_t next = 0, smallest = n, largest = 0;
        for (int p = 0; p < parts; ++p) {
          const auto [begin, end] = ParallelPartRange(n, grain, parts, p);
          ASSERT_EQ(begin, next) << "part " << p << " of " << parts << ", n " << n;
          ASSERT_LT(begin, end);
          ASSERT_EQ(begin % grain, 0);
          next = end;
          if (end < n) {  // whole blocks except the last part's tail
            smallest = std::min(smallest, end - begin);
            largest = std::max(largest, end - begin);
          }
        }
        ASSERT_EQ(next, n);
        if (largest > 0) {
          EXPECT_LE(largest - smallest, grain) << n << " " << grain;
        }
      }
    }
  }
  EXPECT_EQ(ParallelParts(0, 16, 4), 0);
  EXPECT_EQ(ParallelParts(-3, 16, 4), 0);
}

// Every index exactly once, by the part ParallelParts promised, on pools of many sizes.
TEST(ParallelFor, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 4, 7}) {
    ThreadPool pool(threads);
    ScopedCurrentPool current(&pool);
    ASSERT_EQ(CurrentThreads(), threads);
    for (int64_t n : {0, 1, 5, 63, 64, 65, 1000, 4099}) {
      for (int64_t grain : {1, 3, 16, 64, 5000}) {
        std::vector<std::atomic<int>> hits(n);
        std::vector<std::atomic<int>> part_of(n);
        std::atomic<int> calls{0};
        ParallelForParts(n, grain, [&](int part, int64_t begin, int64_t end) {
          calls.fetch_add(1);
          for (int64_t i = begin; i < end; ++i) {
            hits[i].fetch_add(1);
            part_of[i].store(part);
          }
        });
        const int parts = ParallelParts(n, grain, threads);
        ASSERT_EQ(calls.load(), parts) << "n " << n << " grain " << grain << " threads " << threads;
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(hits[i].load(), 1) << "index " << i << " n " << n << " grain " << grain;
        }
        for (int p = 0; p < parts; ++p) {
          const auto [begin, end] = ParallelPartRange(n, grain, parts, p);
          for (int64_t i = begin; i < end; ++i) ASSERT_EQ(part_of[i].load(), p);
        }
      }
    }
  }
}

// Part 0 is the caller's; while it is busy, the workers take the others.
TEST(ParallelFor, CallerRunsPartZeroAndWorkersTheRest) {
  ThreadPool pool(4);
  ScopedCurrentPool current(&pool);
  std::mutex mu;
  std::vector<std::thread::id> by_part(4);
  ParallelForParts(4, 1, [&](int part, int64_t, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard<std::mutex> lock(mu);
    by_part[part] = std::this_thread::get_id();
  });
  EXPECT_EQ(by_part[0], std::this_thread::get_id());
  const std::set<std::thread::id> distinct(by_part.begin(), by_part.end());
  EXPECT_EQ(distinct.size(), 4u);
}

TEST(ParallelFor, InlineWithoutAPoolOrWhenSmall) {
  auto one_call = [](int64_t n, int64_t grain) {
    std::vector<std::pair<int64_t, int64_t>> calls;
    std::thread::id where;
    ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
      calls.emplace_back(begin, end);  // unsynchronised: fine only when inline
      where = std::this_thread::get_id();
    });
    return calls.size() == 1 && calls[0] == std::make_pair(int64_t{0}, n) &&
           where == std::this_thread::get_id();
  };
  EXPECT_EQ(CurrentPool(), nullptr);
  EXPECT_EQ(CurrentThreads(), 1);
  EXPECT_TRUE(one_call(1000, 1));  // no pool
  ThreadPool single(1);
  {
    ScopedCurrentPool current(&single);
    EXPECT_TRUE(one_call(1000, 1));  // a pool of one thread
  }
  ThreadPool pool(3);
  ScopedCurrentPool current(&pool);
  EXPECT_TRUE(one_call(100, 100));  // one grain of work
  EXPECT_TRUE(one_call(1, 1));
}

TEST(ParallelFor, NestedLoopsRunInline) {
  ThreadPool pool(3);
  ScopedCurrentPool current(&pool);
  std::vector<std::atomic<int>> hits(3 * 50);
  ParallelForParts(3, 1, [&](int, int64_t begin, int64_t end) {
    for (int64_t outer = begin; outer < end; ++outer) {
      EXPECT_EQ(CurrentThreads(), 1);  // inside a part: no pool to nest on
      ParallelFor(50, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[outer * 50 + i].fetch_add(1);
      });
    }
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  EXPECT_EQ(CurrentThreads(), 3);  // restored after the loop
}

TEST(ParallelFor, ScopedPoolsNestAndRestore) {
  ThreadPool a(2), b(3);
  {
    ScopedCurrentPool outer(&a);
    EXPECT_EQ(CurrentPool(), &a);
    {
      ScopedCurrentPool inner(&b);
      EXPECT_EQ(CurrentPool(), &b);
      ScopedCurrentPool none(nullptr);
      EXPECT_EQ(CurrentThreads(), 1);
    }
    EXPECT_EQ(CurrentPool(), &a);
  }
  EXPECT_EQ(CurrentPool(), nullptr);
}

// Back-to-back calls (workers spinning) and calls after idle gaps (workers asleep) alike.
TEST(ParallelFor, ManyCallsWithAndWithoutIdleGaps) {
  ThreadPool pool(3);
  ScopedCurrentPool current(&pool);
  std::vector<int64_t> v(3000);
  for (int round = 0; round < 4; ++round) {
    for (int call = 0; call < 1000; ++call) {
      ParallelFor(static_cast<int64_t>(v.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) v[i] += i;
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past the spin: workers sleep
    for (int k = 0; k < 3; ++k) {
      ParallelFor(static_cast<int64_t>(v.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) v[i] += i;
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], int64_t{4 * 1003} * int64_t(i)) << i;
}

// Two ranks in one process: each thread its own pool, used at the same time; no worker serves
// both.
TEST(ParallelFor, PoolsOfDifferentThreadsDoNotShareWorkers) {
  ThreadPool pools[2] = {ThreadPool(3), ThreadPool(3)};
  std::set<std::thread::id> workers[2];
  std::vector<int64_t> sums[2];
  std::thread ranks[2];
  std::thread::id rank_ids[2];
  for (int r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      ScopedCurrentPool current(&pools[r]);
      rank_ids[r] = std::this_thread::get_id();
      std::mutex mu;
      std::vector<int64_t> v(999, r + 1);
      for (int call = 0; call < 500; ++call) {
        ParallelFor(999, 1, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) v[i] += r + 1;
          std::lock_guard<std::mutex> lock(mu);
          workers[r].insert(std::this_thread::get_id());
        });
      }
      sums[r] = v;
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_LE(workers[r].size(), 3u);  // the rank's thread and its own two workers at most
    EXPECT_EQ(workers[r].count(rank_ids[r]), 1u);  // part 0 is always the rank's own
    for (int64_t x : sums[r]) ASSERT_EQ(x, int64_t{501} * (r + 1));
  }
  for (const std::thread::id& id : workers[0]) EXPECT_EQ(workers[1].count(id), 0u);
}

struct GemmCase {
  bool ta, tb;
  int m, n, k;
  float alpha, beta;
  int pad;  // extra elements per stored row (strided operands)
};

// The product is cut by its shape only (Note [GEMM split] in gemm.cc): every thread count gives
// the bits of the single-threaded call, and the cut's offsets are right for every transpose.
TEST(ParallelGemm, SameBitsForEveryThreadCount) {
  const std::vector<GemmCase> cases = {
      {false, true, 1024, 768, 256, 1.0f, 0.0f, 0},    // gpt-small: qkv forward
      {false, false, 1024, 256, 1024, 1.0f, 0.0f, 0},  // MLP down, input gradient
      {true, false, 256, 1024, 1024, 1.0f, 1.0f, 0},   // weight gradient, accumulated
      {false, false, 2048, 64, 128, 0.5f, 0.25f, 3},   // row blocks, strided
      {true, true, 1500, 80, 100, 1.0f, 1.0f, 5},      // row blocks of a transposed A
      {false, true, 64, 2048, 128, 1.0f, 0.0f, 7},     // column blocks
      {true, true, 80, 1500, 100, 2.0f, -1.0f, 1},     // column blocks of a transposed B
      {false, false, 128, 128, 32, 1.0f, 0.0f, 0},     // small: one call
  };
  for (const GemmCase& g : cases) {
    const int a_rows = g.ta ? g.k : g.m, a_cols = g.ta ? g.m : g.k;
    const int b_rows = g.tb ? g.n : g.k, b_cols = g.tb ? g.k : g.n;
    const int lda = a_cols + g.pad, ldb = b_cols + g.pad, ldc = g.n + g.pad;
    const std::vector<float> a = RandomVec(static_cast<size_t>(a_rows) * lda, 1);
    const std::vector<float> b = RandomVec(static_cast<size_t>(b_rows) * ldb, 2);
    const std::vector<float> c0 = RandomVec(static_cast<size_t>(g.m) * ldc, 3);
    std::vector<float> alone = c0;
    Gemm(g.ta, g.tb, g.m, g.n, g.k, g.alpha, a.data(), lda, b.data(), ldb, g.beta, alone.data(),
         ldc);
    const std::string what = ::testing::PrintToString(std::vector<int>{g.ta, g.tb, g.m, g.n, g.k});
    // The blocks compute the whole product: one cblas_sgemm call, to rounding (the cut moves
    // elements between OpenBLAS's internal blocks, which may change their last bits).
    std::vector<float> whole = c0;
    cblas_sgemm(CblasRowMajor, g.ta ? CblasTrans : CblasNoTrans, g.tb ? CblasTrans : CblasNoTrans,
                g.m, g.n, g.k, g.alpha, a.data(), lda, b.data(), ldb, g.beta, whole.data(), ldc);
    for (size_t i = 0; i < whole.size(); ++i) {
      ASSERT_NEAR(alone[i], whole[i], 1e-4f * (1 + std::abs(whole[i]))) << what << " at " << i;
    }
    for (int threads : {2, 3, 4, 8}) {
      ThreadPool pool(threads);
      ScopedCurrentPool current(&pool);
      std::vector<float> c = c0;
      Gemm(g.ta, g.tb, g.m, g.n, g.k, g.alpha, a.data(), lda, b.data(), ldb, g.beta, c.data(), ldc);
      EXPECT_TRUE(SameBits(c, alone)) << what << " with " << threads << " threads";
    }
  }
}

// The 16-bit GEMM splits C however the threads divide it (its bits do not depend on the part of
// C one call computes); the widening path runs Gemm's fixed blocks. Either way: the same bits.
TEST(ParallelGemm, HalfSameBitsForEveryThreadCount) {
  struct Case {
    bool ta, tb;
    int m, n, k;
    float beta;
  };
  const std::vector<Case> cases = {
      {false, true, 1024, 768, 256, 0.0f},   // qkv forward
      {true, false, 256, 1024, 1024, 1.0f},  // weight gradient, accumulated
      {false, false, 96, 1500, 100, 0.5f},   // column blocks
      {false, false, 301, 77, 203, 0.0f},    // odd edges
  };
  for (bool bf16 : {true, false}) {
    for (const Case& g : cases) {
      const int a_rows = g.ta ? g.k : g.m, a_cols = g.ta ? g.m : g.k;
      const int b_rows = g.tb ? g.n : g.k, b_cols = g.tb ? g.k : g.n;
      const std::vector<uint16_t> a =
          kernel_test::To16Bits(bf16, RandomVec(static_cast<size_t>(a_rows) * a_cols, 1));
      const std::vector<uint16_t> b =
          kernel_test::To16Bits(bf16, RandomVec(static_cast<size_t>(b_rows) * b_cols, 2));
      const std::vector<float> c0 = RandomVec(static_cast<size_t>(g.m) * g.n, 3);
      std::vector<float> alone = c0;
      GemmHalf(bf16, g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.data(), a_cols, b.data(), b_cols, g.beta,
               alone.data(), g.n);
      for (int threads : {2, 3, 4}) {
        ThreadPool pool(threads);
        ScopedCurrentPool current(&pool);
        std::vector<float> c = c0;
        GemmHalf(bf16, g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.data(), a_cols, b.data(), b_cols, g.beta,
                 c.data(), g.n);
        EXPECT_TRUE(SameBits(c, alone)) << (bf16 ? "bf16 " : "f16 ") << g.m << "x" << g.n << "x"
                                        << g.k << " with " << threads << " threads";
      }
    }
  }
}

// ---- the ops' CPU branch (runtime/ops/ops.cc) on 1 .. 4 threads ----

Tensor Random(std::vector<int64_t> shape, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return Tensor::FromVector(std::move(shape), RandomVec(static_cast<size_t>(n), seed, lo, hi));
}

// Runs `op` (which returns every output as floats) with no pool and with pools of 2, 3 and 4
// threads, and expects the same bits each time.
void ExpectThreadCountIndependent(const char* name, const std::function<std::vector<float>()>& op) {
  const std::vector<float> alone = op();
  ASSERT_FALSE(alone.empty()) << name;
  for (int threads : {2, 3, 4}) {
    ThreadPool pool(threads);
    ScopedCurrentPool current(&pool);
    EXPECT_TRUE(SameBits(op(), alone)) << name << " with " << threads << " threads";
  }
}

std::vector<float> Cat(std::initializer_list<const Tensor*> ts) {
  std::vector<float> out;
  for (const Tensor* t : ts) {
    std::vector<float> v = t->ToVector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

TEST(ParallelOps, ResultsDoNotDependOnTheThreadCount) {
  const ops::Exec e;
  constexpr int64_t kRows = 301, kCols = 203;  // odd sizes: parts end mid-vector
  const Tensor x = Random({kRows, kCols}, 11, -3.0f, 3.0f);
  const Tensor dy = Random({kRows, kCols}, 12);
  const Tensor bias = Random({kCols}, 13);
  const Tensor gamma = Random({kCols}, 14, 0.5f, 1.5f);
  ExpectThreadCountIndependent("elementwise", [&] {
    Tensor y = x.Clone();
    EXPECT_TRUE(ops::BiasAdd(e, y, bias, kRows, kCols).ok());
    EXPECT_TRUE(ops::AddInPlace(e, y, dy).ok());
    EXPECT_TRUE(ops::Scale(e, y, 0.75f).ok());
    Tensor sum = *ops::Add(e, y, x);
    Tensor g = *ops::GeluForward(e, sum);
    Tensor dg = *ops::GeluBackward(e, sum, dy);
    Tensor half = *ops::Cast(e, g, DType::kBF16);
    Tensor back = *ops::Cast(e, half, DType::kF32);
    Tensor dbias = Random({kCols}, 22);  // a column sum, cut by columns
    EXPECT_TRUE(ops::BiasBackward(e, dy, dbias, kRows, kCols).ok());
    return Cat({&y, &sum, &g, &dg, &back, &dbias});
  });
  ExpectThreadCountIndependent("bias + gelu", [&] {
    Tensor pre = x.Clone();
    Tensor y = *ops::BiasGeluForward(e, pre, bias, kRows, kCols);
    Tensor dbias = Random({kCols}, 15);
    Tensor dpre = *ops::BiasGeluBackward(e, pre, dy, dbias, kRows, kCols);
    return Cat({&pre, &y, &dpre, &dbias});
  });
  ExpectThreadCountIndependent("layernorm", [&] {
    Tensor y = Tensor::Empty({kRows, kCols}), mean = Tensor::Empty({kRows});
    Tensor rstd = Tensor::Empty({kRows}), dx = Tensor::Empty({kRows, kCols});
    EXPECT_TRUE(ops::LayerNormForward(e, x, gamma, bias, y, mean, rstd, kRows, kCols, 1e-5f).ok());
    EXPECT_TRUE(ops::LayerNormBackwardInput(e, x, gamma, mean, rstd, dy, dx, kRows, kCols).ok());
    Tensor dgamma = Random({kCols}, 20), dbeta = Random({kCols}, 21);
    EXPECT_TRUE(
        ops::LayerNormBackwardWeight(e, x, mean, rstd, dy, dgamma, dbeta, kRows, kCols).ok());
    return Cat({&y, &mean, &rstd, &dx, &dgamma, &dbeta});
  });
  ExpectThreadCountIndependent("cross-entropy", [&] {
    std::vector<int32_t> t(kRows);
    for (int64_t r = 0; r < kRows; ++r)
      t[r] = r % 7 == 3 ? -1 : static_cast<int32_t>(r * 31 % kCols);
    const Tensor targets = Tensor::FromVectorI32({kRows}, t);
    int64_t count = 0;
    const double loss = *ops::CrossEntropyForward(e, x, targets, kRows, kCols, &count);
    Tensor dlogits = Tensor::Empty({kRows, kCols});
    EXPECT_TRUE(ops::CrossEntropyBackward(e, x, targets, kRows, kCols, 0.01f, dlogits).ok());
    std::vector<float> out = dlogits.ToVector();
    float bits[2];
    std::memcpy(bits, &loss, sizeof(loss));
    out.insert(out.end(), {bits[0], bits[1], static_cast<float>(count)});
    return out;
  });
  ExpectThreadCountIndependent("attention", [&] {
    constexpr int64_t B = 3, T = 37, H = 4, C = 64;
    const Tensor qkv = Random({B, T, 3 * C}, 16);
    const Tensor dout = Random({B, T, C}, 17);
    Tensor out = Tensor::Empty({B, T, C}), lse = Tensor::Empty(ops::AttentionLseShape(B, T, H));
    EXPECT_TRUE(ops::AttentionForward(e, qkv, out, lse, B, T, C, H).ok());
    Tensor dqkv = *ops::AttentionBackward(e, dout, qkv, out, lse, B, T, C, H);
    return Cat({&out, &lse, &dqkv});
  });
  ExpectThreadCountIndependent("embedding", [&] {
    constexpr int64_t B = 5, T = 50, C = 96, V = 40;
    std::vector<int32_t> tok(B * T);
    for (size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int32_t>(i * 7 % V);
    const Tensor tokens = Tensor::FromVectorI32({B, T}, tok);
    const Tensor wte = Random({V, C}, 18), wpe = Random({T, C}, 19);
    Tensor out = Tensor::Empty({B, T, C});
    EXPECT_TRUE(ops::EmbeddingForward(e, tokens, wte, wpe, out, B, T, C).ok());
    return out.ToVector();
  });
  ExpectThreadCountIndependent("optimizers", [&] {
    Tensor p = x.Clone(), m = Tensor::Zeros({kRows, kCols}), v = Tensor::Zeros({kRows, kCols});
    std::vector<ops::AdamWItem> items = {{&p, &dy, &m, &v, 0.1f}};
    for (int64_t step = 1; step <= 3; ++step) {
      EXPECT_TRUE(ops::AdamW(e, items, 1e-2f, 0.9f, 0.95f, 1e-8f, step).ok());
    }
    Tensor q = x.Clone(), buf = Tensor::Zeros({kRows, kCols});
    EXPECT_TRUE(ops::SgdMomentum(e, q, dy, buf, 1e-2f, 0.9f, 0.01f).ok());
    return Cat({&p, &m, &v, &q, &buf});
  });
}

}  // namespace
}  // namespace pipewright::cpu
