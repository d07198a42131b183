// Token generation (runtime/generate.h; Note [Sampling] in pipewright/train.h): sampling, and the
// two ways to the logits of each step, a KV cache (Note [Incremental decoding] in
// pipewright/layer.h) or the recompute of the whole window.
#include "runtime/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"

namespace pipewright::internal {
namespace {

// A uniform double in [0, 1) from 53 bits of a SplitMix64 stream: the same on every platform
// (std::uniform_real_distribution is not).
double Uniform(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

// The next token from one row of logits (Note [Sampling]).
int32_t Sample(const float* logits, int64_t vocab, const GenerateOptions& o, uint64_t* rng) {
  std::vector<int32_t> order(vocab);
  for (int64_t v = 0; v < vocab; ++v) order[v] = static_cast<int32_t>(v);
  // Highest first; ties by the smaller id, so the order is total and the result reproducible.
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  if (o.temperature == 0) return order[0];
  const int64_t k = o.top_k > 0 ? std::min(o.top_k, vocab) : vocab;
  std::vector<double> p(k);
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) {
    p[i] = std::exp((static_cast<double>(logits[order[i]]) - logits[order[0]]) / o.temperature);
    sum += p[i];
  }
  double u = Uniform(rng) * sum;
  for (int64_t i = 0; i < k; ++i) {
    if (u < p[i]) return order[i];
    u -= p[i];
  }
  return order[k - 1];
}

// Tokens [1, n] i32 holding `tokens`, on ctx's device.
absl::StatusOr<Tensor> TokenTensor(const std::vector<int32_t>& tokens, const LayerContext& ctx) {
  Tensor x = Tensor::Empty({1, static_cast<int64_t>(tokens.size())}, DType::kI32);
  std::copy(tokens.begin(), tokens.end(), x.data<int32_t>());
  if (ctx.allocator == nullptr || ctx.allocator->device().is_cpu()) return x;
  return x.CopyTo(ctx.allocator);
}

// The layers [0, n) of a stage decoded incrementally: one DecodeCache per layer.
class CachedLayers {
 public:
  // Their decoders, or nullopt when one of the layers has none.
  static std::optional<CachedLayers> Of(Stage& stage, int n) {
    CachedLayers c;
    for (int i = 0; i < n; ++i) {
      IncrementalDecoder* d = stage.layer(i).decoder();
      if (d == nullptr) return std::nullopt;
      c.decoders_.push_back(d);
    }
    c.caches_.resize(n);
    return c;
  }
  // Empties every cache for a new window of at most `capacity` positions, then runs `window` at
  // its positions 0, 1, ...: the logits [1, w, V].
  absl::StatusOr<Tensor> Prefill(const std::vector<int32_t>& window, int64_t capacity,
                                 const LayerContext& ctx) {
    for (size_t i = 0; i < decoders_.size(); ++i) {
      PW_RETURN_IF_ERROR(decoders_[i]->StartDecode(capacity, ctx, &caches_[i]));
    }
    return Append(window, ctx);
  }
  // Runs `tokens` at the next positions: their logits [1, n, V].
  absl::StatusOr<Tensor> Append(const std::vector<int32_t>& tokens, const LayerContext& ctx) {
    PW_ASSIGN_OR_RETURN(Tensor x, TokenTensor(tokens, ctx));
    for (size_t i = 0; i < decoders_.size(); ++i) {
      PW_ASSIGN_OR_RETURN(x, decoders_[i]->Decode(x, ctx, &caches_[i]));
    }
    return x;
  }
  int64_t length() const { return caches_.empty() ? 0 : caches_[0].length; }

