// Tensor parallelism in the cost model: one device's share of every layer of a GPT, and the
// collectives that the split adds (partitioner.h: CheckTensorParallel, ShardForTensorParallel;
// docs/memory.md, "Tensor parallelism").
//
// Note [Tensor-parallel costs]. The layer graph's costs are per layer, not per tensor, so the
// split is applied to each layer kind of a GPT with the TransformerShape's dimensions (n = b x s
// tokens of a micro-batch, h hidden, a heads, V vocabulary, t = tp), Megatron-LM style:
//
//  * transformer_block: q/k/v and the first MLP product split column-wise (with their biases),
//    the attention output and second MLP products row-wise (their biases replicated), so of the
//    block's 12h^2 + 13h parameters the 6h of the two LayerNorms and two row-parallel biases
//    stay whole and the rest is divided by t. FLOPs are divided by t except the LayerNorms' and
//    residual adds' (18nh forward, 30nh backward), which every device repeats unless
//    sequence parallelism splits them too. Saved bytes: the cost model's block keeps 64nh + 16n
//    + 4an bytes (fp32, no dropout: docs/memory.md, "Selective recomputation"); of those the
//    LayerNorm inputs and outputs (16nh) and statistics (16n) are whole on every device and the
//    rest (q, k, v, the attention output, the MLP's two hidden-size tensors: 48nh, and the
//    per-head log-sum-exp 4an) is split. That is Korthikanti et al. 2022's sbh(10 + 24/t +
//    5as/(ht)) in this model's terms (their 2-byte activations and 1-byte dropout masks become
//    4-byte activations and no masks; their 5as^2b softmax bytes are the flash attention's 4an).
//    With sequence parallelism everything is split: sbh(34/t + 5as/(ht)). The layer's own
//    activation_bytes is scaled by these shares, so calibrated costs keep their calibration.
//    Selective recomputation's 24nh (the LayerNorm outputs, 8nh, whole without SP; the GELU
//    output, 16nh, split) follows the same rule. Collectives: one all-reduce of the [b, s, h]
//    activation per sub-layer forward and one backward, 2 + 2; with sequence parallelism each
//    becomes an all-gather and a reduce-scatter, the same bytes on a ring, and the backward of
//    each column-parallel product gathers its saved input rows once more for its weight
//    gradient (the runtime keeps only the rank's rows, Note [Sequence parallelism] in
//    pipewright/tensor_parallel.h): two all-gathers more per block backward. The block's output
//    (what a stage boundary sends) is split only with sequence parallelism.
//  * llama_block (f = ffn, k = kv_heads, d = h / a): the same collectives as transformer_block.
//    Of its 2h + h(h + 2kd) + h^2 + 3hf parameters the two RMSNorm weights (2h) are whole, the
//    bias-free products split (qkv in its q, k and v sections, gate_up in its two). FLOPs whole
//    on every device without SP: the RMSNorms' and residual adds' 10nh forward and 18nh
//    backward. Saved: 4(8nh + 2n + an + 3nf) bytes (the norms' inputs and statistics 8nh + 8n,
//    the norm outputs the qkv and gate_up keep 8nh: whole without SP; the expanded qkv, the
//    log-sum-exp, o_proj's input, the SwiGLU's input and down_proj's: split). Selective
//    recomputation's 4(2nh + nf): the norm outputs (whole without SP) and the SwiGLU output
//    (split); its FLOPs 8nh (whole without SP) + 6nf.
//  * embedding (vocabulary-parallel): the V x h token table is split, the s x h position table
//    stays whole; one all-reduce of [b, s, h] forward (with SP a reduce-scatter forward and an
//    all-gather backward). token_embedding (a Llama's, no positions) likewise, all of it split.
//  * layernorm, rmsnorm (the final one): whole, or split along the sequence with SP.
//  * lm_head (vocabulary-parallel, column-parallel on V): weights, FLOPs and logits divided by
//    t; its saved input is whole without SP. Backward all-reduces its input gradient (with SP:
//    an all-gather forward, and a reduce-scatter and the input's all-gather again backward).
//  * cross_entropy (vocabulary-parallel): FLOPs and saved logits divided by t; three all-reduces
//    of n floats forward (the row max, the sum of exponentials and the target's logit).
//  * any other kind stays whole on every device (a conservative default).
//
// Collective bytes are the cost model's own fp32 activation sizes (4nh), like its P2P
// messages; a bf16 run's Megatron moves half of that. Collectives are not overlapped with
// compute (Megatron-LM's default without --tp-comm-overlap). Measured layer times (profiles,
// calibration) are scaled by the FLOP ratio.
#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "partitioner/partition_internal.h"
#include "pipewright/partitioner.h"
#include "pipewright/status.h"

