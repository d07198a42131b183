// PowerSGD gradient compression (grad_sync.h, TrainOptions.grad_compression = powersgd:R).
//
// Note [PowerSGD]. Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
// Compression for Distributed Optimization" (NeurIPS 2019), with error feedback, on the buckets
// of the bucketed all-reduce (Note [Bucket order]). For each 2-D gradient G (n x m) of replica r,
// with E_r its error buffer and Q (m x R) the factor the replicas share:
//   M_r = G_r + E_r
//   P   = sum_r M_r Q                (round 1: every replica's P_r = M_r Q, all-gathered)
//   P^  = orth(P)                    (Gram-Schmidt on the R columns; identical everywhere)
//   Q_r = M_r^T P^,  E_r = M_r - P^ Q_r^T
//   Q   = sum_r Q_r                  (round 2: all-gathered)
//   G   = P^ Q^T                     (what every replica applies: the sum's rank-R projection)
// and Q is kept as the next step's starting factor (the warm start that makes one power
// iteration per step enough). Nothing a replica computed is lost: sum_r E_r(new) + applied =
// sum_r (G_r + E_r(old)), exactly up to fp32 rounding, so what is not sent this step is sent
// later. The error is the replica's own residual M_r - P^ P^T M_r (Vogels et al.'s local
// decompression), not the shared one, so it needs no division by the replica count.
//
// Determinism: both rounds are all-gathers, and every replica sums the gathered factors itself
// in replica order ((x0 + x1) + x2 ...), then orthogonalises in double-precision dot products
// on the host; so every replica applies bit-identical gradients on any backend, run after run
// (the bf16 codec's argument, Note [Bucket codecs]). The initial Q is a fixed pseudo-random
// normal matrix per parameter name, the same on every replica and at every pipeline depth.
//
// What goes uncompressed, summed by one fp32 all-reduce per bucket: 1-D gradients (biases,
// LayerNorm), and matrices for which R (n + m) >= n m (the factors would be no smaller).
//
// Overlap: round 1 and the fp32 all-reduce start when the bucket's last layer is ready, so they
// overlap the rest of the backward like an uncompressed bucket; round 2 needs round 1's sum and
// runs in Finish, all buckets' second rounds in flight together. Collectives are posted in the
// same order on every replica (launch order, then bucket order in Finish), never depending on
// which one completes first.
//
// Bytes (GradSyncBytes): a replica's P_r and Q_r and its uncompressed gradients, against the
// fp32 gradients. The error buffers (one fp32 copy of the compressed gradients) and Q are each
// replica's state: checkpoints hold them (SaveState), so a resumed run continues bit-identically.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/ops.h"
#include "runtime/grad_sync/grad_sync.h"

