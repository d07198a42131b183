// Cost of one layer for one micro-batch: what the partitioner balances and the memory model
// adds up. All counts are for a micro-batch of shape (micro_batch_size, seq_len).
#ifndef PIPEWRIGHT_COST_H_
#define PIPEWRIGHT_COST_H_

#include <cstdint>

namespace pipewright {

struct MicroBatchShape {
  int64_t batch = 1;    // sequences per micro-batch
  int64_t seq_len = 1;  // tokens per sequence
  int64_t tokens() const { return batch * seq_len; }
};

struct Cost {
  int64_t params = 0;            // trainable parameters
  double forward_flops = 0;      // multiply-add = 2 FLOPs
  double backward_flops = 0;     // input + weight gradients
  int64_t activation_bytes = 0;  // bytes the layer saves between forward and backward
  int64_t output_bytes = 0;      // bytes of the layer's output (what a stage boundary sends)
  // Selective recomputation (--recompute selective, docs/memory.md): the part of
  // activation_bytes the layer then does not keep, and the forward FLOPs that remake it in the
  // backward. Zero for a layer without a selective mode.
  int64_t selective_saving_bytes = 0;
  double selective_recompute_flops = 0;
  // The parameters of the layer's largest gradient group (Note [Gradient groups] in
  // pipewright/layer.h: a leaf layer's, whose weight gradients are complete together); 0: the
  // whole layer is one group. Adding costs treats each part as its own group (the largest
  // wins), as a composite layer's children are.
  int64_t largest_group_params = 0;
  int64_t group_params() const { return largest_group_params > 0 ? largest_group_params : params; }

  Cost& operator+=(const Cost& o) {
    largest_group_params = group_params() > o.group_params() ? group_params() : o.group_params();
    params += o.params;
    forward_flops += o.forward_flops;
    backward_flops += o.backward_flops;
    activation_bytes += o.activation_bytes;
    selective_saving_bytes += o.selective_saving_bytes;
    selective_recompute_flops += o.selective_recompute_flops;
    output_bytes = o.output_bytes;  // a sequence's output is its last part's output
    return *this;
  }
};

}  // namespace pipewright

#endif  // PIPEWRIGHT_COST_H_