namespace pipewright {
namespace {

constexpr double kF32 = 4;  // bytes of one element of the cost model's activations

// `replicated` of `total` stays whole on every device, the rest is split: replicated +
// ceil((total - replicated) / tp). A saturated count stays saturated.
int64_t SplitCount(int64_t total, int64_t replicated, int tp) {
  if (total == kMemoryOverflow) return total;
  replicated = std::clamp<int64_t>(replicated, 0, total);
  const int64_t rest = total - replicated;
  return replicated + rest / tp + (rest % tp != 0);
}

double SplitReal(double total, double replicated, int tp) {
  replicated = std::clamp(replicated, 0.0, total);
  return replicated + (total - replicated) / tp;
}

// `bytes` of which the share `whole` stays on every device and the rest is split.
int64_t SplitShare(int64_t bytes, double whole, int tp) {
  if (bytes == kMemoryOverflow || bytes <= 0) return bytes;
  whole = std::clamp(whole, 0.0, 1.0);
  const double r = static_cast<double>(bytes) * (whole + (1 - whole) / tp);
  if (r >= 9e18) return bytes;  // beyond llround's exact range: keep the (larger) whole count
  return std::min(bytes, static_cast<int64_t>(std::llround(r)));
}

// A measured time scaled as the FLOPs it stands for.
void ScaleTime(std::optional<double>& t, double flops_before, double flops_after) {
  if (t && flops_before > 0) *t *= flops_after / flops_before;
}

}  // namespace

std::string internal::TensorParallelShapeProblem(const TransformerShape& shape, int64_t tp) {
  const std::pair<const char*, int64_t> dims[] = {{"attention heads", shape.heads},
                                                  {"key-value heads", shape.KvHeads()},
                                                  {"hidden size", shape.hidden},
                                                  {"MLP hidden size", shape.ffn_hidden},
                                                  {"vocabulary entries", shape.vocab}};
  for (const auto& [what, n] : dims) {
    if (n < 1 || n % tp != 0) {
      return absl::StrCat("does not divide the model's ", n, " ", what);
    }
  }
  return "";
}

absl::Status CheckTensorParallel(const ModelCosts& model, const DeviceSpec& dev, int tp,
                                 bool sequence_parallel) {
  if (tp < 1) {
    return absl::InvalidArgumentError(absl::StrCat("PartitionOptions.tp = ", tp, ": must be >= 1"));
  }
  if (sequence_parallel && tp < 2) {
    return absl::InvalidArgumentError(
        "PartitionOptions.sequence_parallel splits activations along the sequence over the "
        "tensor-parallel group: it needs PartitionOptions.tp >= 2");
  }
  if (tp == 1) return absl::OkStatus();
  if (dev.devices_per_node < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceSpec.devices_per_node = ", dev.devices_per_node, ": must be >= 1"));
  }
  if (tp > dev.devices_per_node) {
    return absl::InvalidArgumentError(
        absl::StrCat("PartitionOptions.tp = ", tp, " is more than DeviceSpec.devices_per_node (",
                     dev.devices_per_node, "): a tensor-parallel group runs inside one node"));
  }
  if (!(dev.tp_bandwidth > 0) || !std::isfinite(dev.tp_bandwidth)) {
    return absl::InvalidArgumentError("DeviceSpec.tp_bandwidth must be finite and > 0");
  }
  if (!(dev.tp_latency_s >= 0) || !std::isfinite(dev.tp_latency_s)) {
    return absl::InvalidArgumentError("DeviceSpec.tp_latency_s must be finite and >= 0");
  }
  if (!model.transformer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PartitionOptions.tp = ", tp, ": the layer graph of ", model.name,
        " has no transformer shape (ModelCosts.transformer: heads, hidden size, vocabulary) to "
        "split, so it can be planned at tp 1 only"));
  }
  if (std::string problem = internal::TensorParallelShapeProblem(*model.transformer, tp);
      !problem.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("PartitionOptions.tp = ", tp, " ", problem));
  }
  if (sequence_parallel && model.seq_len % tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PartitionOptions.sequence_parallel splits the sequence over PartitionOptions.tp = ", tp,
        " devices, which does not divide the model's sequence length ", model.seq_len));
  }
  return absl::OkStatus();
}

