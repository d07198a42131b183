// Tensor parallelism's collectives, parts of whole tensors, and the column- and row-parallel
// Linear building blocks (pipewright/tensor_parallel.h).
#include "pipewright/tensor_parallel.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "pipewright/init.h"
#include "pipewright/ops.h"
#include "runtime/layers/layers_internal.h"

namespace pipewright {

namespace {

// Waits for a collective posted at `posted`, adding its time to the group's collective_s.
absl::Status Finish(const LayerContext& ctx, Work& w, absl::string_view what, absl::Time posted) {
  absl::Status s = w.Wait(ctx.tp->timeout);
  ctx.tp->collective_s += absl::ToDoubleSeconds(absl::Now() - posted);
  if (s.ok()) return s;
  absl::Status first = ctx.tp->comm->abort_status();
  if (!first.ok()) return first;  // another rank failed first: report that
  s = absl::Status(s.code(), absl::StrCat("tensor-parallel rank ", ctx.tp->rank, " of ",
                                          ctx.tp->size, ", ", what, ": ", s.message()));
  ctx.tp->comm->Abort(s);  // the group's other ranks stop waiting for this one
  return s;
}

bool Active(const LayerContext& ctx) {
  return ctx.tp != nullptr && ctx.tp->size > 1 && ctx.tp->comm != nullptr;
}

// The element counts of the part's dimensions before the axis, on it and after it.
struct AxisSplit {
  int64_t outer = 1, along = 1, inner = 1;
};
AxisSplit SplitAt(const std::vector<int64_t>& shape, int axis) {
  AxisSplit a;
  for (int d = 0; d < axis; ++d) a.outer *= shape[d];
  a.along = shape[axis];
  for (size_t d = axis + 1; d < shape.size(); ++d) a.inner *= shape[d];
  return a;
}

// The whole axis's sections of `shard` along an axis of whole size `whole_along`.
std::vector<int64_t> SectionsOf(const TensorShard& shard, int64_t whole_along) {
  return shard.sections.empty() ? std::vector<int64_t>{whole_along} : shard.sections;
}

// Copies between a whole tensor and one part: `to_part` copies the part's elements out of
// `whole`, else into it. Section g's piece sits at the sum of the earlier sections' pieces in the
// part, and at the earlier sections' whole sizes plus index pieces in the whole.
void CopyPart(float* whole, float* part, const std::vector<int64_t>& part_shape,
              const TensorShard& shard, bool to_part) {
  const AxisSplit a = SplitAt(part_shape, shard.axis);
  const int64_t whole_along = a.along * shard.parts;
  const std::vector<int64_t> sections = SectionsOf(shard, whole_along);
  for (int64_t o = 0; o < a.outer; ++o) {
    int64_t at_part = 0, at_whole = 0;
    for (const int64_t section : sections) {
      const int64_t piece = section / shard.parts;  // the part's rows of this section
      float* p = part + (o * a.along + at_part) * a.inner;
      float* w = whole + (o * whole_along + at_whole + shard.index * piece) * a.inner;
      const size_t bytes = static_cast<size_t>(piece * a.inner) * sizeof(float);
      if (to_part) {
        std::memcpy(p, w, bytes);
      } else {
        std::memcpy(w, p, bytes);
      }
      at_part += piece;
      at_whole += section;
    }
  }
}

// Whether `sections` split a whole axis of `along` elements in `parts` alike.
bool SectionsFit(const std::vector<int64_t>& sections, int64_t along, int parts) {
  int64_t sum = 0;
  for (const int64_t s : sections) {
    if (s < 1 || s % parts != 0 || s > along - sum) return false;
    sum += s;
  }
  return sum == along;
}

absl::Status CheckHostF32(const Tensor& t, absl::string_view what) {
  if (!t.defined() || t.dtype() != DType::kF32 || !t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected a host f32 tensor"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TensorParallelAllReduce(const LayerContext& ctx, Tensor& t, absl::string_view what) {
  if (!Active(ctx)) return absl::OkStatus();
  const absl::Time posted = absl::Now();
  std::unique_ptr<Work> w = ctx.tp->comm->AllReduce(t);
  return Finish(ctx, *w, what, posted);
}

absl::Status TensorParallelAllGather(const LayerContext& ctx, const Tensor& in, Tensor& out,
                                     absl::string_view what) {
  if (!Active(ctx)) {
    if (in.numel() != out.numel()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": output of another size"));
    }
    return ops::Copy(ops::ExecOf(ctx), in, out);
  }
  const absl::Time posted = absl::Now();
  std::unique_ptr<Work> w = ctx.tp->comm->AllGather(in, out);
  return Finish(ctx, *w, what, posted);
}

namespace {
// Elements of one position of one sequence: x [B, T, ...] -> the product of the dims after T.
int64_t PerPosition(const Tensor& x) {
  int64_t n = 1;
  for (int d = 2; d < x.rank(); ++d) n *= x.dim(d);
  return n;
}

absl::Status CheckSequenceTensor(const Tensor& x, absl::string_view what) {
  if (!x.defined() || x.rank() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": sequence parallelism takes tensors of [batch, positions, ...], got ",
                     x.defined() ? x.ShapeString() : std::string("none")));
  }
  return absl::OkStatus();
}

