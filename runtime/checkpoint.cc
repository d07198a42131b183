// One checkpoint directory: written atomically (WriteCheckpoint, or by several processes
// together: WriteCheckpointCollective) with every file's digest, and read back verified
// (ReadOneCheckpoint). Directories of step checkpoints are checkpoint_dir.cc.
#include "pipewright/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "pipewright/input.h"
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

// Whether this process may swap directories with renameat2(RENAME_EXCHANGE): unless a test
// turns it off (PIPEWRIGHT_NO_RENAME_EXCHANGE=1, to exercise the fallback) — the filesystem may
// still refuse, which the caller handles.
bool UseRenameExchange() {
  const char* off = std::getenv("PIPEWRIGHT_NO_RENAME_EXCHANGE");
  return off == nullptr || std::string(off) != "1";
}

// Note [Replacing a checkpoint]. Puts the complete `tmp` at `target`. When `target` already
// holds a checkpoint (a step saved again after a resume from an older one) the two are swapped
// in one atomic renameat2(RENAME_EXCHANGE), so `target` names a complete checkpoint at every
// moment, and the old one, now at `tmp`, is removed after the parent's fsync. A filesystem
// without the exchange (NFS, some FUSE) gets two renames: the old checkpoint to `old`, then
// `tmp` to `target`. A kill between them leaves `target` missing, with two complete
// checkpoints at `old` and `tmp`: RecoverInterruptedSaves (checkpoint_dir.cc) puts the newer
// back, and readers look at both meanwhile, so no kill leaves zero complete checkpoints.
absl::Status CommitDir(const std::string& tmp, const fs::path& target, const std::string& old) {
  std::error_code ec;
  const std::string target_str = target.string();
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  auto fail = [&](absl::Status s) {
    fs::remove_all(tmp, ec);
    return s;
  };
  if (!fs::exists(target, ec)) {
    if (::rename(tmp.c_str(), target_str.c_str()) != 0) {
      return fail(ErrnoStatus(errno, "cannot rename checkpoint into place", target_str));
    }
    CrashPoint("checkpoint.renamed-into-place");
    return FsyncDir(parent.string());
  }
  if (UseRenameExchange() &&
      ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target_str.c_str(), RENAME_EXCHANGE) == 0) {
    CrashPoint("checkpoint.exchanged");
    PW_RETURN_IF_ERROR(FsyncDir(parent.string()));
    fs::remove_all(tmp, ec);  // the old checkpoint
    if (ec) {
      return absl::InternalError(absl::StrCat("checkpoint written, but cannot remove the old '",
                                              tmp, "': ", ec.message()));
    }
    return absl::OkStatus();
  }
  if (UseRenameExchange() && errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    return fail(ErrnoStatus(errno, "cannot swap the checkpoint into place", target_str));
  }
  fs::remove_all(old, ec);
  if (::rename(target_str.c_str(), old.c_str()) != 0) {
    return fail(ErrnoStatus(errno, "cannot move the old checkpoint aside", target_str));
  }
  CrashPoint("checkpoint.moved-aside");
  if (::rename(tmp.c_str(), target_str.c_str()) != 0) {
    absl::Status s = ErrnoStatus(errno, "cannot rename checkpoint into place", target_str);
    ::rename(old.c_str(), target_str.c_str());
    return fail(s);
  }
  CrashPoint("checkpoint.renamed-into-place");
  PW_RETURN_IF_ERROR(FsyncDir(parent.string()));
  fs::remove_all(old, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("checkpoint written, but cannot remove '", old, "': ", ec.message()));
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
  if (s.ok()) CrashPoint("checkpoint.tensors-written");
  if (s.ok()) s = WriteManifest(tmp, manifest_json, std::move(digests));
  if (s.ok()) CrashPoint("checkpoint.manifest-written");
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
    if (s.ok()) CrashPoint("checkpoint.tensors-written");
    if (s.ok()) s = WriteManifest(tmp, manifest_json, std::move(digests));
    if (s.ok()) CrashPoint("checkpoint.manifest-written");
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
// included. Only the files the manifest lists are read (Note [Listed files]). A checkpoint
// written before digests existed has neither and is read unverified.
//
// The files' digests as the manifest lists them (empty when it has no "files").
absl::StatusOr<std::map<std::string, FileDigest>> ListedFiles(const fs::path& root,
                                                              const std::string& manifest_text) {
  const std::string manifest_path = (root / "manifest.json").string();
  PW_RETURN_IF_ERROR(CheckJsonNesting(manifest_text, manifest_path));
  json m = json::parse(manifest_text, nullptr, false);
  std::map<std::string, FileDigest> out;
  if (m.is_discarded() || !m.is_object() || !m.contains("files")) return out;
  if (!m["files"].is_object()) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": \"files\" is not an object"));
  }
  for (const auto& [name, d] : m["files"].items()) {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
        !d.is_object() || !d.contains("sha256") || !d["sha256"].is_string() ||
        !d.contains("bytes") || !d["bytes"].is_number_unsigned() ||
        d["bytes"].get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": files[\"", name,
                                              "\"] is not {bytes, sha256} of a file here"));
    }
    out[name] = {d["bytes"].get<uint64_t>(), d["sha256"].get<std::string>()};
  }
  return out;
}

