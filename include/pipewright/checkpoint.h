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

#include <functional>
#include <map>
#include <optional>
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
  std::string path;  // the checkpoint directory read
  // What reading it skipped: damaged or unusable newer checkpoints, an unreadable `latest`
  // pointer, tensor files the manifest does not list (never read).
  std::vector<std::string> warnings;
};

// Atomically writes DIR (replacing an existing checkpoint there).
absl::Status WriteCheckpoint(const std::string& dir, const std::string& manifest_json,
                             const NamedTensors& model, const NamedTensors& optimizer,
                             const NamedTensors& grad_sync = {});
// An all-gather of one string per process, in process order (a launcher's processes).
using CheckpointExchange =
    std::function<absl::StatusOr<std::vector<std::string>>(const std::string& mine)>;
// One checkpoint written by several processes on a shared filesystem (Note [Collective
// checkpoints] in runtime/checkpoint.cc): each writes its `files` (file name -> tensors; the
// names differ between processes), the `root` process writes `manifest_json` with every file's
// digest last, then renames the directory into place as WriteCheckpoint does. Collective: every
// process calls it with the same `dir`; every process returns the same outcome.
absl::Status WriteCheckpointCollective(
    const std::string& dir, const std::string& manifest_json,
    const std::vector<std::pair<std::string, const NamedTensors*>>& files, bool root,
    const CheckpointExchange& exchange);

// A caller's test of a checkpoint read (its model, its seed, ...): not OK makes ReadCheckpoint
// skip it like a damaged one.
using CheckpointCheck = std::function<absl::Status(const Checkpoint&)>;
// Reads a checkpoint: DIR itself when it has a manifest.json, else the newest checkpoint of the
// checkpoint directory DIR (the one DIR/latest names, then DIR/step-NNNNNN newest first, each
// step followed by the complete copies an interrupted save left of it) that verifies and passes
// `accept` (when given); each one skipped adds a warning naming the file and the mismatch, or
// `accept`'s reason. Files are verified against the manifest's SHA-256 digests before use (Note
// [Checkpoint digests]) and only the files the manifest lists are read. NotFound when DIR holds
// no checkpoint at all; with none usable, DataLoss listing every reason when all were damaged,
// else the code of the first reason `accept` gave.
absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir, Allocator* allocator = nullptr,
                                          const CheckpointCheck& accept = nullptr);

// ---- checkpoint directories (docs/checkpoint.md, "Periodic checkpoints") ----
// DIR/step-NNNNNN/ (one checkpoint per saved step, six digits or more) and DIR/latest (a line
// naming the newest complete one).
std::string StepCheckpointName(int64_t step);  // "step-000120"
// The directory ReadCheckpoint would try first: DIR itself, or the newest step checkpoint with a
// manifest (not verified). NotFound when DIR holds no checkpoint.
absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& dir);
// Writes step `step`'s checkpoint as DIR/step-NNNNNN with `write(path)` (which must write a
// complete checkpoint there atomically, as WriteCheckpoint does), then points DIR/latest at it
// (a temporary file, fsync'ed, renamed over, the directory fsync'ed), then removes all but the
// newest `keep` step checkpoints (keep <= 0: none). At every moment DIR holds a complete,
// loadable checkpoint once the first save has finished, even when step-NNNNNN already existed
// (Note [Replacing a checkpoint] in runtime/checkpoint.cc). FailedPrecondition when DIR is a
// single checkpoint. Under a launcher every process calls it (`write` is then collective) and
// only the `root` one updates the pointer and removes old checkpoints. The caller holds DIR's
// CheckpointLock (below).
absl::Status SaveCheckpointStep(const std::string& dir, int64_t step, int keep,
                                const std::function<absl::Status(const std::string&)>& write,
                                bool root = true);
// The text of the manifest of the checkpoint ResolveCheckpointDir(DIR) names (not verified:
// for defaults such as the seed before the checkpoint itself is read).
absl::StatusOr<std::string> ReadCheckpointManifest(const std::string& dir);
// Whether DIR holds anything a save writes (DIR/latest, a step-N entry, or a manifest.json),
// usable or not. A run that starts afresh refuses such a directory: its saves would replace
// those checkpoints.
bool HoldsCheckpoints(const std::string& dir);
struct RecoveryReport {
  std::vector<std::pair<std::string, std::string>> restored;  // (from, to)
  std::vector<std::string> removed;
};
// Cleans up after interrupted saves (docs/checkpoint.md, "What survives a kill"): for each
// checkpoint that DIR.tmp-* / DIR.old-* beside DIR or step-NNNNNN.tmp-* / .old-* inside it were
// left of, a complete copy (its digests verify; the newest write first) is put back where the
// checkpoint itself is missing or damaged; then the rest, step-NNNNNN.pruned-* and latest.tmp-*
// are removed. Call it only while holding DIR's CheckpointLock: a .tmp-* of a live writer would
// otherwise be taken for debris.
absl::StatusOr<RecoveryReport> RecoverInterruptedSaves(const std::string& dir);

// Note [Checkpoint lock]. The one writer of a checkpoint directory holds an exclusive advisory
// lock (flock) on DIR/.lock for as long as it may save, so a second run with the same --save
// fails at its start instead of removing the first's in-progress save as debris. The kernel
// releases the lock when the process ends, however it ends (SIGKILL included): no stale locks.
// Under a launcher the root process takes it (the others write only into the root's temporary
// directory). On a network filesystem it is as good as the filesystem's flock.
class CheckpointLock {
 public:
  // Creates DIR if needed and locks it. FailedPrecondition naming the holder (pid, host, since)
  // when another process, or another CheckpointLock of this one, holds it; InvalidArgument when
  // DIR cannot be created or written (an unwritable --save fails before any training).
  static absl::StatusOr<CheckpointLock> Acquire(const std::string& dir);
  CheckpointLock(CheckpointLock&& other) noexcept;
  CheckpointLock& operator=(CheckpointLock&& other) noexcept;
  CheckpointLock(const CheckpointLock&) = delete;
  CheckpointLock& operator=(const CheckpointLock&) = delete;
  ~CheckpointLock();  // releases it

 private:
  CheckpointLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};
// ---- Hugging Face interop (docs/checkpoint.md, "Hugging Face") ----
// Writes the GPT in `checkpoint` (any checkpoint eval reads) as a transformers GPT2LMHeadModel
// directory `out` (which must not exist or be empty): config.json (tie_word_embeddings as
// trained) and model.safetensors with Hugging Face's names and Conv1D [in, out] layouts.
// InvalidArgument for a model that is not a GPT.
absl::Status ExportHuggingFace(const std::string& checkpoint, const std::string& out);
// Reads a GPT-2 directory (config.json, model.safetensors; F32, BF16 or F16) into the GPT preset
// `preset` — same layers, width and heads; the vocabulary may be padded and the positions cut to
// the preset's; tied as config.json's tie_word_embeddings says — and writes a step-0 checkpoint
// `out` (which must not exist or be empty) that `train --resume` starts from, with the run seed
// `seed` (unset: the one an export recorded in config.json, else 1). InvalidArgument naming the
// field for a model this runtime does not compute.
absl::Status ImportHuggingFace(const std::string& in, const std::string& preset,
                               const std::string& out, std::optional<uint64_t> seed);

}  // namespace pipewright

#endif  // PIPEWRIGHT_CHECKPOINT_H_
