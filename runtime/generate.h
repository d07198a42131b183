// Token generation over an instantiated language model (internal): the loop of
// GenerateFromCheckpoint (train.h, Note [Sampling]) without the checkpoint, so tests can run it
// on any weights and watch each step.
#ifndef PIPEWRIGHT_RUNTIME_GENERATE_H_
#define PIPEWRIGHT_RUNTIME_GENERATE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "pipewright/model.h"
#include "pipewright/train.h"

namespace pipewright::internal {

// InvalidArgument naming the field of `o` out of range (GenerateOptions.tokens = -1: ...).
absl::Status CheckGenerateOptions(const GenerateOptions& o);

// One step of generation as it is sampled: the window (the tokens at the model's positions 0,
// 1, ...) and the logits at its last position (`vocab` floats, valid during the call).
using GenerateObserver =
    std::function<void(const std::vector<int32_t>& window, const float* logits, int64_t vocab)>;

// Generates o.tokens tokens after o.prompt with the layers [0, num_layers) of `stage` (tokens
// [1, w] i32 in, logits [1, w, vocab] f32 out), whose positions end at `window` (the model's
// seq_len), on `allocator`'s device (null: the CPU; the stage's parameters live there), as
// Note [Sampling] describes: with the KV cache when o.kv_cache and every
// one of those layers has a decoder, otherwise by recomputing the window per token. Fills r's
// prompt, text, tokens, seconds and kv_cache; `emit` (optional) receives each token's bytes,
// `observe` (optional) each step before its token is drawn.
absl::Status Generate(Stage& stage, int num_layers, int64_t window, int64_t vocab,
                      const GenerateOptions& o, const std::function<void(const std::string&)>& emit,
                      GenerateResult* r, const GenerateObserver& observe = nullptr,
                      Allocator* allocator = nullptr);

}  // namespace pipewright::internal

#endif  // PIPEWRIGHT_RUNTIME_GENERATE_H_