absl::Status VerifyDigests(const fs::path& root, const std::string& manifest_text,
                           const std::map<std::string, FileDigest>& files) {
  std::error_code ec;
  const std::string sums = (root / "manifest.json.sha256").string();
  if (fs::symlink_status(sums, ec).type() != fs::file_type::not_found) {
    PW_ASSIGN_OR_RETURN(std::string line,
                        ReadTextFile(sums, "manifest digest", kMaxDigestLineBytes));
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
  for (const auto& [name, want] : files) {
    const std::string path = (root / name).string();
    if (fs::symlink_status(path, ec).type() == fs::file_type::not_found) {
      return absl::DataLossError(absl::StrCat(path, ": listed in the manifest but missing"));
    }
    absl::StatusOr<FileDigest> actual = DigestFile(path, static_cast<int64_t>(want.bytes));
    if (!actual.ok()) {
      // A FIFO or a device where a tensor file should be is damage of the checkpoint.
      return absl::DataLossError(actual.status().message());
    }
    if (actual->sha256 != want.sha256) {
      return absl::DataLossError(absl::StrCat(path, ": SHA-256 mismatch (the manifest records ",
                                              want.sha256, ", the file hashes to ", actual->sha256,
                                              ")"));
    }
  }
  return absl::OkStatus();
}

// Whether `n` is a tensor file of `kind` ("model", "optimizer", "grad_sync"): KIND.safetensors
// (one process's checkpoint) or KIND-*.safetensors (a shard of a collective one: Note
// [Collective checkpoints]).
bool IsKindFile(const std::string& n, const std::string& kind) {
  return n == kind + ".safetensors" ||
         (absl::StartsWith(n, kind + "-") && absl::EndsWith(n, ".safetensors"));
}

// Note [Listed files]. The tensors of `kind` by name, from the files of that kind the manifest
// lists (`listed`; every file of the kind in the directory for a checkpoint without digests).
// A tensor file in the directory that the manifest does not list is never read: it was not
// verified, so it is only a warning. A name in two files is DataLoss.
absl::StatusOr<std::map<std::string, Tensor>> ReadShards(
    const fs::path& root, const std::string& kind, const std::map<std::string, FileDigest>& listed,
    Allocator* allocator, std::vector<std::string>* warnings) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    if (!IsKindFile(n, kind)) continue;
    if (listed.empty() || listed.count(n) > 0) {
      names.push_back(n);
    } else {
      warnings->push_back(absl::StrCat((root / n).string(),
                                       ": not listed in the manifest (not verified): ignored"));
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

absl::StatusOr<std::string> VerifyCheckpointFiles(const fs::path& root) {
  const std::string manifest_path = (root / "manifest.json").string();
  std::error_code ec;
  if (fs::symlink_status(manifest_path, ec).type() == fs::file_type::not_found) {
    return absl::NotFoundError(absl::StrCat("'", manifest_path, "' not found"));
  }
  PW_ASSIGN_OR_RETURN(std::string text,
                      ReadTextFile(manifest_path, "checkpoint manifest", kMaxJsonFileBytes));
  PW_ASSIGN_OR_RETURN(auto files, ListedFiles(root, text));
  PW_RETURN_IF_ERROR(VerifyDigests(root, text, files));
  return text;
}

absl::StatusOr<Checkpoint> ReadOneCheckpoint(const fs::path& root, Allocator* allocator) {
  std::error_code ec;
  Checkpoint ckpt;
  ckpt.path = root.string();
  PW_ASSIGN_OR_RETURN(ckpt.manifest_json, VerifyCheckpointFiles(root));
  PW_ASSIGN_OR_RETURN(auto listed, ListedFiles(root, ckpt.manifest_json));
  PW_ASSIGN_OR_RETURN(ckpt.model, ReadShards(root, "model", listed, allocator, &ckpt.warnings));
  if (ckpt.model.empty() && !fs::exists(root / "model.safetensors", ec)) {
    return absl::NotFoundError(
        absl::StrCat("'", (root / "model.safetensors").string(), "' not found"));
  }
  PW_ASSIGN_OR_RETURN(ckpt.optimizer,
                      ReadShards(root, "optimizer", listed, allocator, &ckpt.warnings));
  PW_ASSIGN_OR_RETURN(ckpt.grad_sync,
                      ReadShards(root, "grad_sync", listed, allocator, &ckpt.warnings));
  return ckpt;
}

}  // namespace internal
}  // namespace pipewright
