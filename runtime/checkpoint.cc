// One checkpoint directory: written atomically (WriteCheckpoint, or by several processes
// together: WriteCheckpointCollective) with every file's digest, and read back verified
// (ReadOneCheckpoint). Directories of step checkpoints are checkpoint_dir.cc.
#include "pipewright/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "runtime/checkpoint_files.h"
#include "runtime/sha256.h"

namespace pipewright {

using namespace internal;  // NOLINT: the shared file helpers

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Creates the parent of `target` and a fresh, empty `tmp` beside it.
absl::Status MakeTempDir(const fs::path& target, const std::string& tmp) {
  std::error_code ec;
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("cannot create directory '", parent.string(), "': ", ec.message()));
    }
  }
  fs::remove_all(tmp, ec);
  if (::mkdir(tmp.c_str(), 0755) != 0) return ErrnoStatus(errno, "cannot create directory", tmp);
  return absl::OkStatus();
}

// Writes `files` into `tmp`, each fsync'ed; their digests into `digests` (name -> {bytes, sha256}).
absl::Status WriteTensorFiles(const std::string& tmp,
                              const std::vector<std::pair<std::string, const NamedTensors*>>& files,
                              json* digests) {
  for (const auto& [name, tensors] : files) {
    FileDigest d;
    PW_RETURN_IF_ERROR(WriteSafetensorsFile(tmp + "/" + name, *tensors, {}, &d));
    (*digests)[name] = {{"bytes", d.bytes}, {"sha256", d.sha256}};
  }
  return absl::OkStatus();
}

// The manifest with `digests` as its "files", then the manifest's own digest, then an fsync of
// `tmp` (Note [Checkpoint digests]).
absl::Status WriteManifest(const std::string& tmp, const std::string& manifest_json, json digests) {
  json manifest = json::parse(manifest_json, nullptr, false);
  if (manifest.is_discarded() || !manifest.is_object()) {
    return absl::InvalidArgumentError("WriteCheckpoint: the manifest is not a JSON object");
  }
  manifest["files"] = std::move(digests);
  const std::string text = manifest.dump(2);
  PW_RETURN_IF_ERROR(WriteFileSynced(tmp + "/manifest.json", {{text.data(), text.size()}}));
  const std::string line = absl::StrCat(Sha256Hex(text), "  manifest.json\n");
  PW_RETURN_IF_ERROR(WriteFileSynced(tmp + "/manifest.json.sha256", {{line.data(), line.size()}}));
  return FsyncDir(tmp);
}

