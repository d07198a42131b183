// Helpers of the communicator tests (comm_test, mpi_comm_test): ranks as threads of this
// process, bit-exact comparisons, inputs whose float sums depend on their order, and the local
// backend's rank-order sum as the reference.
#ifndef PIPEWRIGHT_TESTS_RUNTIME_COMM_TEST_UTIL_H_
#define PIPEWRIGHT_TESTS_RUNTIME_COMM_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "pipewright/comm.h"
#include "pipewright/tensor.h"

namespace pipewright::comm_test {

using Comms = std::vector<std::unique_ptr<Communicator>>;

inline constexpr absl::Duration kWait = absl::Seconds(5);

// Runs fn(rank, comm) on one thread per communicator and joins them.
inline void RunRanks(Comms& comms, const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < static_cast<int>(comms.size()); ++r) {
    threads.emplace_back([&, r] { fn(r, *comms[r]); });
  }
  for (std::thread& t : threads) t.join();
}

inline Tensor Scalar1(float v) { return Tensor::FromVector({1}, {v}); }

inline bool BitEqual(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Values over many orders of magnitude, both signs: float sums depend on their order.
inline std::vector<Tensor> MixedMagnitudeInputs(int ranks, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-10, 10);
  std::vector<Tensor> inputs;
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> v(n);
    for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng) * 2);
    inputs.push_back(Tensor::FromVector({n}, v));
  }
  return inputs;
}

// ((inputs[0] + inputs[1]) + inputs[2]) + ..., element-wise in f32.
inline Tensor SequentialSum(const std::vector<Tensor>& inputs) {
  const int64_t n = inputs[0].numel();
  Tensor out = Tensor::Empty({n});
  for (int64_t i = 0; i < n; ++i) {
    float acc = inputs[0].data<float>()[i];
    for (size_t r = 1; r < inputs.size(); ++r) acc = acc + inputs[r].data<float>()[i];
    out.data<float>()[i] = acc;
  }
  return out;
}

// The reference sum of `inputs` (rank r's at r): AllReduce on a fresh local world of
// inputs.size() ranks, posted from one thread (an AllReduce does not block), every rank's result
// bit-identical; this is rank 0's.
inline Tensor LocalAllReduce(const std::vector<Tensor>& inputs, absl::Duration timeout) {
  Comms comms = CreateLocalWorld(static_cast<int>(inputs.size()));
  std::vector<Tensor> bufs;
  for (const Tensor& t : inputs) bufs.push_back(t.Clone());
  std::vector<std::unique_ptr<Work>> works;
  for (size_t r = 0; r < inputs.size(); ++r) works.push_back(comms[r]->AllReduce(bufs[r]));
  for (auto& w : works) EXPECT_TRUE(w->Wait(timeout).ok());
  return bufs[0];
}

}  // namespace pipewright::comm_test

#endif  // PIPEWRIGHT_TESTS_RUNTIME_COMM_TEST_UTIL_H_
