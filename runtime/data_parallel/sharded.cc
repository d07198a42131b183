// The sharded strategies, ZeRO-1 and ZeRO-2 (data_parallel.h).
//
// Note [Flat shards]. Each stage's parameters are grouped into the buckets of the replicated
// all-reduce (BucketLayers: last layer first, about bucket_bytes each), and each bucket's
// parameters live in two flat buffers of the same layout (LayOutFlat): one of values and one of
// gradients, every Parameter's value and grad a view of its range. The buffer is replicas x
// shard elements; replica r owns [r shard, (r + 1) shard). A bucket is reduced by one
// reduce-scatter, in place (each replica receives its shard's sum over the replicas into its
// own range of the gradient buffer, the bits an all-reduce gives those elements), the owner updates
// its shard — the optimizer holds one piece (a Parameter viewing the owned range of a tensor) per
// tensor the shard touches, and AdamW and SGD are elementwise, so a piece gets exactly the update
// the whole tensor would — and one all-gather per bucket gives every replica the new values. Per
// step and rank that is (replicas - 1) x shard elements each way: the wire bytes of the all-reduce
// it replaces, plus the padding.
//
// The padding: a shard boundary may cut a tensor only where one of its kNormChunk chunks begins
// (Note [Exact norm] in exact_sum.cc), so LayOutFlat moves a tensor that would be cut elsewhere
// by up to kNormChunk - 1 elements, and widens the shard until everything fits.
//
// Tied parameters stay whole: their gradients are all-reduced with the bucket (the tie reduction
// after it needs the whole sums) and every replica updates them with its own optimizer.
//
// ZeRO-2 goes further: the gradient buffers no longer outlive a micro-batch. Its buckets are made
// of gradient groups, not layers (BucketGroups: a leaf layer's parameters, Note [Gradient groups]
// in pipewright/layer.h), so a bucket may end inside a transformer block, and each is at most
// max(bucket_bytes, the largest group). Each stage has two buffers of the largest bucket's size
// (TrainOptions.zero_buffers; with one, the backward waits for each reduce-scatter to bind the
// next); a bucket's parameters' grads are bound to one of them when its turn in the backward comes
// (BeginBackward binds the first, each bucket's completion the next), each micro-batch's bucket
// is reduce-scattered as soon as its last group is reported (LayerContext::gradients, or the
// executor's GradReady after the layer), and the owner adds the result into its shard's
// accumulator. Gradient memory per rank: the stage's / replicas, two buckets (or one) and the tied
// parameters. Traffic: a reduce-scatter per micro-batch, M times ZeRO-1's.
// The sum is grouped by micro-batch first ((g0 + g0') + (g1 + g1') ...) where zero 0 and 1 sum
// each replica's micro-batches first: ZeRO-2 agrees with them to fp32 rounding, not to the bit
// (docs/runtime.md, "ZeRO").
#include <algorithm>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/data_parallel/data_parallel.h"

