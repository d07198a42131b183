// Checkpoints: a directory with manifest.json and .safetensors files (docs/checkpoint.md).
//
//   DIR/manifest.json          {"format": "pipewright.checkpoint/v1", ...}  (caller's JSON text)
//   DIR/model.safetensors      parameters, global stable names ("blocks.3.attn.qkv.weight")
//   DIR/optimizer.safetensors  optimizer state ("exp_avg.<param>", "exp_avg_sq.<param>", ...)
//
// Writing is atomic: everything goes to a sibling temporary directory which is fsync'ed and
// renamed over DIR, so a crash leaves either the old checkpoint or the new one, never half.
#ifndef PIPEWRIGHT_CHECKPOINT_H_
#define PIPEWRIGHT_CHECKPOINT_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "pipewright/tensor.h"

namespace pipewright {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Writes one safetensors file (https://github.com/huggingface/safetensors format: u64 LE header
// length, JSON header with dtype/shape/data_offsets per tensor and optional "__metadata__"
// string map, then the raw little-endian data, 8-byte aligned header). Host tensors only.
// Names must be unique and non-empty.
absl::Status WriteSafetensors(const std::string& path, const NamedTensors& tensors,
                              const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};
// Reads and validates a safetensors file: header length within the file, JSON well-formed,
// known dtypes, offsets contiguous, in range and matching shape x dtype size. Any problem is
// an InvalidArgument / DataLoss error naming the file and the tensor.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path,
                                                Allocator* allocator = nullptr);

struct Checkpoint {
  std::string manifest_json;  // the text of manifest.json
  std::map<std::string, Tensor> model;
  std::map<std::string, Tensor> optimizer;
  // Every replica's gradient-compression state (grad_sync.safetensors; empty without it).
  std::map<std::string, Tensor> grad_sync;
};

// Atomically writes DIR (replacing an existing checkpoint there).
absl::Status WriteCheckpoint(const std::string& dir, const std::string& manifest_json,
                             const NamedTensors& model, const NamedTensors& optimizer,
                             const NamedTensors& grad_sync = {});
// Reads DIR; NotFound when DIR or manifest.json is missing.
absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir, Allocator* allocator = nullptr);

}  // namespace pipewright

#endif  // PIPEWRIGHT_CHECKPOINT_H_