// Copies `blocks` runs of `block` elements between the sequence-major layout ([B, t, block]: each
// sequence's t ranks' positions in turn) and the rank-major one ([t, B, block]: each rank's
// positions of every sequence in turn, what the collectives exchange), on the tensors' device.
absl::Status Regroup(const LayerContext& ctx, const Tensor& from, Tensor& to, int64_t B, int t,
                     int64_t block, bool to_rank_major) {
  const ops::Exec e = ops::ExecOf(ctx);
  for (int r = 0; r < t; ++r) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t seq = (b * t + r) * block, rank = (r * B + b) * block;
      PW_ASSIGN_OR_RETURN(Tensor src, from.View(to_rank_major ? seq : rank, {block}));
      PW_ASSIGN_OR_RETURN(Tensor dst, to.View(to_rank_major ? rank : seq, {block}));
      PW_RETURN_IF_ERROR(ops::Copy(e, src, dst));
    }
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<Tensor> SequenceAllGather(const LayerContext& ctx, const Tensor& x,
                                         absl::string_view what) {
  if (!SequenceParallel(ctx)) return x;
  PW_RETURN_IF_ERROR(CheckSequenceTensor(x, what));
  const int t = ctx.tp->size;
  Tensor all = Tensor::Empty({t * x.numel()}, x.dtype(), AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(TensorParallelAllGather(ctx, x, all, what));
  std::vector<int64_t> shape = x.shape();
  shape[1] *= t;
  Tensor out = Tensor::Empty(shape, x.dtype(), AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(
      Regroup(ctx, all, out, x.dim(0), t, x.dim(1) * PerPosition(x), /*to_rank_major=*/false));
  return out;
}

absl::StatusOr<Tensor> SequenceReduceScatter(const LayerContext& ctx, const Tensor& y,
                                             absl::string_view what) {
  if (!SequenceParallel(ctx)) return y;
  PW_RETURN_IF_ERROR(CheckSequenceTensor(y, what));
  const int t = ctx.tp->size;
  if (y.dim(1) % t != 0 || y.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d positions do not split over %d tensor-parallel ranks", what, y.dim(1), t));
  }
  const int64_t part = y.dim(1) / t;
  // Rank r's positions of every sequence, contiguous, in rank order: the chunks ReduceScatter
  // hands out.
  Tensor grouped = Tensor::Empty({y.numel()}, DType::kF32, AllocatorOf(ctx));
  PW_RETURN_IF_ERROR(
      Regroup(ctx, y, grouped, y.dim(0), t, part * PerPosition(y), /*to_rank_major=*/true));
  std::vector<int64_t> shape = y.shape();
  shape[1] = part;
  Tensor out = Tensor::Empty(shape, DType::kF32, AllocatorOf(ctx));
  const absl::Time posted = absl::Now();
  std::unique_ptr<Work> w = ctx.tp->comm->ReduceScatter(grouped, out);
  PW_RETURN_IF_ERROR(Finish(ctx, *w, what, posted));
  return out;
}

absl::Status CheckTensorParallelCall(const LayerContext& ctx, int rank, int size,
                                     absl::string_view what) {
  if (size == 1) return absl::OkStatus();
  if (ctx.tp == nullptr || ctx.tp->comm == nullptr || ctx.tp->size != size ||
      ctx.tp->rank != rank) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: built as tensor-parallel part %d of %d, but called %s", what, rank, size,
        ctx.tp == nullptr
            ? std::string("without a tensor-parallel group (LayerContext::tp)")
            : absl::StrFormat("as rank %d of a group of %d", ctx.tp->rank, ctx.tp->size)));
  }
  return absl::OkStatus();
}