namespace pipewright::internal {

FlatLayout LayOutFlat(const std::vector<int64_t>& sizes, int replicas) {
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  FlatLayout out;
  out.replicas = std::max(1, replicas);
  const int R = out.replicas;
  int64_t shard = std::max<int64_t>(1, (total + R - 1) / R);
  bool chunk_multiple = false;  // a tensor spans two boundaries: shards must be whole chunks
  for (;;) {
    if (chunk_multiple) shard = (shard + kNormChunk - 1) / kNormChunk * kNormChunk;
    out.offsets.clear();
    int64_t pos = 0;
    bool retry = false;
    for (int64_t n : sizes) {
      int64_t off = pos;
      for (;;) {
        const int64_t r = off / shard + 1;  // the first boundary after off
        const int64_t b = r * shard;
        if (r >= R || b >= off + n) break;  // no boundary cuts this tensor
        const int64_t shift = (b - off) % kNormChunk;
        if (shift != 0) {
          off += shift;  // now b - off is a whole number of chunks
          continue;
        }
        if (b + shard < off + n && r + 1 < R && shard % kNormChunk != 0) retry = true;
        break;
      }
      if (retry) break;
      out.offsets.push_back(off);
      pos = off + n;
    }
    if (retry) {
      chunk_multiple = true;
      continue;
    }
    if (pos <= shard * R) break;
    shard += std::max<int64_t>(1, (pos - shard * R + R - 1) / R);
  }
  out.shard = shard;
  return out;
}

namespace {

// ZeRO-2's buckets: the stage's gradient groups, last first, a bucket closing before a group that
// would take it past bucket_bytes (so a bucket is at most max(bucket_bytes, its largest group)).
absl::StatusOr<std::vector<std::vector<Parameter*>>> BucketGroups(const GradSyncStage& gs,
                                                                  int64_t bucket_bytes) {
  std::vector<std::vector<Parameter*>> out;
  int64_t bytes = 0;
  for (size_t i = gs.layers.size(); i-- > 0;) {
    std::vector<std::vector<Parameter*>> groups;
    if (i < gs.groups.size()) {
      groups = gs.groups[i];
      std::vector<Parameter*> flat;
      for (const auto& g : groups) flat.insert(flat.end(), g.begin(), g.end());
      if (flat != gs.layers[i]) {
        return absl::InternalError(
            absl::StrCat("stage ", gs.index, ", layer ", i,
                         ": its ParameterGroups() do not list its Parameters() in their order"));
      }
    } else if (!gs.layers[i].empty()) {
      groups.push_back(gs.layers[i]);
    }
    for (size_t g = groups.size(); g-- > 0;) {
      if (groups[g].empty()) continue;
      int64_t group_bytes = 0;
      for (const Parameter* p : groups[g]) group_bytes += static_cast<int64_t>(p->grad.nbytes());
      if (out.empty() || (bytes > 0 && bytes + group_bytes > bucket_bytes)) {
        out.emplace_back();
        bytes = 0;
      }
      out.back().insert(out.back().end(), groups[g].begin(), groups[g].end());
      bytes += group_bytes;
    }
  }
  return out;
}

// A tensor's elements in this replica's shard: [begin, end) of the tensor, at `flat` in the
// bucket's buffer (the tensor's first element).
struct Piece {
  Parameter* param = nullptr;
  int64_t begin = 0, end = 0;
  int64_t flat = 0;
};

struct Bucket {
  // Sharded tensors, the layout and this replica's pieces of them.
  std::vector<Parameter*> sharded;
  FlatLayout layout;
  std::vector<Piece> pieces;
  Tensor values;  // layout.numel(): every sharded tensor's value is a view of it
  Tensor grads;   // ZeRO-1: layout.numel(), the grads' views; ZeRO-2: unused (a slot's)
  // This replica's summed gradient: ZeRO-1 a view of its range of `grads` (reduce-scattered in
  // place); ZeRO-2 its own buffer, each micro-batch's sum added in.
  Tensor shard;
  std::unique_ptr<Work> work;  // ZeRO-1: the reduce-scatter in flight
  // Tied tensors, kept whole: one flat gradient buffer (their grads' views), all-reduced.
  std::vector<Parameter*> whole;
  Tensor whole_grads;
  std::unique_ptr<Work> whole_work;
  int layers = 0;  // ZeRO-1: layers with parameters
  // ZeRO-2: every parameter of the bucket, which of them this micro-batch has reported.
  std::vector<Parameter*> all;
  std::vector<char> done;
  int pending = 0;  // ZeRO-1: layers, ZeRO-2: parameters still to come
  bool launched = false;
  int stage = 0, index = 0;  // its virtual stage and index there (Note [Bucket spans])
};

// ZeRO-2: one of a stage's bucket-sized gradient buffers (reduce-scattered in place).
struct Slot {
  Tensor grads;
  int bucket = -1;         // the bucket bound to it; -1: free
  bool in_flight = false;  // its reduce-scatter is posted
  int64_t launched = 0;    // when (a counter): the older of two in flight is drained first
  std::unique_ptr<Work> work;
};

struct Stage {
  int index = 0;                  // virtual stage
  std::vector<int> layer_bucket;  // ZeRO-1
  std::vector<Bucket> buckets;
  // ZeRO-2: each parameter's bucket and place in it; the buffers (TrainOptions.zero_buffers: two
  // overlap a bucket's reduce-scatter with the next bucket's backward, one waits for it); the next
  // bucket to bind in
  // this backward; whether the backward is of the step's last micro-batch; what the layers tell.
  std::map<const Parameter*, std::pair<int, int>> where;
  std::vector<Slot> slots;
  int next = 0;
  bool last = false;
  std::unique_ptr<GradientObserver> observer;
};

class Sharded final : public DataParallel {
 public:
  Sharded(const DataParallelContext& ctx, DataParallelParams params, int zero)
      : ctx_(ctx), params_(std::move(params)), zero_(zero) {}