namespace pipewright::internal {
namespace {

struct Matrix {
  Parameter* param = nullptr;
  int64_t rows = 0, cols = 0;  // the gradient is rows x cols, row-major
  int64_t p_offset = 0;        // its P_r in the bucket's flat P (rows x R)
  int64_t q_offset = 0;        // its Q_r in the bucket's flat Q (cols x R)
  uint64_t seed = 0;           // of its initial Q
  Tensor error;                // E_r, then M_r during the step (persistent)
  Tensor q;                    // Q, cols x R (persistent, identical on every replica)
  Tensor p_hat;                // this step's orth(P), rows x R
};

struct Bucket {
  std::vector<Parameter*> dense;  // sent uncompressed
  std::vector<Matrix> matrices;   // sent as factors
  int64_t dense_numel = 0, p_numel = 0, q_numel = 0, numel = 0;
  Tensor dense_flat;     // summed in place by an all-reduce
  Tensor p_flat, p_all;  // this replica's P_r, every replica's
  Tensor q_flat, q_all;  // this replica's Q_r, every replica's
  std::unique_ptr<Work> dense_work, p_work, q_work;
};

struct Stage {
  int index = 0;
  std::vector<Bucket> buckets;
};

// splitmix64: the initial Q's pseudo-random stream.
uint64_t NextRandom(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// rows x cols standard normal values (Box-Muller), a function of `seed` only.
std::vector<float> NormalMatrix(uint64_t seed, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  uint64_t state = seed;
  for (int64_t i = 0; i < n; i += 2) {
    const double u1 = (static_cast<double>(NextRandom(state) >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(NextRandom(state) >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1)), angle = 2.0 * M_PI * u2;
    v[static_cast<size_t>(i)] = static_cast<float>(radius * std::cos(angle));
    if (i + 1 < n) v[static_cast<size_t>(i + 1)] = static_cast<float>(radius * std::sin(angle));
  }
  return v;
}

// The initial Q's seed: a function of the parameter's global name only, so that every pipeline
// depth and stage split starts each matrix from the same Q (PowerSGD stays pp-invariant).
uint64_t NameSeed(const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ull ^ 0x5057534744ull;  // FNV-1a, salted "PWSGD"
  for (unsigned char c : name) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

// FNV-1a over the values' bits.
uint64_t Fingerprint(const std::vector<float>& v) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (float x : v) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    h = (h ^ bits) * 0x100000001B3ull;
  }
  return h;
}

}  // namespace

// Orthonormalises the `r` columns of the rows x r row-major matrix `p` in place (classical
// Gram-Schmidt applied twice per column, dot products in double): a column that is zero, or
// dependent on the ones before it, becomes zero. Exposed for tests (grad_compression_test).
void OrthonormalizeColumns(float* p, int64_t rows, int r) {
  auto dot = [&](int a, int b) {
    double s = 0;
    for (int64_t i = 0; i < rows; ++i) s += double{p[i * r + a]} * double{p[i * r + b]};
    return s;
  };
  for (int j = 0; j < r; ++j) {
    const double before = std::sqrt(dot(j, j));
    for (int pass = 0; pass < 2; ++pass) {
      for (int k = 0; k < j; ++k) {
        const double c = dot(k, j);
        for (int64_t i = 0; i < rows; ++i) {
          p[i * r + j] = static_cast<float>(p[i * r + j] - c * p[i * r + k]);
        }
      }
    }
    const double norm = std::sqrt(dot(j, j));
    // Below this the column is rounding noise of the ones before it (or was zero).
    const bool keep = norm > 0 && norm > 1e-6 * before;
    for (int64_t i = 0; i < rows; ++i) {
      p[i * r + j] = keep ? static_cast<float>(p[i * r + j] / norm) : 0.0f;
    }
  }
}

namespace {

class PowerSgd final : public BucketLauncher {
 public:
  PowerSgd(const GradSyncContext& ctx, std::vector<GradSyncStage> stages, int64_t bucket_bytes,
           int rank)
      : BucketLauncher(ctx.dp, stages, bucket_bytes), ctx_(ctx), rank_(rank) {
    for (size_t si = 0; si < stages.size(); ++si) {
      const GradSyncStage& s = stages[si];
      Stage& st = stages_.emplace_back();
      st.index = s.index;
      for (const std::vector<Parameter*>& params : groupings()[si].params) {
        Bucket& bucket = st.buckets.emplace_back();
        for (Parameter* p : params) {
          const Tensor& g = p->grad;
          bucket.numel += g.numel();
          const bool matrix = g.rank() == 2 && rank_ * (g.dim(0) + g.dim(1)) < g.numel();
          if (!matrix) {
            bucket.dense.push_back(p);
            bucket.dense_numel += g.numel();
            continue;
          }
          Matrix& m = bucket.matrices.emplace_back();
          m.param = p;
          m.rows = g.dim(0);
          m.cols = g.dim(1);
          m.p_offset = bucket.p_numel;
          m.q_offset = bucket.q_numel;
          m.seed = NameSeed(p->name);
          bucket.p_numel += m.rows * rank_;
          bucket.q_numel += m.cols * rank_;
        }
      }
    }
  }

  void ResetStep() override {
    for (Stage& s : stages_) {
      for (Bucket& b : s.buckets) {
        b.dense_work.reset();
        b.p_work.reset();
        b.q_work.reset();
        b.dense_flat = b.p_flat = b.p_all = b.q_flat = b.q_all = Tensor();
      }
    }
    bytes_ = GradSyncBytes{};
  }

  absl::Status LaunchBucket(int stage, int bucket) override {
    return LaunchFirstRound(stages_[stage].index, bucket, stages_[stage].buckets[bucket]);
  }