double TensorParallelCollectiveSeconds(TpCollective kind, double bytes, int tp,
                                       const DeviceSpec& dev) {
  if (tp <= 1) return 0;
  // A ring reduce-scatter or all-gather: tp - 1 steps, each moving 1/tp of the buffer.
  const double steps = tp - 1;
  double seconds = steps / tp * bytes / dev.tp_bandwidth + steps * dev.tp_latency_s;
  if (kind == TpCollective::kAllReduce) seconds *= 2;  // a reduce-scatter, then an all-gather
  return seconds;
}

absl::StatusOr<TensorParallelCosts> ShardForTensorParallel(const ModelCosts& model,
                                                           const DeviceSpec& dev, int tp, bool sp) {
  PW_RETURN_IF_ERROR(CheckTensorParallel(model, dev, tp, sp));
  TensorParallelCosts out;
  out.rank = model;
  const size_t L = model.layers.size();
  out.forward_comm_s.assign(L, 0);
  out.backward_comm_s.assign(L, 0);
  if (tp == 1) return out;
  const TransformerShape& shape = *model.transformer;
  const double n = static_cast<double>(model.micro_batch_size) * static_cast<double>(model.seq_len);
  const double h = static_cast<double>(shape.hidden), a = static_cast<double>(shape.heads);
  const double vh = static_cast<double>(shape.vocab) * h;
  const double act = n * h * kF32;  // one [b, s, h] activation
  auto coll = [&](TpCollective kind, double bytes) {
    return TensorParallelCollectiveSeconds(kind, bytes, tp, dev);
  };
  // One sub-layer's reduction: an all-reduce, or under SP an all-gather and a reduce-scatter.
  const double sublayer =
      sp ? coll(TpCollective::kAllGather, act) + coll(TpCollective::kReduceScatter, act)
         : coll(TpCollective::kAllReduce, act);
  for (size_t i = 0; i < L; ++i) {
    const LayerCost& src = model.layers[i];
    LayerCost& c = out.rank.layers[i];
    double& fwd = out.forward_comm_s[i];
    double& bwd = out.backward_comm_s[i];
    if (src.kind == "transformer_block") {
      c.params = SplitCount(src.params, static_cast<int64_t>(6 * h), tp);
      // The largest group, the MLP's fc (4h^2 + 4h, split) or its projection (4h^2 split, its
      // bias whole): at most an h-element bias kept whole beside the split rest.
      if (src.largest_group_params > 0) {
        c.largest_group_params =
            std::min(c.params, SplitCount(src.largest_group_params, static_cast<int64_t>(h), tp));
      }
      c.forward_flops = SplitReal(src.forward_flops, sp ? 0 : 18 * n * h, tp);
      c.backward_flops = SplitReal(src.backward_flops, sp ? 0 : 30 * n * h, tp);
      const double saved = 64 * n * h + 16 * n + 4 * a * n;
      c.activation_bytes =
          SplitShare(src.activation_bytes, sp ? 0 : (16 * n * h + 16 * n) / saved, tp);
      c.selective_saving_bytes = SplitShare(src.selective_saving_bytes, sp ? 0 : 8.0 / 24, tp);
      c.selective_recompute_flops =
          SplitReal(src.selective_recompute_flops, sp ? 0 : 16 * n * h, tp);
      if (sp) c.output_bytes = SplitCount(src.output_bytes, 0, tp);
      fwd = 2 * sublayer;
      bwd = 2 * sublayer + (sp ? 2 * coll(TpCollective::kAllGather, act) : 0);
    } else if (src.kind == "llama_block") {
      const double f = static_cast<double>(shape.ffn_hidden);
      c.params = SplitCount(src.params, static_cast<int64_t>(2 * h), tp);
      if (src.largest_group_params > 0) {
        c.largest_group_params = std::min(c.params, SplitCount(src.largest_group_params, 0, tp));
      }
      c.forward_flops = SplitReal(src.forward_flops, sp ? 0 : 10 * n * h, tp);
      c.backward_flops = SplitReal(src.backward_flops, sp ? 0 : 18 * n * h, tp);
      const double saved = 8 * n * h + 2 * n + a * n + 3 * n * f;
      c.activation_bytes =
          SplitShare(src.activation_bytes, sp ? 0 : (4 * n * h + 2 * n) / saved, tp);
      c.selective_saving_bytes =
          SplitShare(src.selective_saving_bytes, sp ? 0 : 2 * h / (2 * h + f), tp);
      c.selective_recompute_flops =
          SplitReal(src.selective_recompute_flops, sp ? 0 : 8 * n * h, tp);
      if (sp) c.output_bytes = SplitCount(src.output_bytes, 0, tp);
      fwd = 2 * sublayer;
      bwd = 2 * sublayer + (sp ? 2 * coll(TpCollective::kAllGather, act) : 0);
    } else if (src.kind == "embedding" || src.kind == "token_embedding") {
      const bool positions = src.kind == "embedding";
      c.params = SplitCount(src.params, positions ? src.params - static_cast<int64_t>(vh) : 0, tp);
      if (sp) {
        c.output_bytes = SplitCount(src.output_bytes, 0, tp);
        fwd = coll(TpCollective::kReduceScatter, act);
        bwd = coll(TpCollective::kAllGather, act);
      } else {
        fwd = coll(TpCollective::kAllReduce, act);
      }
    } else if (src.kind == "layernorm" || src.kind == "rmsnorm") {
      if (sp) {
        c.forward_flops = src.forward_flops / tp;
        c.backward_flops = src.backward_flops / tp;
        c.activation_bytes = SplitCount(src.activation_bytes, 0, tp);
        c.output_bytes = SplitCount(src.output_bytes, 0, tp);
      }
    } else if (src.kind == "lm_head") {
      c.params = SplitCount(src.params, 0, tp);
      c.forward_flops = src.forward_flops / tp;
      c.backward_flops = src.backward_flops / tp;
      if (sp) c.activation_bytes = SplitCount(src.activation_bytes, 0, tp);
      c.output_bytes = SplitCount(src.output_bytes, 0, tp);
      fwd = sp ? coll(TpCollective::kAllGather, act) : 0;
      bwd = sp ? coll(TpCollective::kReduceScatter, act) + coll(TpCollective::kAllGather, act)
               : coll(TpCollective::kAllReduce, act);
    } else if (src.kind == "cross_entropy") {
      c.forward_flops = src.forward_flops / tp;
      c.backward_flops = src.backward_flops / tp;
      c.activation_bytes = SplitCount(src.activation_bytes, static_cast<int64_t>(n * 4), tp);
      fwd = 3 * coll(TpCollective::kAllReduce, n * kF32);
    }
    ScaleTime(c.forward_time_s, src.forward_flops, c.forward_flops);
    ScaleTime(c.backward_time_s, src.backward_flops, c.backward_flops);
  }
  return out;
}

}  // namespace pipewright