// Renames the complete `tmp` over `target`: an existing checkpoint there is moved aside to
// `old` first and removed only after the rename and the parent's fsync.
absl::Status CommitDir(const std::string& tmp, const fs::path& target, const std::string& old) {
  std::error_code ec;
  const std::string target_str = target.string();
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  bool had_old = false;
  if (fs::exists(target, ec)) {
    fs::remove_all(old, ec);
    if (::rename(target_str.c_str(), old.c_str()) != 0) {
      absl::Status s = ErrnoStatus(errno, "cannot move the old checkpoint aside", target_str);
      fs::remove_all(tmp, ec);
      return s;
    }
    had_old = true;
  }
  if (::rename(tmp.c_str(), target_str.c_str()) != 0) {
    absl::Status s = ErrnoStatus(errno, "cannot rename checkpoint into place", target_str);
    if (had_old) ::rename(old.c_str(), target_str.c_str());
    fs::remove_all(tmp, ec);
    return s;
  }
  PW_RETURN_IF_ERROR(FsyncDir(parent.string()));
  if (had_old) {
    fs::remove_all(old, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat("checkpoint written, but cannot remove '", old, "': ", ec.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteCheckpoint(const std::string& dir, const std::string& manifest_json,
                             const NamedTensors& model, const NamedTensors& optimizer,
                             const NamedTensors& grad_sync) {
  static std::atomic<uint64_t> counter{0};
  const fs::path target = NormalizeDir(dir);
  const std::string pid = std::to_string(static_cast<long>(::getpid()));
  const std::string tmp = absl::StrCat(target.string(), ".tmp-", pid, "-", counter.fetch_add(1));
  PW_RETURN_IF_ERROR(MakeTempDir(target, tmp));
  std::vector<std::pair<std::string, const NamedTensors*>> files = {
      {"model.safetensors", &model}, {"optimizer.safetensors", &optimizer}};
  if (!grad_sync.empty()) files.emplace_back("grad_sync.safetensors", &grad_sync);
  json digests = json::object();
  absl::Status s = WriteTensorFiles(tmp, files, &digests);
  if (s.ok()) s = WriteManifest(tmp, manifest_json, std::move(digests));
  if (!s.ok()) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    return s;
  }
  return CommitDir(tmp, target, absl::StrCat(target.string(), ".old-", pid));
}

// Note [Collective checkpoints]. Under a launcher each process holds only its own ranks, so each
// writes its own files into one shared temporary directory (DIR.tmp-shared: the same name in
// every process, created fresh by the root before anyone writes), and the root writes the
// manifest, with every process's digests, only after all of them report their files durable;
// then it renames the directory into place exactly as WriteCheckpoint does. Three exchanges
// order it: the directory exists; every file is written (or which process failed and why); the
// commit's outcome, so every process returns the same status. A crash at any point leaves the
// old checkpoint and DIR.tmp-shared debris, which RemoveCheckpointDebris clears.
absl::Status WriteCheckpointCollective(
    const std::string& dir, const std::string& manifest_json,
    const std::vector<std::pair<std::string, const NamedTensors*>>& files, bool root,
    const CheckpointExchange& exchange) {
  const fs::path target = NormalizeDir(dir);
  const std::string tmp = target.string() + ".tmp-shared";
  // 1: the root makes the directory; everyone learns whether it could.
  std::string made = "ok";
  if (root) {
    absl::Status s = MakeTempDir(target, tmp);
    if (!s.ok()) made = std::string(s.message());
  }
  PW_ASSIGN_OR_RETURN(std::vector<std::string> step1, exchange(made));
  for (const std::string& m : step1) {
    if (m != "ok") return absl::InternalError(absl::StrCat("checkpoint '", dir, "': ", m));
  }
  // 2: every process writes its files; the root gathers the digests (or the errors).
  json mine = json::object();
  absl::Status wrote = WriteTensorFiles(tmp, files, &mine);
  const std::string report = wrote.ok() ? mine.dump() : "error: " + std::string(wrote.message());
  PW_ASSIGN_OR_RETURN(std::vector<std::string> reports, exchange(report));
  // 3: the root writes the manifest and commits; everyone learns the outcome.
  std::string outcome = "ok";
  if (root) {
    absl::Status s = absl::OkStatus();
    json digests = json::object();
    for (size_t p = 0; p < reports.size() && s.ok(); ++p) {
      if (absl::StartsWith(reports[p], "error: ")) {
        s = absl::InternalError(absl::StrCat("process ", p, ": ", reports[p].substr(7)));
        break;
      }
      json d = json::parse(reports[p], nullptr, false);
      for (const auto& [name, v] : d.items()) {
        if (digests.contains(name)) {
          s = absl::InternalError(absl::StrCat("two processes wrote '", name, "'"));
          break;
        }
        digests[name] = v;
      }
    }
    if (s.ok()) s = WriteManifest(tmp, manifest_json, std::move(digests));
    if (s.ok()) {
      s = CommitDir(tmp, target,
                    absl::StrCat(target.string(), ".old-", static_cast<long>(::getpid())));
    } else {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
    if (!s.ok()) outcome = std::string(s.message());
  }
  PW_ASSIGN_OR_RETURN(std::vector<std::string> outcomes, exchange(outcome));
  if (!wrote.ok()) return wrote;
  for (const std::string& o : outcomes) {
    if (o != "ok") return absl::InternalError(absl::StrCat("checkpoint '", dir, "': ", o));
  }
  return absl::OkStatus();
}

namespace {

// Note [Checkpoint digests]. WriteCheckpoint records each tensor file's size and SHA-256 in the
// manifest ("files") and the manifest's own SHA-256 in manifest.json.sha256 (sha256sum's
// format, so `sha256sum -c` checks it too). Reading verifies both before any tensor is used: a
// flipped byte anywhere in a checkpoint is a DataLoss error naming the file, both digests
// included. A checkpoint written before digests existed has neither and is read unverified.
absl::Status VerifyDigests(const fs::path& root, const std::string& manifest_text) {
  std::error_code ec;
  const std::string sums = (root / "manifest.json.sha256").string();
  if (fs::exists(sums, ec)) {
    PW_ASSIGN_OR_RETURN(std::string line, ReadTextFile(sums));
    const std::string actual = Sha256Hex(manifest_text);
    if (line.size() < 64 || line.compare(0, 64, actual) != 0) {
      return absl::DataLossError(absl::StrCat(
          (root / "manifest.json").string(), ": SHA-256 mismatch (manifest.json.sha256 records ",
          line.substr(0, std::min<size_t>(64, line.size())), ", the file hashes to ", actual, ")"));
    }
    if (line != absl::StrCat(actual, "  manifest.json\n")) {
      return absl::DataLossError(
          absl::StrCat(sums, ": not the line \"<sha256>  manifest.json\" WriteCheckpoint writes"));
    }
  }
  json m = json::parse(manifest_text, nullptr, false);
  if (m.is_discarded() || !m.is_object() || !m.contains("files")) return absl::OkStatus();
  if (!m["files"].is_object()) {
    return absl::DataLossError(
        absl::StrCat((root / "manifest.json").string(), ": \"files\" is not an object"));
  }
  for (const auto& [name, d] : m["files"].items()) {
    const std::string path = (root / name).string();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
        !d.is_object() || !d.contains("sha256") || !d["sha256"].is_string() ||
        !d.contains("bytes") || !d["bytes"].is_number_unsigned()) {
      return absl::DataLossError(absl::StrCat((root / "manifest.json").string(), ": files[\"", name,
                                              "\"] is not {bytes, sha256} of a file here"));
    }
    if (!fs::exists(path, ec)) {
      return absl::DataLossError(absl::StrCat(path, ": listed in the manifest but missing"));
    }
    PW_ASSIGN_OR_RETURN(FileDigest actual, DigestFile(path));
    const uint64_t bytes = d["bytes"].get<uint64_t>();
    const std::string sha = d["sha256"].get<std::string>();
    if (actual.bytes != bytes) {
      return absl::DataLossError(
          absl::StrCat(path, ": ", actual.bytes, " bytes, the manifest records ", bytes));
    }
    if (actual.sha256 != sha) {
      return absl::DataLossError(absl::StrCat(path, ": SHA-256 mismatch (the manifest records ",
                                              sha, ", the file hashes to ", actual.sha256, ")"));
    }
  }
  return absl::OkStatus();
}

// The tensors of `kind` ("model", "optimizer", "grad_sync") by name, from KIND.safetensors (one
// process's checkpoint) and every KIND-*.safetensors (the shards of a collective one: Note
// [Collective checkpoints]); empty when there is none. A name in two files is DataLoss.
absl::StatusOr<std::map<std::string, Tensor>> ReadShards(const fs::path& root,
                                                         const std::string& kind,
                                                         Allocator* allocator) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (n == kind + ".safetensors" ||
        (absl::StartsWith(n, kind + "-") && absl::EndsWith(n, ".safetensors"))) {
      names.push_back(n);
    }
  }
  std::sort(names.begin(), names.end());
  std::map<std::string, Tensor> out;
  for (const std::string& n : names) {
    PW_ASSIGN_OR_RETURN(SafetensorsFile f, ReadSafetensors((root / n).string(), allocator));
    for (auto& [name, t] : f.tensors) {
      if (!out.emplace(name, std::move(t)).second) {
        return absl::DataLossError(absl::StrCat((root / n).string(), ": tensor '", name,
                                                "' is also in another ", kind, " file"));
      }
    }
  }
  return out;
}

}  // namespace

namespace internal {

absl::StatusOr<Checkpoint> ReadOneCheckpoint(const fs::path& root, Allocator* allocator) {
  std::error_code ec;
  const std::string manifest_path = (root / "manifest.json").string();
  if (!fs::exists(manifest_path, ec)) {
    return absl::NotFoundError(absl::StrCat("'", manifest_path, "' not found"));
  }
  Checkpoint ckpt;
  ckpt.path = root.string();
  PW_ASSIGN_OR_RETURN(ckpt.manifest_json, ReadTextFile(manifest_path));
  PW_RETURN_IF_ERROR(VerifyDigests(root, ckpt.manifest_json));
  PW_ASSIGN_OR_RETURN(ckpt.model, ReadShards(root, "model", allocator));
  if (ckpt.model.empty() && !fs::exists(root / "model.safetensors", ec)) {
    return absl::NotFoundError(
        absl::StrCat("'", (root / "model.safetensors").string(), "' not found"));
  }
  PW_ASSIGN_OR_RETURN(ckpt.optimizer, ReadShards(root, "optimizer", allocator));
  PW_ASSIGN_OR_RETURN(ckpt.grad_sync, ReadShards(root, "grad_sync", allocator));
  return ckpt;
}

}  // namespace internal
}  // namespace pipewright