  absl::Status Finish() override {
    if (ctx_.dp == nullptr) return absl::OkStatus();
    for (size_t s = 0; s < stages_.size(); ++s) {
      for (size_t b = 0; b < stages_[s].buckets.size(); ++b) {
        if (!launched(static_cast<int>(s), static_cast<int>(b))) continue;
        PW_RETURN_IF_ERROR(
            LaunchSecondRound(stages_[s].index, static_cast<int>(b), stages_[s].buckets[b]));
      }
    }
    for (size_t s = 0; s < stages_.size(); ++s) {
      for (size_t b = 0; b < stages_[s].buckets.size(); ++b) {
        if (!launched(static_cast<int>(s), static_cast<int>(b))) continue;
        PW_RETURN_IF_ERROR(Decompress(stages_[s].index, stages_[s].buckets[b]));
      }
    }
    return absl::OkStatus();
  }

  GradSyncBytes StepBytes() const override { return bytes_; }

  // Per compressed matrix: "error.<param>" (E_r) and "q.<param>" (the warm-start Q).
  absl::StatusOr<NamedTensors> SaveState() override {
    NamedTensors out;
    for (Stage& s : stages_) {
      for (Bucket& b : s.buckets) {
        for (Matrix& m : b.matrices) {
          MakeState(m);
          PW_ASSIGN_OR_RETURN(Tensor error, m.error.CopyTo(nullptr));
          PW_ASSIGN_OR_RETURN(Tensor q, m.q.CopyTo(nullptr));
          out.emplace_back("error." + m.param->name, std::move(error));
          out.emplace_back("q." + m.param->name, std::move(q));
        }
      }
    }
    return out;
  }

