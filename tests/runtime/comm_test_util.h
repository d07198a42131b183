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
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
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

// `s` is InvalidArgument and its message contains each of `parts`.
inline void ExpectInvalidArgument(const absl::Status& s, std::initializer_list<std::string> parts) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const std::string& part : parts) {
    EXPECT_NE(std::string(s.message()).find(part), std::string::npos) << part << " in " << s;
  }
}

// Elements [lo, lo + n) of an f32 host tensor, as a tensor of their own.
inline Tensor ChunkOf(const Tensor& t, int64_t lo, int64_t n) {
  return Tensor::FromVector({n},
                            std::vector<float>(t.data<float>() + lo, t.data<float>() + lo + n));
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

// ReduceScatter and AllReduce of the same f64 and i32 inputs on `c`, all four in flight at once
// and waited for out of call order: this rank's chunks must be bit for bit its elements of the
// AllReduce results. Every chunk of rank q's inputs is f64 {0.1 (q + 1), +-1e300} (whose sum
// cancels differently in another order) and i32 {q, -10 q, INT32_MAX} (whose sum wraps). Output
// shapes are free: the outputs are [2] and [1, 3].
inline void CheckF64AndI32ReduceScatter(Communicator& c, absl::Duration timeout) {
  const int rank = c.rank(), size = c.size();
  Tensor d = Tensor::Empty({size, 2}, DType::kF64), i = Tensor::Empty({size * 3}, DType::kI32);
  for (int k = 0; k < size; ++k) {
    d.data<double>()[2 * k] = 0.1 * (rank + 1);
    d.data<double>()[2 * k + 1] = 1e300 * (rank == 1 ? -1 : 1);
    i.data<int32_t>()[3 * k] = rank;
    i.data<int32_t>()[3 * k + 1] = -10 * rank;
    i.data<int32_t>()[3 * k + 2] = 2147483647;
  }
  Tensor d_all = d.Clone(), i_all = i.Clone();
  Tensor d_out = Tensor::Zeros({2}, DType::kF64), i_out = Tensor::Zeros({1, 3}, DType::kI32);
  std::vector<std::unique_ptr<Work>> works;
  works.push_back(c.ReduceScatter(d, d_out));
  works.push_back(c.AllReduce(d_all));
  works.push_back(c.ReduceScatter(i, i_out));
  works.push_back(c.AllReduce(i_all));
  for (auto it = works.rbegin(); it != works.rend(); ++it) {
    absl::Status s = (*it)->Wait(timeout);
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(std::memcmp(d_out.raw(), d_all.data<double>() + 2 * rank, d_out.nbytes()), 0);
  EXPECT_EQ(std::memcmp(i_out.raw(), i_all.data<int32_t>() + 3 * rank, i_out.nbytes()), 0);
  double big = 1e300;  // the rank-order sum of the +-1e300 terms
  for (int q = 1; q < size; ++q) big = big + 1e300 * (q == 1 ? -1 : 1);
  EXPECT_EQ(d_out.data<double>()[1], big);
  EXPECT_EQ(i_out.data<int32_t>()[2], static_cast<int32_t>(2147483647u * size));
}

}  // namespace pipewright::comm_test

#endif  // PIPEWRIGHT_TESTS_RUNTIME_COMM_TEST_UTIL_H_
