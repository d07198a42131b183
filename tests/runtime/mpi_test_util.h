// What the MPI backend's test files (mpi_comm_test.cc, mpi_collectives_test.cc; one executable
// run under the launcher) share: the process's MPI state set by main, the fixture that gives
// every test a fresh world, and small helpers.
#ifndef PIPEWRIGHT_TESTS_RUNTIME_MPI_TEST_UTIL_H_
#define PIPEWRIGHT_TESTS_RUNTIME_MPI_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/tensor.h"
#include "runtime/comm/mpi.h"
#include "tests/runtime/comm_test_util.h"

namespace pipewright::mpi_test {

using comm_test::BitEqual;
using comm_test::CheckF64AndI32ReduceScatter;
using comm_test::ChunkOf;
using comm_test::ExpectInvalidArgument;
using comm_test::LocalAllReduce;
using comm_test::Scalar1;
using comm_test::SecondsSince;
using comm_test::SequentialSum;

// Set by main: whether a launcher started this process, and its place in the job.
inline bool g_mpi = false;
inline MpiProcess g_process;

inline constexpr absl::Duration kWait = absl::Seconds(10);

inline void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

inline bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

inline bool EndsWith(const absl::Status& s, const std::string& text) {
  const std::string m(s.message());
  return m.size() >= text.size() && m.compare(m.size() - text.size(), text.size(), text) == 0;
}

// Values over many orders of magnitude, both signs: float sums depend on their order. Rank r's
// input depends only on (seed, r), so every process can compute every rank's.
inline Tensor MixedMagnitudeInput(int rank, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(rank));
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-10, 10);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng) * 2);
  return Tensor::FromVector({n}, v);
}

class MpiCommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_mpi) GTEST_SKIP() << "not started by an MPI launcher (run it under mpirun)";
    Create({});
  }
  void TearDown() override { world_.reset(); }

  void Create(const MpiWorldOptions& options) {
    world_.reset();
    absl::StatusOr<std::unique_ptr<Communicator>> w = CreateMpiWorld(options);
    ASSERT_TRUE(w.ok()) << w.status();
    world_ = *std::move(w);
    rank_ = world_->rank();
    size_ = world_->size();
  }

  void Sync() {
    absl::Status s = world_->Barrier()->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
  }

  std::unique_ptr<Communicator> world_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace pipewright::mpi_test

#endif  // PIPEWRIGHT_TESTS_RUNTIME_MPI_TEST_UTIL_H_