  absl::Status LoadState(const std::map<std::string, Tensor>& state,
                         const std::string& prefix) override {
    std::vector<std::pair<Matrix*, std::pair<const Tensor*, const Tensor*>>> found;
    for (Stage& s : stages_) {
      for (Bucket& b : s.buckets) {
        for (Matrix& m : b.matrices) {
          PW_ASSIGN_OR_RETURN(const Tensor* e,
                              FindState(state, prefix, "error." + m.param->name, {m.rows, m.cols}));
          PW_ASSIGN_OR_RETURN(const Tensor* q,
                              FindState(state, prefix, "q." + m.param->name, {m.cols, rank_}));
          found.push_back({&m, {e, q}});
        }
      }
    }
    for (auto& [m, tensors] : found) {
      PW_ASSIGN_OR_RETURN(m->error, tensors.first->CopyTo(ctx_.alloc));
      PW_ASSIGN_OR_RETURN(m->q, tensors.second->CopyTo(ctx_.alloc));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Wait(Work& w, int stage, const char* what) {
    return ctx_.wait(w, absl::StrCat("PowerSGD ", what, " of stage ", stage, " across replicas"));
  }

  // Before a collective reads a buffer the ops wrote (Note in bucketed_all_reduce.cc).
  absl::Status ReadyToSend() {
    if (!ctx_.dp->capabilities().stream_ordered) return ctx_.sync_device();
    return absl::OkStatus();
  }

  // Every replica's `flat` (gathered, dp x n) summed in replica order, on the host.
  absl::StatusOr<std::vector<float>> SumReplicas(const Tensor& gathered, int64_t n) {
    Tensor host = gathered;
    if (gathered.device().is_cuda()) {
      PW_ASSIGN_OR_RETURN(host, gathered.CopyTo(nullptr));
    }
    const float* all = host.data<float>();
    std::vector<float> sum(all, all + n);
    for (int r = 1; r < ctx_.dp->size(); ++r) {
      const float* part = all + r * n;
      for (int64_t i = 0; i < n; ++i) sum[static_cast<size_t>(i)] += part[i];
    }
    return sum;
  }

  // A matrix's state as it starts: no error, the initial Q.
  void MakeState(Matrix& m) {
    if (!m.error.defined()) m.error = Tensor::Zeros({m.rows, m.cols}, DType::kF32, ctx_.alloc);
    if (!m.q.defined()) {
      m.q = Tensor::FromVector({m.cols, rank_}, NormalMatrix(m.seed, m.cols * rank_), ctx_.alloc);
    }
  }

  // Round 1: M_r = G_r + E_r and P_r = M_r Q into the flat P, all-gathered; the dense
  // gradients all-reduced.
  absl::Status LaunchFirstRound(int stage, int bucket, Bucket& b) {
    const ops::Exec e{ctx_.alloc};
    const int n = ctx_.dp->size();
    bytes_.uncompressed += RingAllReduceBytes(b.numel * static_cast<int64_t>(sizeof(float)), n);
    if (b.dense_numel > 0) {
      b.dense_flat = Tensor::Empty({b.dense_numel}, DType::kF32, ctx_.alloc);
      int64_t offset = 0;
      for (Parameter* p : b.dense) {
        PW_RETURN_IF_ERROR(ops::CopyRange(e, p->grad, 0, b.dense_flat, offset, p->grad.numel()));
        offset += p->grad.numel();
      }
    }
    if (b.p_numel > 0) {
      b.p_flat = Tensor::Empty({b.p_numel}, DType::kF32, ctx_.alloc);
      Tensor p = Tensor();
      for (Matrix& m : b.matrices) {
        MakeState(m);
        PW_RETURN_IF_ERROR(ops::AddInPlace(e, m.error, m.param->grad));  // M_r
        p = Tensor::Empty({m.rows, rank_}, DType::kF32, ctx_.alloc);
        PW_RETURN_IF_ERROR(ops::Gemm(e, false, false, m.rows, rank_, m.cols, 1.0f, m.error, m.cols,
                                     m.q, rank_, 0.0f, p, rank_));
        PW_RETURN_IF_ERROR(ops::CopyRange(e, p, 0, b.p_flat, m.p_offset, m.rows * rank_));
      }
      b.p_all = Tensor::Empty({ctx_.dp->size() * b.p_numel}, DType::kF32, ctx_.alloc);
    }
    PW_RETURN_IF_ERROR(ReadyToSend());
    if (b.dense_numel > 0) {
      b.dense_work = PostBucket(ctx_.buckets, stage, bucket, BucketCollective::kAllReduce,
                                [&] { return ctx_.dp->AllReduce(b.dense_flat); });
      bytes_.sent += RingAllReduceBytes(b.dense_numel * static_cast<int64_t>(sizeof(float)), n);
    }
    if (b.p_numel > 0) {
      b.p_work = PostBucket(ctx_.buckets, stage, bucket, BucketCollective::kAllGather,
                            [&] { return ctx_.dp->AllGather(b.p_flat, b.p_all); });
      bytes_.sent += RingAllGatherBytes(b.p_numel * static_cast<int64_t>(sizeof(float)), n);
    }
    return absl::OkStatus();
  }

  // Round 2: P^ = orth(sum P_r); Q_r = M_r^T P^ into the flat Q, all-gathered; E_r = M_r - P^
  // Q_r^T.
  absl::Status LaunchSecondRound(int stage, int bucket, Bucket& b) {
    if (b.p_numel == 0) return absl::OkStatus();
    const ops::Exec e{ctx_.alloc};
    PW_RETURN_IF_ERROR(Wait(*b.p_work, stage, "P all-gather"));
    PW_ASSIGN_OR_RETURN(std::vector<float> p_sum, SumReplicas(b.p_all, b.p_numel));
    for (const Matrix& m : b.matrices) {
      OrthonormalizeColumns(p_sum.data() + m.p_offset, m.rows, rank_);
    }
    const Tensor p_hat_flat = Tensor::FromVector({b.p_numel}, p_sum, ctx_.alloc);
    b.q_flat = Tensor::Empty({b.q_numel}, DType::kF32, ctx_.alloc);
    for (Matrix& m : b.matrices) {
      m.p_hat = Tensor::Empty({m.rows, rank_}, DType::kF32, ctx_.alloc);
      PW_RETURN_IF_ERROR(ops::CopyRange(e, p_hat_flat, m.p_offset, m.p_hat, 0, m.rows * rank_));
      Tensor q_r = Tensor::Empty({m.cols, rank_}, DType::kF32, ctx_.alloc);
      PW_RETURN_IF_ERROR(ops::Gemm(e, true, false, m.cols, rank_, m.rows, 1.0f, m.error, m.cols,
                                   m.p_hat, rank_, 0.0f, q_r, rank_));
      PW_RETURN_IF_ERROR(ops::CopyRange(e, q_r, 0, b.q_flat, m.q_offset, m.cols * rank_));
      PW_RETURN_IF_ERROR(ops::Gemm(e, false, true, m.rows, m.cols, rank_, -1.0f, m.p_hat, rank_,
                                   q_r, rank_, 1.0f, m.error, m.cols));  // E_r = M_r - P^ Q_r^T
    }
    b.q_all = Tensor::Empty({ctx_.dp->size() * b.q_numel}, DType::kF32, ctx_.alloc);
    PW_RETURN_IF_ERROR(ReadyToSend());
    b.q_work = PostBucket(ctx_.buckets, stage, bucket, BucketCollective::kAllGather,
                          [&] { return ctx_.dp->AllGather(b.q_flat, b.q_all); });
    bytes_.sent +=
        RingAllGatherBytes(b.q_numel * static_cast<int64_t>(sizeof(float)), ctx_.dp->size());
    return absl::OkStatus();
  }

  // The sums back into the gradients: dense ones as summed, matrices as P^ Q^T with Q = sum Q_r
  // (kept as the next step's Q).
  absl::Status Decompress(int stage, Bucket& b) {
    const ops::Exec e{ctx_.alloc};
    if (b.dense_numel > 0) {
      PW_RETURN_IF_ERROR(Wait(*b.dense_work, stage, "all-reduce"));
      int64_t offset = 0;
      for (Parameter* p : b.dense) {
        PW_RETURN_IF_ERROR(ops::CopyRange(e, b.dense_flat, offset, p->grad, 0, p->grad.numel()));
        offset += p->grad.numel();
      }
    }
    if (b.q_numel > 0) {
      PW_RETURN_IF_ERROR(Wait(*b.q_work, stage, "Q all-gather"));
      PW_ASSIGN_OR_RETURN(std::vector<float> q_sum, SumReplicas(b.q_all, b.q_numel));
      const Tensor q_flat = Tensor::FromVector({b.q_numel}, q_sum, ctx_.alloc);
      for (Matrix& m : b.matrices) {
        PW_RETURN_IF_ERROR(ops::CopyRange(e, q_flat, m.q_offset, m.q, 0, m.cols * rank_));
        PW_RETURN_IF_ERROR(ops::Gemm(e, false, true, m.rows, m.cols, rank_, 1.0f, m.p_hat, rank_,
                                     m.q, rank_, 0.0f, m.param->grad, m.cols));
        m.p_hat = Tensor();
        PW_RETURN_IF_ERROR(ReseedZeroColumns(m, q_sum.data() + m.q_offset));
      }
    }
    b.dense_flat = b.p_flat = b.p_all = b.q_flat = b.q_all = Tensor();
    b.dense_work.reset();
    b.p_work.reset();
    b.q_work.reset();
    return absl::OkStatus();
  }

  // A column of Q that came out zero (a zero gradient, or a P column dropped as dependent)
  // would stay zero in every later step (P = M Q): it restarts from new pseudo-random values,
  // the same on every replica and after a resume (they depend on the matrix, the column and the
  // identical sum only).
  absl::Status ReseedZeroColumns(Matrix& m, const float* q_sum) {
    std::vector<float> q(q_sum, q_sum + m.cols * rank_);
    bool changed = false;
    for (int j = 0; j < rank_; ++j) {
      bool zero = true;
      for (int64_t i = 0; i < m.cols && zero; ++i)
        zero = q[static_cast<size_t>(i * rank_ + j)] == 0;
      if (!zero) continue;
      const std::vector<float> fresh = NormalMatrix(
          m.seed ^ (static_cast<uint64_t>(j + 1) * 0x9E3779B97F4A7C15ull) ^ Fingerprint(q), m.cols);
      for (int64_t i = 0; i < m.cols; ++i) q[static_cast<size_t>(i * rank_ + j)] = fresh[i];
      changed = true;
    }
    if (changed) m.q = Tensor::FromVector({m.cols, rank_}, q, ctx_.alloc);
    return absl::OkStatus();
  }

  GradSyncContext ctx_;
  int rank_;
  std::vector<Stage> stages_;
  GradSyncBytes bytes_;
};

}  // namespace

std::unique_ptr<GradSync> CreatePowerSgd(const GradSyncContext& ctx,
                                         std::vector<GradSyncStage> stages, int64_t bucket_bytes,
                                         int rank) {
  return std::make_unique<PowerSgd>(ctx, std::move(stages), bucket_bytes, rank);
}

}  // namespace pipewright::internal