 private:
  std::vector<IncrementalDecoder*> decoders_;
  std::vector<DecodeCache> caches_;
};

// The logits [1, w, V] of the whole window, every layer's Forward (the recompute path).
absl::StatusOr<Tensor> FullForward(Stage& stage, int num_layers, const std::vector<int32_t>& window,
                                   const LayerContext& ctx) {
  PW_ASSIGN_OR_RETURN(Tensor x, TokenTensor(window, ctx));
  for (int i = 0; i < num_layers; ++i) {
    Saved saved;
    PW_ASSIGN_OR_RETURN(x, stage.layer(i).Forward(x, ctx, &saved));
  }
  return x;
}

// The last min(n, size) of `tokens`.
std::vector<int32_t> Last(const std::vector<int32_t>& tokens, int64_t n) {
  const size_t w = static_cast<size_t>(std::min<int64_t>(n, static_cast<int64_t>(tokens.size())));
  return std::vector<int32_t>(tokens.end() - w, tokens.end());
}

}  // namespace

absl::Status CheckGenerateOptions(const GenerateOptions& o) {
  if (o.tokens < 0 || o.tokens > kMaxGenerateTokens) {
    return absl::InvalidArgumentError(absl::StrCat("GenerateOptions.tokens = ", o.tokens,
                                                   ": must be in [0, ", kMaxGenerateTokens, "]"));
  }
  if (!std::isfinite(o.temperature) || o.temperature < 0 || o.temperature > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("GenerateOptions.temperature = ", o.temperature, ": must be in [0, 100]"));
  }
  if (o.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("GenerateOptions.top_k = ", o.top_k, ": must be >= 0"));
  }
  if (!o.device.is_cpu() && !o.device.is_cuda()) {
    return absl::InvalidArgumentError("GenerateOptions.device: must be the CPU or a CUDA device");
  }
  if (o.device.index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("GenerateOptions.device = ", o.device.ToString(), ": a negative index"));
  }
  if (o.prompt.size() > static_cast<size_t>(kMaxGenerateTokens)) {
    return absl::InvalidArgumentError(absl::StrCat("GenerateOptions.prompt: ", o.prompt.size(),
                                                   " bytes, more than ", kMaxGenerateTokens));
  }
  return absl::OkStatus();
}

absl::Status Generate(Stage& stage, int num_layers, int64_t window, int64_t vocab,
                      const GenerateOptions& o, const std::function<void(const std::string&)>& emit,
                      GenerateResult* r, const GenerateObserver& observe, Allocator* allocator) {
  PW_RETURN_IF_ERROR(CheckGenerateOptions(o));
  if (num_layers < 1 || num_layers > stage.size() || window < 1 || vocab < 1) {
    return absl::InvalidArgumentError(absl::StrCat("Generate: ", num_layers, " layers of ",
                                                   stage.size(), ", window ", window, ", vocab ",
                                                   vocab, ": out of range"));
  }
  std::vector<int32_t> tokens;
  for (unsigned char c : o.prompt.empty() ? std::string("\n") : o.prompt) tokens.push_back(c);
  std::optional<CachedLayers> cached;
  if (o.kv_cache) cached = CachedLayers::Of(stage, num_layers);
  r->prompt = o.prompt;
  r->text.clear();
  r->kv_cache = cached.has_value();
  uint64_t rng = o.seed;
  const auto start = std::chrono::steady_clock::now();
  LayerContext ctx;
  ctx.allocator = allocator;  // the stage's device (null: the CPU)
  std::vector<int32_t> at;    // the window of the logits below: the tokens at positions 0, 1, ...
  Tensor logits;              // [1, at.size(), V]
  for (int64_t n = 0; n < o.tokens; ++n) {
    if (!cached) {  // the last T tokens, recomputed
      at = Last(tokens, window);
      PW_ASSIGN_OR_RETURN(logits, FullForward(stage, num_layers, at, ctx));
    } else if (n == 0) {  // the prefill of the prompt's last T tokens
      at = Last(tokens, window);
      PW_ASSIGN_OR_RETURN(logits, cached->Prefill(at, window, ctx));
    } else if (cached->length() == window) {  // full: keep the last T/2, the new token included
      at = Last(tokens, std::max<int64_t>(1, window / 2));
      PW_ASSIGN_OR_RETURN(logits, cached->Prefill(at, window, ctx));
    } else {  // one position: the token drawn last
      at.push_back(tokens.back());
      PW_ASSIGN_OR_RETURN(logits, cached->Append({tokens.back()}, ctx));
    }
    if (logits.rank() != 3 || logits.dim(0) != 1 || logits.dim(2) != vocab) {
      return absl::InternalError(absl::StrCat("Generate: logits ", logits.ShapeString(),
                                              " where [1, n, ", vocab, "] was expected"));
    }
    if (!logits.device().is_cpu()) {  // sampled on the host: only the last row is needed
      PW_ASSIGN_OR_RETURN(Tensor row, logits.View((logits.dim(1) - 1) * vocab, {1, 1, vocab}));
      PW_ASSIGN_OR_RETURN(logits, row.CopyTo(nullptr));
    }
    const float* last = logits.data<float>() + (logits.dim(1) - 1) * vocab;
    if (observe) observe(at, last, vocab);
    const int32_t next = Sample(last, vocab, o, &rng);
    tokens.push_back(next);
    const std::string piece(1, static_cast<char>(next < 256 ? next : '?'));
    r->text += piece;
    if (emit) emit(piece);
  }
  r->tokens = o.tokens;
  r->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return absl::OkStatus();
}

}  // namespace pipewright::internal