std::vector<int64_t> EqualSections(int64_t size, int64_t groups) {
  if (groups <= 1) return {};
  return std::vector<int64_t>(static_cast<size_t>(groups), size / groups);
}

absl::StatusOr<TensorShard> ShardOf(const InitContext& init, const std::vector<int64_t>& shape,
                                    int axis, int64_t groups, absl::string_view what) {
  if (init.tp_size == 1) return TensorShard{};
  if (axis < 0 || axis >= static_cast<int>(shape.size()) || groups < 1) {
    return absl::InternalError(absl::StrCat(what, ": no axis ", axis, " to split"));
  }
  if (shape[axis] % groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: dimension %d of [%s] is not %d equal blocks", what, axis,
                        absl::StrJoin(shape, ", "), groups));
  }
  return ShardOf(init, shape, axis, EqualSections(shape[axis], groups), what);
}

absl::StatusOr<TensorShard> ShardOf(const InitContext& init, const std::vector<int64_t>& shape,
                                    int axis, const std::vector<int64_t>& sections,
                                    absl::string_view what) {
  TensorShard s;
  if (init.tp_size == 1) return s;
  if (axis < 0 || axis >= static_cast<int>(shape.size())) {
    return absl::InternalError(absl::StrCat(what, ": no axis ", axis, " to split"));
  }
  const std::vector<int64_t> whole =
      sections.empty() ? std::vector<int64_t>{shape[axis]} : sections;
  if (!SectionsFit(whole, shape[axis], init.tp_size)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: a tensor-parallel size of %d does not divide %s%s (dimension %d of [%s]) into "
        "equal parts",
        what, init.tp_size, whole.size() > 1 ? "each of its sections " : "",
        absl::StrJoin(whole, " + "), axis, absl::StrJoin(shape, ", ")));
  }
  s.axis = axis;
  s.parts = init.tp_size;
  s.index = init.tp_rank;
  if (whole.size() > 1) s.sections = whole;
  return s;
}

std::vector<int64_t> PartShape(std::vector<int64_t> shape, const TensorShard& shard) {
  if (shard.sharded()) shape[shard.axis] /= shard.parts;
  return shape;
}

std::vector<int64_t> WholeShape(const Parameter& p) {
  std::vector<int64_t> shape = p.value.shape();
  if (p.shard.sharded()) shape[p.shard.axis] *= p.shard.parts;
  return shape;
}

int64_t WholeIndex(const TensorShard& shard, const std::vector<int64_t>& part_shape, int64_t i) {
  if (!shard.sharded()) return i;
  const AxisSplit a = SplitAt(part_shape, shard.axis);
  const int64_t in = i % a.inner, along = i / a.inner % a.along, o = i / a.inner / a.along;
  const int64_t whole_along = a.along * shard.parts;
  int64_t at_part = 0, at_whole = 0, piece = a.along;
  for (const int64_t section : SectionsOf(shard, whole_along)) {
    piece = section / shard.parts;
    if (along < at_part + piece) break;
    at_part += piece;
    at_whole += section;
  }
  const int64_t j = at_whole + shard.index * piece + (along - at_part);
  return (o * whole_along + j) * a.inner + in;
}

Parameter MakeShardedParameter(const InitContext& init, const std::string& local,
                               const std::vector<int64_t>& shape, bool weight_decay,
                               const TensorShard& shard) {
  Parameter p = MakeParameter(init, local, PartShape(shape, shard), weight_decay);
  p.shard = shard;
  return p;
}

absl::StatusOr<Tensor> SlicePart(const Tensor& whole, const TensorShard& shard) {
  PW_RETURN_IF_ERROR(CheckHostF32(whole, "SlicePart"));
  if (!shard.sharded()) return whole.Clone();
  if (shard.axis >= whole.rank() ||
      !SectionsFit(SectionsOf(shard, whole.dim(shard.axis)), whole.dim(shard.axis), shard.parts)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a tensor of shape %s has no part %d of %d along dimension %d",
                        whole.ShapeString(), shard.index, shard.parts, shard.axis));
  }
  const std::vector<int64_t> part_shape = PartShape(whole.shape(), shard);
  Tensor part = Tensor::Empty(part_shape, DType::kF32);
  CopyPart(const_cast<float*>(whole.data<float>()), part.data<float>(), part_shape, shard,
           /*to_part=*/true);
  return part;
}

