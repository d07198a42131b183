// Directories of step checkpoints (docs/checkpoint.md, "Checkpoint directories"):
// DIR/step-NNNNNN/ and the DIR/latest pointer, saving with pruning, reading the newest verified
// checkpoint, and removing what interrupted saves left.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "pipewright/checkpoint.h"
#include "runtime/checkpoint_files.h"

namespace pipewright {

using namespace internal;  // NOLINT: the shared file helpers

namespace {

namespace fs = std::filesystem;

constexpr char kStepPrefix[] = "step-";
constexpr size_t kStepPrefixLen = sizeof(kStepPrefix) - 1;
constexpr char kLatest[] = "latest";

// The step of a "step-NNNNNN" name, or -1.
int64_t StepOf(const std::string& name) {
  if (name.size() <= kStepPrefixLen || name.compare(0, kStepPrefixLen, kStepPrefix) != 0) {
    return -1;
  }
  int64_t step = 0;
  for (size_t i = kStepPrefixLen; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (int64_t{1} << 50)) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// The step checkpoints in a checkpoint directory, newest first.
std::vector<std::pair<int64_t, fs::path>> StepCheckpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = StepOf(e.path().filename().string());
    if (step >= 0 && e.is_directory(ec)) out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// What DIR/latest names ("" when it is missing or does not name a step checkpoint).
std::string LatestName(const fs::path& root) {
  absl::StatusOr<std::string> text = ReadTextFile((root / kLatest).string());
  if (!text.ok()) return "";
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return StepOf(name) >= 0 ? name : "";
}

}  // namespace

std::string StepCheckpointName(int64_t step) {
  std::string digits = std::to_string(step);
  if (digits.size() < 6) digits.insert(0, 6 - digits.size(), '0');
  return absl::StrCat(kStepPrefix, digits);
}

namespace {

// The checkpoints DIR offers, in the order to try them: DIR itself when it has a manifest.json;
// else the step checkpoint DIR/latest names, then every step checkpoint, newest first.
absl::StatusOr<std::vector<fs::path>> CheckpointCandidates(const std::string& dir) {
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory '", dir, "' not found"));
  }
  if (fs::exists(root / "manifest.json", ec)) return std::vector<fs::path>{root};
  std::vector<fs::path> candidates;
  if (const std::string latest = LatestName(root); !latest.empty()) {
    candidates.push_back(root / latest);
  }
  for (const auto& [step, path] : StepCheckpoints(root)) {
    if (candidates.empty() || path != candidates.front()) candidates.push_back(path);
  }
  if (candidates.empty()) {
    return absl::NotFoundError(
        absl::StrCat("'", (root / "manifest.json").string(),
                     "' not found, and no step checkpoint (step-NNNNNN) in '", dir, "'"));
  }
  return candidates;
}

}  // namespace

absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& dir) {
  PW_ASSIGN_OR_RETURN(std::vector<fs::path> candidates, CheckpointCandidates(dir));
  std::error_code ec;
  for (const fs::path& c : candidates) {
    if (fs::exists(c / "manifest.json", ec)) return c.string();
  }
  return absl::NotFoundError(absl::StrCat("no checkpoint in '", dir, "' has a manifest.json"));
}

absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir, Allocator* allocator) {
  PW_ASSIGN_OR_RETURN(std::vector<fs::path> candidates, CheckpointCandidates(dir));
  if (candidates.size() == 1 && candidates[0] == NormalizeDir(dir)) {
    return ReadOneCheckpoint(candidates[0], allocator);
  }
  std::vector<std::string> failures;
  for (const fs::path& c : candidates) {
    absl::StatusOr<Checkpoint> ck = ReadOneCheckpoint(c, allocator);
    if (!ck.ok()) {
      failures.emplace_back(ck.status().message());
      continue;
    }
    for (const std::string& f : failures) {
      ck->warnings.push_back(
          absl::StrCat("damaged checkpoint skipped: ", f, "; resuming from ", c.string()));
    }
    return ck;
  }
  std::string all;
  for (const std::string& f : failures) absl::StrAppend(&all, all.empty() ? "" : "; ", f);
  return absl::DataLossError(absl::StrCat("no usable checkpoint in '", dir, "': ", all));
}

absl::StatusOr<std::vector<std::string>> RemoveCheckpointDebris(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  auto is_debris = [](const std::string& name, const std::string& base) {
    return absl::StartsWith(name, base + ".tmp-") || absl::StartsWith(name, base + ".old-");
  };
  auto remove = [&](const fs::path& p) -> absl::Status {
    fs::remove_all(p, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("cannot remove '", p.string(),
                                              "' (left by an interrupted save): ", ec.message()));
    }
    removed.push_back(p.string());
    return absl::OkStatus();
  };
  // Beside DIR: an interrupted WriteCheckpoint(DIR).
  const fs::path parent = root.has_parent_path() ? root.parent_path() : fs::path(".");
  const std::string base = root.filename().string();
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    if (is_debris(e.path().filename().string(), base)) PW_RETURN_IF_ERROR(remove(e.path()));
  }
  // Inside DIR: interrupted step checkpoints and pointer updates.
  if (fs::is_directory(root, ec)) {
    for (const auto& e : fs::directory_iterator(root, ec)) {
      const std::string name = e.path().filename().string();
      const size_t dot = name.find('.');
      const bool step_debris = dot != std::string::npos && StepOf(name.substr(0, dot)) >= 0 &&
                               is_debris(name, name.substr(0, dot));
      if (step_debris || absl::StartsWith(name, absl::StrCat(kLatest, ".tmp-"))) {
        PW_RETURN_IF_ERROR(remove(e.path()));
      }
    }
  }
  return removed;
}

absl::Status SaveCheckpointStep(const std::string& dir, int64_t step, int keep,
                                const std::function<absl::Status(const std::string&)>& write,
                                bool is_root) {
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  if (fs::exists(root / "manifest.json", ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", dir,
                     "' is a single checkpoint (it has a manifest.json), not a directory of step "
                     "checkpoints: save into a new directory"));
  }
  fs::create_directories(root, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create directory '", root.string(), "': ", ec.message()));
  }
  const std::string name = StepCheckpointName(step);
  PW_RETURN_IF_ERROR(write((root / name).string()));
  if (!is_root) return absl::OkStatus();
  // The pointer: written beside, fsync'ed, renamed over (atomic), the directory fsync'ed.
  const std::string latest = (root / kLatest).string();
  const std::string tmp = absl::StrCat(latest, ".tmp-", static_cast<long>(::getpid()));
  const std::string line = name + "\n";
  PW_RETURN_IF_ERROR(WriteFileSynced(tmp, {{line.data(), line.size()}}));
  if (::rename(tmp.c_str(), latest.c_str()) != 0) {
    absl::Status s = ErrnoStatus(errno, "cannot rename the latest pointer into place", latest);
    fs::remove(tmp, ec);
    return s;
  }
  PW_RETURN_IF_ERROR(FsyncDir(root.string()));
  if (keep <= 0) return absl::OkStatus();
  // Only after the pointer names the new one: the newest `keep` stay, and never the one named.
  int kept = 0;
  for (const auto& [s, path] : StepCheckpoints(root)) {
    if (path.filename() == name || kept < keep) {
      ++kept;
      continue;
    }
    fs::remove_all(path, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("checkpoint written, but cannot remove the old '",
                                              path.string(), "': ", ec.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace pipewright