  absl::Status Init() {
    const ops::Exec e{ctx_.alloc};
    const int R = ctx_.replicas, me = ctx_.replica;
    std::vector<Parameter*> whole_trained;
    for (const GradSyncStage& gs : params_.stages) {
      Stage& st = stages_.emplace_back();
      st.index = gs.index;
      StageBuckets sb;
      if (zero_ == 1) {
        sb = BucketLayers(gs, ctx_.bucket_bytes);
      } else {
        PW_ASSIGN_OR_RETURN(sb.params, BucketGroups(gs, ctx_.bucket_bytes));
        st.observer = std::make_unique<Observer>(this, static_cast<int>(stages_.size()) - 1);
      }
      st.layer_bucket = sb.layer_bucket;
      int64_t largest = 0;
      for (size_t k = 0; k < sb.params.size(); ++k) {
        Bucket& b = st.buckets.emplace_back();
        if (zero_ == 1) b.layers = sb.layers[k];
        b.stage = gs.index;
        b.index = static_cast<int>(k);
        b.all = sb.params[k];
        for (size_t i = 0; i < b.all.size(); ++i) {
          st.where[b.all[i]] = {static_cast<int>(k), static_cast<int>(i)};
        }
        std::vector<int64_t> sizes;
        for (Parameter* p : sb.params[k]) {
          if (params_.tied.count(p) != 0) {
            b.whole.push_back(p);
          } else {
            b.sharded.push_back(p);
            sizes.push_back(p->value.numel());
          }
        }
        b.layout = LayOutFlat(sizes, R);
        const int64_t numel = b.layout.numel();
        largest = std::max(largest, numel);
        PW_ASSIGN_OR_RETURN(b.values, Tensor::TryEmpty({numel}, DType::kF32, ctx_.alloc));
        b.values.SetZero();
        if (zero_ == 1) {
          PW_ASSIGN_OR_RETURN(b.grads, Tensor::TryEmpty({numel}, DType::kF32, ctx_.alloc));
          b.grads.SetZero();
        }
        if (zero_ == 1) {  // reduce-scattered in place: the shard is this replica's range
          PW_ASSIGN_OR_RETURN(b.shard, b.grads.View(me * b.layout.shard, {b.layout.shard}));
        } else {
          PW_ASSIGN_OR_RETURN(b.shard, Tensor::TryEmpty({b.layout.shard}, DType::kF32, ctx_.alloc));
          b.shard.SetZero();
        }
        const int64_t lo = me * b.layout.shard, hi = lo + b.layout.shard;
        for (size_t i = 0; i < b.sharded.size(); ++i) {
          Parameter* p = b.sharded[i];
          const int64_t off = b.layout.offsets[i], n = p->value.numel();
          PW_ASSIGN_OR_RETURN(Tensor v, b.values.View(off, p->value.shape()));
          PW_RETURN_IF_ERROR(ops::Copy(e, p->value, v));
          p->value = std::move(v);
          if (zero_ == 1) {
            PW_ASSIGN_OR_RETURN(p->grad, b.grads.View(off, p->value.shape()));
          }
          const int64_t begin = std::max(lo, off), end = std::min(hi, off + n);
          if (begin < end) b.pieces.push_back({p, begin - off, end - off, off});
        }
        int64_t whole = 0;
        for (Parameter* p : b.whole) whole += p->grad.numel();
        if (whole > 0) {
          PW_ASSIGN_OR_RETURN(b.whole_grads, Tensor::TryEmpty({whole}, DType::kF32, ctx_.alloc));
          b.whole_grads.SetZero();
          int64_t off = 0;
          for (Parameter* p : b.whole) {
            PW_ASSIGN_OR_RETURN(p->grad, b.whole_grads.View(off, p->grad.shape()));
            off += p->grad.numel();
          }
        }
        for (Parameter* p : b.whole) {
          if (std::find(params_.trained.begin(), params_.trained.end(), p) !=
              params_.trained.end()) {
            whole_trained.push_back(p);
          }
        }
      }
      if (zero_ == 2) {
        st.slots.resize(static_cast<size_t>(std::clamp(ctx_.zero_buffers, 1, 2)));
        for (Slot& slot : st.slots) {
          PW_ASSIGN_OR_RETURN(slot.grads, Tensor::TryEmpty({largest}, DType::kF32, ctx_.alloc));
        }
        // Until a bucket is bound, its grads view the first slot (never written: BeginBackward
        // binds before any weight gradient is added).
        for (Bucket& b : st.buckets) PW_RETURN_IF_ERROR(BindGrads(b, st.slots[0].grads));
      }
    }
    for (Stage& st : stages_) {
      for (Bucket& b : st.buckets) {
        for (const Piece& pc : b.pieces) {
          auto piece = std::make_unique<Parameter>();
          piece->name = pc.param->name;
          piece->weight_decay = pc.param->weight_decay;
          const int64_t len = pc.end - pc.begin;
          PW_ASSIGN_OR_RETURN(piece->value, b.values.View(pc.flat + pc.begin, {len}));
          PW_ASSIGN_OR_RETURN(
              piece->grad, b.shard.View(pc.flat + pc.begin - ctx_.replica * b.layout.shard, {len}));
          pieces_.push_back(std::move(piece));
        }
      }
    }
    std::vector<Parameter*> pieces;
    for (auto& p : pieces_) pieces.push_back(p.get());
    shard_opt_ = Optimizer::Create(ctx_.optimizer, std::move(pieces), ctx_.alloc);
    whole_opt_ = Optimizer::Create(ctx_.optimizer, std::move(whole_trained), ctx_.alloc);
    return ctx_.sync_device();
  }