absl::StatusOr<Tensor> MergeParts(const std::vector<Tensor>& parts, const TensorShard& shard) {
  if (parts.empty()) return absl::InvalidArgumentError("MergeParts: no parts");
  if (!shard.sharded()) return parts[0].Clone();
  if (static_cast<int>(parts.size()) != shard.parts) {
    return absl::InvalidArgumentError(
        absl::StrFormat("MergeParts: %d parts of a tensor split in %d", parts.size(), shard.parts));
  }
  const std::vector<int64_t> part_shape = parts[0].shape();
  std::vector<int64_t> whole_shape = part_shape;
  whole_shape[shard.axis] *= shard.parts;
  Tensor whole = Tensor::Empty(whole_shape, DType::kF32);
  for (int r = 0; r < shard.parts; ++r) {
    PW_RETURN_IF_ERROR(CheckHostF32(parts[r], "MergeParts"));
    if (parts[r].shape() != part_shape) {
      return absl::InvalidArgumentError(absl::StrFormat("MergeParts: part %d is %s, part 0 %s", r,
                                                        parts[r].ShapeString(),
                                                        parts[0].ShapeString()));
    }
    TensorShard s = shard;
    s.index = r;
    CopyPart(whole.data<float>(), const_cast<float*>(parts[r].data<float>()), part_shape, s,
             /*to_part=*/false);
  }
  return whole;
}

namespace layers {

namespace {
class ParallelLinearSpec final : public LayerSpec {
 public:
  ParallelLinearSpec(internal::LinearLayer::Parallel parallel, int64_t in, int64_t out, bool bias,
                     int64_t groups, float std)
      : parallel_(parallel),
        in_(in),
        out_(out),
        bias_(bias),
        groups_(groups),
        std_(std),
        whole_(Linear(in, out, bias)) {}
  std::string kind() const override {
    return parallel_ == internal::LinearLayer::Parallel::kColumn ? "column_parallel_linear"
                                                                 : "row_parallel_linear";
  }
  // The whole layer's cost, a Linear's (the planner divides by the tensor-parallel size).
  Cost GetCost(const MicroBatchShape& shape, int64_t input_bytes) const override {
    return whole_->GetCost(shape, input_bytes);
  }
  std::string Config() const override {
    return absl::StrFormat("in=%d,out=%d,bias=%d,groups=%d", in_, out_, bias_ ? 1 : 0, groups_);
  }
  absl::StatusOr<std::unique_ptr<Layer>> Create(const InitContext& init) const override {
    PW_RETURN_IF_ERROR(
        internal::LinearLayer::CheckSplit(init, in_, out_, parallel_, Sections(), init.name));
    return std::make_unique<internal::LinearLayer>(init, in_, out_, bias_, std_,
                                                   internal::LinearLayer::Activation::kNone, "",
                                                   parallel_, Sections());
  }
  // A column-parallel layer's output is its rank's part ([.., out / tp]) when it runs
  // tensor-parallel; as a node of a graph (tp = 1) both are plain Linear layers.
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& input) const override {
    return input.empty() ? input : internal::WithLastDim(input, out_);
  }

 private:
  internal::LinearLayer::Parallel parallel_;
  int64_t in_, out_;
  bool bias_;
  std::vector<int64_t> Sections() const { return EqualSections(out_, groups_); }
  int64_t groups_;
  float std_;
  LayerSpecPtr whole_;  // the same layer at tp 1
};
}  // namespace

LayerSpecPtr ColumnParallelLinear(int64_t in, int64_t out, bool bias, int64_t groups, float std) {
  PW_CHECK(in > 0 && out > 0 && groups > 0 && out % groups == 0);
  return std::make_shared<ParallelLinearSpec>(internal::LinearLayer::Parallel::kColumn, in, out,
                                              bias, groups, std);
}

LayerSpecPtr RowParallelLinear(int64_t in, int64_t out, bool bias, float std) {
  PW_CHECK(in > 0 && out > 0);
  return std::make_shared<ParallelLinearSpec>(internal::LinearLayer::Parallel::kRow, in, out, bias,
                                              1, std);
}

}  // namespace layers
}  // namespace pipewright
