#include "pipewright/data.h"

#include <algorithm>
#include <deque>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "runtime/random.h"

namespace pipewright {
namespace {

class TextDataset final : public TokenDataset {
 public:
  TextDataset(std::string path, std::string bytes, int64_t seq_len, uint64_t seed)
      : TokenDataset(seq_len), path_(std::move(path)), bytes_(std::move(bytes)), seed_(seed) {}
  std::string Describe() const override {
    return absl::StrCat("text:", path_, " (", bytes_.size(), " bytes)");
  }
  void Tokens(int64_t index, int64_t seq_len, int32_t* out) const override {
    uint64_t span = bytes_.size() - static_cast<uint64_t>(seq_len);  // > 1 (checked at open)
    uint64_t start = HashCombine(seed_ ^ 0x7465787400ull, static_cast<uint64_t>(index)) % span;
    for (int64_t t = 0; t <= seq_len; ++t) {
      out[t] = static_cast<uint8_t>(bytes_[start + t]);
    }
  }

 private:
  std::string path_, bytes_;
  uint64_t seed_;
};

class Synthetic final : public TokenDataset {
 public:
  Synthetic(int64_t seq_len, uint64_t seed) : TokenDataset(seq_len), seed_(seed) {}
  std::string Describe() const override { return "synthetic (repeated patterns)"; }
  void Tokens(int64_t index, int64_t seq_len, int32_t* out) const override {
    uint64_t key = HashCombine(seed_ ^ 0x73796e00ull, static_cast<uint64_t>(index));
    int period = 2 + static_cast<int>(SplitMix64(key) % 7);
    int32_t pattern[8];
    for (int i = 0; i < period; ++i) {
      pattern[i] = 'a' + static_cast<int32_t>(HashCombine(key, i + 1) % 16);
    }
    for (int64_t t = 0; t <= seq_len; ++t) out[t] = pattern[t % period];
  }

 private:
  uint64_t seed_;
};

}  // namespace

SampleSpec TokenDataset::Spec() const {
  return SampleSpec{{seq_len_}, DType::kI32, {seq_len_}, DType::kI32};
}

void TokenDataset::Sample(int64_t index, void* input, void* target) const {
  std::vector<int32_t> tokens(seq_len_ + 1);
  Tokens(index, seq_len_, tokens.data());
  std::copy_n(tokens.data(), seq_len_, static_cast<int32_t*>(input));
  std::copy_n(tokens.data() + 1, seq_len_, static_cast<int32_t*>(target));
}

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenTextDataset(const std::string& path,
                                                              int64_t seq_len, uint64_t seed) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("data file '", path, "' cannot be opened"));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading data file '", path, "'"));
  if (static_cast<int64_t>(bytes.size()) < seq_len + 2) {
    return absl::InvalidArgumentError(absl::StrCat("data file '", path, "' has ", bytes.size(),
                                                   " bytes; a sample needs at least ",
                                                   seq_len + 2));
  }
  return std::make_unique<TextDataset>(path, std::move(bytes), seq_len, seed);
}

std::unique_ptr<TokenDataset> SyntheticDataset(int64_t seq_len, uint64_t seed) {
  return std::make_unique<Synthetic>(seq_len, seed);
}

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenDataset(absl::string_view spec, int64_t seq_len,
                                                          uint64_t seed) {
  if (spec == "synthetic") return SyntheticDataset(seq_len, seed);
  return OpenTextDataset(std::string(spec), seq_len, seed);
}

StepBatch MakeStepBatch(const Dataset& data, const BatchLayout& layout, int64_t step,
                        int64_t replica) {
  StepBatch batch;
  batch.step = step;
  const SampleSpec spec = data.Spec();
  const int64_t B = layout.micro_batch_size;
  std::vector<int64_t> in_shape = {B}, tg_shape = {B};
  in_shape.insert(in_shape.end(), spec.input_shape.begin(), spec.input_shape.end());
  tg_shape.insert(tg_shape.end(), spec.target_shape.begin(), spec.target_shape.end());
  for (int64_t j = 0; j < layout.micro_batches; ++j) {
    Tensor in = Tensor::Empty(in_shape, spec.input_dtype);
    Tensor tg = Tensor::Empty(tg_shape, spec.target_dtype);
    const size_t in_bytes = in.nbytes() / B, tg_bytes = tg.nbytes() / B;
    for (int64_t b = 0; b < B; ++b) {
      data.Sample(layout.SampleIndex(step, replica, j, b),
                  static_cast<char*>(in.raw()) + b * in_bytes,
                  static_cast<char*>(tg.raw()) + b * tg_bytes);
    }
    batch.inputs.push_back(std::move(in));
    batch.targets.push_back(std::move(tg));
  }
  return batch;
}

struct DataLoader::State {
  std::shared_ptr<const Dataset> data;
  BatchLayout layout;
  int64_t replica;
  int prefetch;
  absl::Mutex mu;
  std::deque<StepBatch> ready ABSL_GUARDED_BY(mu);
  int64_t next_step ABSL_GUARDED_BY(mu) = 0;
  bool stop ABSL_GUARDED_BY(mu) = false;
  absl::Duration waited ABSL_GUARDED_BY(mu);
  std::thread thread;

  void Run() {
    while (true) {
      int64_t step;
      {
        absl::MutexLock lock(&mu);
        auto room = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
          return stop || static_cast<int>(ready.size()) < prefetch;
        };
        mu.Await(absl::Condition(&room));
        if (stop) return;
        step = next_step++;
      }
      StepBatch b = MakeStepBatch(*data, layout, step, replica);
      absl::MutexLock lock(&mu);
      ready.push_back(std::move(b));
    }
  }
};

DataLoader::DataLoader(std::shared_ptr<const Dataset> data, BatchLayout layout, int64_t replica,
                       int64_t first_step, int prefetch)
    : state_(std::make_unique<State>()) {
  state_->data = std::move(data);
  state_->layout = layout;
  state_->replica = replica;
  state_->prefetch = std::max(1, prefetch);
  {
    absl::MutexLock lock(&state_->mu);
    state_->next_step = first_step;
  }
  state_->thread = std::thread([s = state_.get()] { s->Run(); });
}

DataLoader::~DataLoader() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;
  }
  state_->thread.join();
}

StepBatch DataLoader::Next() {
  absl::Time start = absl::Now();
  absl::MutexLock lock(&state_->mu);
  auto has = [s = state_.get()]() ABSL_SHARED_LOCKS_REQUIRED(s->mu) { return !s->ready.empty(); };
  state_->mu.Await(absl::Condition(&has));
  StepBatch b = std::move(state_->ready.front());
  state_->ready.pop_front();
  state_->waited += absl::Now() - start;
  return b;
}

absl::Duration DataLoader::wait_time() const {
  absl::MutexLock lock(&state_->mu);
  return state_->waited;
}

}  // namespace pipewright