  void BeginStep() override {
    bytes_ = GradSyncBytes{};
    for (Stage& st : stages_) {
      for (Bucket& b : st.buckets) {
        b.pending = b.layers;
        b.launched = false;
        b.work.reset();
        b.whole_work.reset();
        if (zero_ == 2) b.shard.SetZero();
      }
      st.next = 0;
    }
  }

  absl::Status BeginBackward(int stage, bool last) override {
    if (zero_ != 2) return absl::OkStatus();
    Stage& st = stages_[stage];
    st.next = 0;
    st.last = last;
    for (Bucket& b : st.buckets) {
      b.pending = static_cast<int>(b.all.size());
      b.done.assign(b.all.size(), 0);
    }
    return BindNext(st);
  }

  GradientObserver* observer(int stage) override { return stages_[stage].observer.get(); }

  absl::Status GradReady(int stage, int layer, bool last) override {
    Stage& st = stages_[stage];
    if (zero_ == 2) return Report(st, params_.stages[stage].layers[layer]);
    const int k = st.layer_bucket[layer];
    if (k < 0 || !last) return absl::OkStatus();
    Bucket& b = st.buckets[k];
    if (--b.pending > 0) return absl::OkStatus();
    return Launch(b);
  }

  absl::Status StageReady(int stage) override {
    Stage& st = stages_[stage];
    if (zero_ == 1) {
      for (Bucket& b : st.buckets) {
        if (!b.launched) PW_RETURN_IF_ERROR(Launch(b));
      }
      return absl::OkStatus();
    }
    for (Bucket& b : st.buckets) {  // the tied tensors of buckets whose last layer never came
      if (!b.launched) PW_RETURN_IF_ERROR(LaunchWhole(b));
    }
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    for (Stage& st : stages_) {
      if (zero_ == 2) {
        for (Slot& slot : st.slots) PW_RETURN_IF_ERROR(Drain(st, slot));
      }
      for (Bucket& b : st.buckets) {
        if (!b.launched) {
          return absl::InternalError(absl::StrCat("stage ", st.index,
                                                  ": a gradient bucket was never reduced (no "
                                                  "REDUCE_GRADS after its last backward)"));
        }
        if (b.work != nullptr) PW_RETURN_IF_ERROR(Wait(*b.work, "reduce-scatter", st));
        if (b.whole_work != nullptr) {
          PW_RETURN_IF_ERROR(Wait(*b.whole_work, "all-reduce of tied gradients", st));
        }
        b.work.reset();
        b.whole_work.reset();
      }
    }
    return absl::OkStatus();
  }

  absl::Status AddSquaredNorm(ExactSum* sum) override {
    const ops::Exec e{ctx_.alloc};
    for (Stage& st : stages_) {
      for (Bucket& b : st.buckets) {
        for (const Piece& pc : b.pieces) {
          if (!CountsInNorm(*pc.param, ctx_.tensor_rank)) continue;
          PW_ASSIGN_OR_RETURN(const Tensor g,
                              b.shard.View(pc.flat + pc.begin - ctx_.replica * b.layout.shard,
                                           {pc.end - pc.begin}));
          PW_RETURN_IF_ERROR(AddChunkSquares(e, g, 0, g.numel(), sum));
        }
        if (ctx_.replica != 0) continue;  // whole tensors: replica 0 counts them
        for (const Parameter* p : b.whole) {
          if (!CountsInNorm(*p, ctx_.tensor_rank)) continue;
          PW_RETURN_IF_ERROR(AddChunkSquares(e, p->grad, 0, p->grad.numel(), sum));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status Step(float lr, float grad_scale) override {
    PW_RETURN_IF_ERROR(shard_opt_->Step(lr, grad_scale));
    return whole_opt_->Step(lr, grad_scale);
  }

  bool syncs_parameters() const override { return true; }
  // Every owner's new values to every replica: one all-gather per bucket.
  absl::Status SyncParameters() override {
    const ops::Exec e{ctx_.alloc};
    std::vector<Tensor> sends;
    std::vector<std::unique_ptr<Work>> works;
    for (Stage& st : stages_) {
      for (Bucket& b : st.buckets) {
        if (b.sharded.empty()) continue;
        const int64_t C = b.layout.shard;
        PW_ASSIGN_OR_RETURN(const Tensor mine, b.values.View(ctx_.replica * C, {C}));
        Tensor send = Tensor::Empty({C}, DType::kF32, ctx_.alloc);
        PW_RETURN_IF_ERROR(ops::Copy(e, mine, send));
        sends.push_back(send);
      }
    }
    PW_RETURN_IF_ERROR(ctx_.sync_device());
    size_t i = 0;
    for (Stage& st : stages_) {
      for (Bucket& b : st.buckets) {
        if (b.sharded.empty()) continue;
        works.push_back(ctx_.dp->AllGather(sends[i++], b.values));
        bytes_.sent += RingAllGatherBytes(b.layout.shard * 4, ctx_.replicas);
      }
    }
    for (auto& w : works) {
      PW_RETURN_IF_ERROR(ctx_.wait(*w, "all-gather of the updated parameters across replicas"));
    }
    return absl::OkStatus();
  }

  GradSyncBytes StepBytes() const override { return bytes_; }
  int64_t OptimizerStateBytes() const override {
    return shard_opt_->StateBytes() + whole_opt_->StateBytes();
  }
  int64_t GradientBytes() const override {
    int64_t n = 0;
    for (const Stage& st : stages_) {
      for (const Bucket& b : st.buckets) {
        n += static_cast<int64_t>(b.grads.nbytes() + b.whole_grads.nbytes());
        if (zero_ == 2) n += static_cast<int64_t>(b.shard.nbytes());
      }
      for (const Slot& slot : st.slots) n += static_cast<int64_t>(slot.grads.nbytes());
    }
    return n;
  }
  int64_t optimizer_steps() const override { return shard_opt_->step_count(); }

  absl::StatusOr<NamedTensors> OptimizerState() override {
    const ops::Exec e{ctx_.alloc};
    NamedTensors out;
    std::map<std::string, Tensor> mine;
    for (auto& [name, t] : shard_opt_->State()) mine.emplace(name, t);
    for (Stage& st : stages_) {
      for (Bucket& b : st.buckets) {
        if (b.sharded.empty()) continue;
        const int64_t C = b.layout.shard;
        for (const std::string& kind : Kinds()) {
          // This replica's pieces of the state at their places in its shard, then every shard.
          Tensor send = Tensor::Zeros({C}, DType::kF32, ctx_.alloc);
          for (const Piece& pc : b.pieces) {
            const Tensor& t = mine.at(absl::StrCat(kind, ".", pc.param->name));
            PW_RETURN_IF_ERROR(ops::CopyRange(e, t, 0, send, pc.flat + pc.begin - ctx_.replica * C,
                                              pc.end - pc.begin));
          }
          Tensor all = Tensor::Empty({b.layout.numel()}, DType::kF32, ctx_.alloc);
          PW_RETURN_IF_ERROR(ctx_.sync_device());
          std::unique_ptr<Work> w = ctx_.dp->AllGather(send, all);
          PW_RETURN_IF_ERROR(ctx_.wait(*w, "all-gather of the optimizer state for a checkpoint"));
          if (ctx_.replica != 0) continue;
          for (size_t i = 0; i < b.sharded.size(); ++i) {
            const Parameter* p = b.sharded[i];
            Tensor h = Tensor::Empty(p->value.shape(), DType::kF32);
            PW_RETURN_IF_ERROR(ops::CopyRange(e, all, b.layout.offsets[i], h, 0, p->value.numel()));
            out.emplace_back(absl::StrCat(kind, ".", p->name), std::move(h));
          }
        }
      }
    }
    if (ctx_.replica == 0) PW_RETURN_IF_ERROR(AppendHostState(*whole_opt_, &out));
    return out;
  }

  absl::Status LoadOptimizerState(const std::map<std::string, Tensor>& state,
                                  int64_t step) override {
    std::map<std::string, Tensor> pieces;
    for (Stage& st : stages_) {
      for (Bucket& b : st.buckets) {
        for (const Piece& pc : b.pieces) {
          for (const std::string& kind : Kinds()) {
            const std::string name = absl::StrCat(kind, ".", pc.param->name);
            auto it = state.find(name);
            if (it == state.end()) {
              return absl::NotFoundError(absl::StrCat("optimizer state '", name, "' missing"));
            }
            if (it->second.dtype() != DType::kF32 ||
                it->second.numel() != pc.param->value.numel()) {
              return absl::InvalidArgumentError(
                  absl::StrCat("optimizer state '", name, "' has shape ", it->second.ShapeString(),
                               ", expected ", pc.param->value.ShapeString()));
            }
            PW_ASSIGN_OR_RETURN(Tensor slice, it->second.View(pc.begin, {pc.end - pc.begin}));
            pieces.emplace(name, std::move(slice));
          }
        }
      }
    }
    PW_RETURN_IF_ERROR(whole_opt_->LoadState(state, step));
    return shard_opt_->LoadState(pieces, step);
  }

  absl::StatusOr<NamedTensors> SyncState() override { return NamedTensors{}; }
  absl::Status LoadSyncState(const std::map<std::string, Tensor>&, const std::string&) override {
    return absl::OkStatus();
  }

 private:
  std::vector<std::string> Kinds() const {
    if (ctx_.optimizer.kind == OptimizerKind::kAdamW) return {"exp_avg", "exp_avg_sq"};
    return {"momentum_buffer"};
  }

  absl::Status Wait(Work& w, const char* what, const Stage& st) {
    return ctx_.wait(
        w, absl::StrCat("ZeRO-", zero_, " ", what, " of stage ", st.index, " across replicas"));
  }

  // Every sharded grad of `b` a view of `buffer` at its place in the layout.
  absl::Status BindGrads(Bucket& b, const Tensor& buffer) {
    for (size_t i = 0; i < b.sharded.size(); ++i) {
      Parameter* p = b.sharded[i];
      PW_ASSIGN_OR_RETURN(p->grad, buffer.View(b.layout.offsets[i], p->value.shape()));
    }
    return absl::OkStatus();
  }

  // ZeRO-1: the bucket's reduce-scatter and the tied tensors' all-reduce, once per step.
  absl::Status Launch(Bucket& b) {
    b.launched = true;
    if (!b.sharded.empty()) {
      PW_RETURN_IF_ERROR(ctx_.sync_device());
      b.work = PostBucket(ctx_.buckets, b.stage, b.index, BucketCollective::kReduceScatter,
                          [&] { return ctx_.dp->ReduceScatter(b.grads, b.shard); });
      CountReduceScatter(b);
      CountUncompressed(b);
    }
    return LaunchWhole(b);
  }

  absl::Status LaunchWhole(Bucket& b) {
    b.launched = true;
    if (b.whole_grads.numel() == 0) return absl::OkStatus();
    PW_RETURN_IF_ERROR(ctx_.sync_device());
    b.whole_work = PostBucket(ctx_.buckets, b.stage, b.index, BucketCollective::kAllReduce,
                              [&] { return ctx_.dp->AllReduce(b.whole_grads); });
    const int64_t bytes = b.whole_grads.numel() * 4;
    bytes_.sent += RingAllReduceBytes(bytes, ctx_.replicas);
    bytes_.uncompressed += RingAllReduceBytes(bytes, ctx_.replicas);
    return absl::OkStatus();
  }

  // What an fp32 all-reduce of the bucket's sharded gradients would send, once per step.
  void CountUncompressed(const Bucket& b) {
    int64_t real = 0;
    for (const Parameter* p : b.sharded) real += p->value.numel();
    bytes_.uncompressed += RingAllReduceBytes(real * 4, ctx_.replicas);
  }

  void CountReduceScatter(const Bucket& b) {
    bytes_.sent += RingReduceScatterBytes(b.layout.numel() * 4, ctx_.replicas);
  }

  // ZeRO-2: bucket k of `st` is complete for one micro-batch: its slot's reduce-scatter.
  absl::Status LaunchMicroBatch(Stage& st, int k, bool last) {
    Bucket& b = st.buckets[k];
    Slot* slot = nullptr;
    for (Slot& s : st.slots) {
      if (s.bucket == k && !s.in_flight) slot = &s;
    }
    if (slot == nullptr) {
      return absl::InternalError("ZeRO-2: a completed gradient bucket has no buffer");
    }
    if (!b.sharded.empty()) {
      PW_RETURN_IF_ERROR(ctx_.sync_device());
      PW_ASSIGN_OR_RETURN(Tensor in, slot->grads.View(0, {b.layout.numel()}));
      PW_ASSIGN_OR_RETURN(Tensor out,
                          slot->grads.View(ctx_.replica * b.layout.shard, {b.layout.shard}));
      slot->work = PostBucket(ctx_.buckets, b.stage, b.index, BucketCollective::kReduceScatter,
                              [&] { return ctx_.dp->ReduceScatter(in, out); });
      slot->in_flight = true;
      slot->launched = ++launches_;
      CountReduceScatter(b);
    } else {
      slot->bucket = -1;
    }
    if (last) {
      PW_RETURN_IF_ERROR(LaunchWhole(b));
      CountUncompressed(b);
    }
    return absl::OkStatus();
  }

  // Waits for the slot's reduce-scatter, adds what it received into its bucket's shard and frees
  // the slot.
  absl::Status Drain(Stage& st, Slot& slot) {
    if (slot.bucket < 0) return absl::OkStatus();
    Bucket& b = st.buckets[slot.bucket];
    if (slot.in_flight) {
      PW_RETURN_IF_ERROR(Wait(*slot.work, "reduce-scatter", st));
      slot.work.reset();
      PW_ASSIGN_OR_RETURN(const Tensor got,
                          slot.grads.View(ctx_.replica * b.layout.shard, {b.layout.shard}));
      PW_RETURN_IF_ERROR(ops::AddInPlace(ops::Exec{ctx_.alloc}, b.shard, got));
      slot.in_flight = false;
    }
    slot.bucket = -1;
    return absl::OkStatus();
  }

  // Binds the stage's next bucket of this backward to a free slot (draining the oldest one when
  // none is free: with one slot, the reduce-scatter just posted) and zeroes its gradients.
  absl::Status BindNext(Stage& st) {
    if (st.next >= static_cast<int>(st.buckets.size())) return absl::OkStatus();
    const int k = st.next++;
    Slot* slot = nullptr;
    for (Slot& s : st.slots) {
      if (s.bucket < 0) slot = &s;
    }
    if (slot == nullptr) {
      slot = &*std::min_element(st.slots.begin(), st.slots.end(), [](const Slot& a, const Slot& c) {
        return a.launched < c.launched;
      });
      PW_RETURN_IF_ERROR(Drain(st, *slot));
    }
    Bucket& b = st.buckets[k];
    PW_ASSIGN_OR_RETURN(Tensor buf, slot->grads.View(0, {b.layout.numel()}));
    buf.SetZero();
    PW_RETURN_IF_ERROR(BindGrads(b, buf));
    slot->bucket = k;
    return absl::OkStatus();
  }

  // ZeRO-2: `params`' gradients of this micro-batch are complete. A bucket whose last parameter
  // this is is reduce-scattered and the next bound.
  absl::Status Report(Stage& st, const std::vector<Parameter*>& params) {
    for (const Parameter* p : params) {
      auto it = st.where.find(p);
      if (it == st.where.end()) continue;
      const auto [k, i] = it->second;
      Bucket& b = st.buckets[k];
      if (b.done[i] != 0) continue;
      if (k >= st.next) {
        return absl::InternalError(
            absl::StrCat("ZeRO-2, stage ", st.index, ": the gradient of ", p->name,
                         " was added before its bucket had a buffer (a composite layer whose "
                         "ParameterGroups() split it must report each group: ReportGradients)"));
      }
      b.done[i] = 1;
      if (--b.pending > 0) continue;
      PW_RETURN_IF_ERROR(LaunchMicroBatch(st, k, st.last));
      PW_RETURN_IF_ERROR(BindNext(st));
    }
    return absl::OkStatus();
  }

  class Observer final : public GradientObserver {
   public:
    Observer(Sharded* s, int stage) : s_(s), stage_(stage) {}
    absl::Status GradientsDone(const std::vector<Parameter*>& params) override {
      return s_->Report(s_->stages_[stage_], params);
    }

   private:
    Sharded* s_;
    int stage_;
  };

  int gradient_replicas() const override { return ctx_.replicas; }

  DataParallelContext ctx_;
  DataParallelParams params_;
  int zero_ = 1;
  std::vector<Stage> stages_;
  std::vector<std::unique_ptr<Parameter>> pieces_;
  std::unique_ptr<Optimizer> shard_opt_, whole_opt_;
  GradSyncBytes bytes_;
  int64_t launches_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataParallel>> CreateSharded(const DataParallelContext& ctx,
                                                            DataParallelParams params, int zero) {
  if (ctx.dp == nullptr || ctx.replicas < 2) {
    return absl::InvalidArgumentError(
        "a sharded optimizer (TrainOptions.zero >= 1) needs data parallelism");
  }
  if (zero != 1 && zero != 2) {
    return absl::InvalidArgumentError(absl::StrCat("TrainOptions.zero = ", zero, ": not sharded"));
  }
  auto s = std::make_unique<Sharded>(ctx, std::move(params), zero);
  PW_RETURN_IF_ERROR(s->Init());
  return std::unique_ptr<DataParallel>(std::move(s));
}

}  // namespace pipewright::internal
