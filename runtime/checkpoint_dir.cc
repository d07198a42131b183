// Directories of step checkpoints (docs/checkpoint.md, "Checkpoint directories"):
// DIR/step-NNNNNN/ and the DIR/latest pointer, saving with pruning, reading the newest usable
// checkpoint, recovering what interrupted saves left, and the lock of a writer.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "pipewright/checkpoint.h"
#include "pipewright/input.h"
#include "runtime/checkpoint_files.h"

namespace pipewright {

using namespace internal;  // NOLINT: the shared file helpers

namespace {

namespace fs = std::filesystem;

constexpr char kStepPrefix[] = "step-";
constexpr size_t kStepPrefixLen = sizeof(kStepPrefix) - 1;
constexpr char kLatest[] = "latest";
constexpr char kLockFile[] = ".lock";

// The step of a "step-NNNNNN" name, or -1.
int64_t StepOf(absl::string_view name) {
  if (name.size() <= kStepPrefixLen || !absl::StartsWith(name, kStepPrefix)) return -1;
  int64_t step = 0;
  for (size_t i = kStepPrefixLen; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (int64_t{1} << 50)) return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// What an interrupted save leaves beside a checkpoint `base` (Note [Replacing a checkpoint] in
// checkpoint.cc): base.tmp-* (a write not yet renamed into place: complete once its manifest
// is written), base.old-* (the previous checkpoint moved aside), base.pruned-* (an old step
// checkpoint being removed: never restored).
enum class Debris { kNone, kTmp, kOld, kPruned };
Debris DebrisKind(absl::string_view name, absl::string_view base) {
  if (!absl::ConsumePrefix(&name, base)) return Debris::kNone;
  if (absl::StartsWith(name, ".tmp-")) return Debris::kTmp;
  if (absl::StartsWith(name, ".old-")) return Debris::kOld;
  if (absl::StartsWith(name, ".pruned-")) return Debris::kPruned;
  return Debris::kNone;
}

// A step checkpoint or the debris of one, in a checkpoint directory.
struct StepEntry {
  int64_t step = 0;
  Debris debris = Debris::kNone;
  fs::path path;
};

// Every step checkpoint directory of `root` (with `debris`, also the .tmp-* and .old-* ones of
// each step), newest step first; for one step the checkpoint itself, then its newest write
// (.tmp), then the one moved aside (.old).
std::vector<StepEntry> StepEntries(const fs::path& root, bool debris) {
  std::vector<StepEntry> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    const size_t dot = name.find('.');
    const int64_t step = StepOf(absl::string_view(name).substr(0, dot));
    if (step < 0 || !e.is_directory(ec)) continue;
    const Debris kind =
        dot == std::string::npos ? Debris::kNone : DebrisKind(name, name.substr(0, dot));
    if (dot != std::string::npos && (kind == Debris::kNone || kind == Debris::kPruned)) continue;
    if (kind != Debris::kNone && !debris) continue;
    out.push_back({step, kind, e.path()});
  }
  std::sort(out.begin(), out.end(), [](const StepEntry& a, const StepEntry& b) {
    if (a.step != b.step) return a.step > b.step;
    if (a.debris != b.debris) return a.debris < b.debris;
    return a.path < b.path;
  });
  return out;
}

// What DIR/latest names ("" when it is missing or does not name a step checkpoint); a pointer
// that cannot be read (a FIFO, a device, too long) is a line in `problems`.
std::string LatestName(const fs::path& root, std::vector<std::string>* problems) {
  const std::string path = (root / kLatest).string();
  std::error_code ec;
  if (fs::symlink_status(path, ec).type() == fs::file_type::not_found) return "";
  absl::StatusOr<std::string> text = ReadTextFile(path, "checkpoint pointer", kMaxPointerBytes);
  if (!text.ok()) {
    problems->push_back(absl::StrCat(text.status().message(), ": ignored"));
    return "";
  }
  absl::string_view name = absl::StripTrailingAsciiWhitespace(*text);
  if (StepOf(name) < 0) {
    problems->push_back(absl::StrCat(path, " does not name a step checkpoint: ignored"));
    return "";
  }
  return std::string(name);
}

}  // namespace

std::string StepCheckpointName(int64_t step) {
  std::string digits = std::to_string(step);
  if (digits.size() < 6) digits.insert(0, 6 - digits.size(), '0');
  return absl::StrCat(kStepPrefix, digits);
}

namespace {

// The checkpoints DIR offers, in the order to try them: DIR itself when it has a manifest.json;
// else the step checkpoint DIR/latest names, then every step checkpoint newest first, each
// followed by what interrupted saves left of the same step (a kill between the two renames of
// a replacement leaves the step only there: Note [Replacing a checkpoint]).
absl::StatusOr<std::vector<fs::path>> CheckpointCandidates(const std::string& dir,
                                                           std::vector<std::string>* problems) {
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory '", dir, "' not found"));
  }
  if (fs::symlink_status(root / "manifest.json", ec).type() != fs::file_type::not_found) {
    return std::vector<fs::path>{root};
  }
  std::vector<StepEntry> entries = StepEntries(root, /*debris=*/true);
  const std::string latest = LatestName(root, problems);
  // The pointer's step (and its debris) first: stable_partition keeps the order within each.
  const int64_t latest_step = latest.empty() ? -1 : StepOf(latest);
  std::stable_partition(entries.begin(), entries.end(),
                        [&](const StepEntry& e) { return e.step == latest_step; });
  std::vector<fs::path> candidates;
  for (const StepEntry& e : entries) candidates.push_back(e.path);
  if (candidates.empty()) {
    return absl::NotFoundError(
        absl::StrCat("'", (root / "manifest.json").string(),
                     "' not found, and no step checkpoint (step-NNNNNN) in '", dir, "'"));
  }
  return candidates;
}

// A reason a checkpoint was skipped is damage (its files) or unsuitability (the caller's check).
bool IsDamage(const absl::Status& s) { return absl::IsDataLoss(s) || absl::IsNotFound(s); }

}  // namespace

absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& dir) {
  std::vector<std::string> problems;
  PW_ASSIGN_OR_RETURN(std::vector<fs::path> candidates, CheckpointCandidates(dir, &problems));
  std::error_code ec;
  for (const fs::path& c : candidates) {
    if (fs::exists(c / "manifest.json", ec)) return c.string();
  }
  return absl::NotFoundError(absl::StrCat("no checkpoint in '", dir, "' has a manifest.json"));
}

absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir, Allocator* allocator,
                                          const CheckpointCheck& accept) {
  std::vector<std::string> problems;
  PW_ASSIGN_OR_RETURN(std::vector<fs::path> candidates, CheckpointCandidates(dir, &problems));
  auto read = [&](const fs::path& c) -> absl::StatusOr<Checkpoint> {
    PW_ASSIGN_OR_RETURN(Checkpoint ck, ReadOneCheckpoint(c, allocator));
    if (accept) PW_RETURN_IF_ERROR(accept(ck));
    return ck;
  };
  if (candidates.size() == 1 && candidates[0] == NormalizeDir(dir)) return read(candidates[0]);
  std::vector<absl::Status> failures;
  for (const fs::path& c : candidates) {
    absl::StatusOr<Checkpoint> ck = read(c);
    if (!ck.ok()) {
      failures.push_back(ck.status());
      continue;
    }
    std::vector<std::string> warnings = problems;
    for (const absl::Status& f : failures) {
      warnings.push_back(absl::StrCat(IsDamage(f) ? "damaged" : "unusable", " checkpoint skipped: ",
                                      f.message(), "; resuming from ", c.string()));
    }
    warnings.insert(warnings.end(), ck->warnings.begin(), ck->warnings.end());
    ck->warnings = std::move(warnings);
    return ck;
  }
  // None usable: every reason, newest first. Damage alone is DataLoss; a checkpoint the caller
  // refused makes the whole a usage error of that kind (a different model, seed, ...).
  std::string all;
  absl::StatusCode code = absl::StatusCode::kDataLoss;
  for (const absl::Status& f : failures) {
    absl::StrAppend(&all, all.empty() ? "" : "; ", f.message());
    if (!IsDamage(f) && code == absl::StatusCode::kDataLoss) code = f.code();
  }
  return absl::Status(code, absl::StrCat("no usable checkpoint in '", dir, "': ", all));
}

absl::StatusOr<std::string> ReadCheckpointManifest(const std::string& dir) {
  PW_ASSIGN_OR_RETURN(std::string path, ResolveCheckpointDir(dir));
  return ReadTextFile((fs::path(path) / "manifest.json").string(), "checkpoint manifest",
                      kMaxJsonFileBytes);
}

bool HoldsCheckpoints(const std::string& dir) {
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name == kLatest || name == "manifest.json" ||
        (name.size() > kStepPrefixLen && absl::StartsWith(name, kStepPrefix) &&
         name[kStepPrefixLen] >= '0' && name[kStepPrefixLen] <= '9')) {
      return true;
    }
  }
  return false;
}

absl::StatusOr<RecoveryReport> RecoverInterruptedSaves(const std::string& dir) {
  RecoveryReport report;
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  auto remove = [&](const fs::path& p) -> absl::Status {
    fs::remove_all(p, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("cannot remove '", p.string(),
                                              "' (left by an interrupted save): ", ec.message()));
    }
    report.removed.push_back(p.string());
    return absl::OkStatus();
  };
  // Each target with what interrupted saves left of it: put a complete copy back where the
  // target is missing or damaged (the newest write first), then remove the rest.
  auto recover = [&](const fs::path& target,
                     std::vector<std::pair<Debris, fs::path>> debris) -> absl::Status {
    std::sort(debris.begin(), debris.end());
    const bool present = fs::symlink_status(target, ec).type() != fs::file_type::not_found;
    if (!present || !VerifyCheckpointFiles(target).ok()) {
      for (auto it = debris.begin(); it != debris.end(); ++it) {
        if (it->first == Debris::kPruned || !VerifyCheckpointFiles(it->second).ok()) continue;
        const std::string from = it->second.string(), to = target.string();
        // A damaged target is swapped out atomically where the filesystem can (it then sits at
        // `from` and goes with the rest); else removed first: a kill in between leaves the
        // complete copy for the next recovery.
        bool swapped = false;
        if (present) {
          swapped = ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0;
          if (!swapped) PW_RETURN_IF_ERROR(remove(target));
        }
        if (!swapped && ::rename(from.c_str(), to.c_str()) != 0) {
          return ErrnoStatus(errno, "cannot put back the complete checkpoint", from);
        }
        CrashPoint("checkpoint.restored");
        PW_RETURN_IF_ERROR(FsyncDir(target.parent_path().string()));
        report.restored.emplace_back(from, to);
        if (!swapped) debris.erase(it);
        break;
      }
    }
    for (const auto& [kind, path] : debris) PW_RETURN_IF_ERROR(remove(path));
    return absl::OkStatus();
  };
  // Beside DIR: an interrupted WriteCheckpoint(DIR) of a single checkpoint.
  const fs::path parent = root.has_parent_path() ? root.parent_path() : fs::path(".");
  const std::string base = root.filename().string();
  std::vector<std::pair<Debris, fs::path>> beside;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const Debris kind = DebrisKind(e.path().filename().string(), base);
    if (kind != Debris::kNone) beside.emplace_back(kind, e.path());
  }
  // Restored only where DIR is missing or a single checkpoint itself: never over a directory of
  // step checkpoints, beside which they are a stale save of another kind.
  if (!beside.empty()) {
    if (!fs::exists(root, ec) || fs::exists(root / "manifest.json", ec)) {
      PW_RETURN_IF_ERROR(recover(root, std::move(beside)));
    } else {
      for (const auto& [kind, path] : beside) PW_RETURN_IF_ERROR(remove(path));
    }
  }
  // Inside DIR: interrupted step checkpoints, prunes and pointer updates.
  if (!fs::is_directory(root, ec)) return report;
  std::map<std::string, std::vector<std::pair<Debris, fs::path>>> by_step;
  std::vector<fs::path> pointer_tmps;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    const size_t dot = name.find('.');
    if (dot != std::string::npos && StepOf(absl::string_view(name).substr(0, dot)) >= 0) {
      const Debris kind = DebrisKind(name, name.substr(0, dot));
      if (kind != Debris::kNone) by_step[name.substr(0, dot)].emplace_back(kind, e.path());
    } else if (absl::StartsWith(name, absl::StrCat(kLatest, ".tmp-"))) {
      pointer_tmps.push_back(e.path());
    }
  }
  for (auto& [step, debris] : by_step) PW_RETURN_IF_ERROR(recover(root / step, std::move(debris)));
  for (const fs::path& p : pointer_tmps) PW_RETURN_IF_ERROR(remove(p));
  return report;
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
  CrashPoint("checkpoint.step-written");
  // The pointer: written beside, fsync'ed, renamed over (atomic), the directory fsync'ed.
  const std::string latest = (root / kLatest).string();
  const std::string tmp = absl::StrCat(latest, ".tmp-", static_cast<long>(::getpid()));
  const std::string line = name + "\n";
  PW_RETURN_IF_ERROR(WriteFileSynced(tmp, {{line.data(), line.size()}}));
  CrashPoint("checkpoint.pointer-written");
  if (::rename(tmp.c_str(), latest.c_str()) != 0) {
    absl::Status s = ErrnoStatus(errno, "cannot rename the latest pointer into place", latest);
    fs::remove(tmp, ec);
    return s;
  }
  PW_RETURN_IF_ERROR(FsyncDir(root.string()));
  CrashPoint("checkpoint.pointer-updated");
  if (keep <= 0) return absl::OkStatus();
  // Only after the pointer names the new one: the newest `keep` stay, and never the one named.
  // Each old one is renamed out of the step names first (atomic), so a kill while it is being
  // removed leaves debris that is never mistaken for a checkpoint.
  int kept = 0;
  for (const StepEntry& e : StepEntries(root, /*debris=*/false)) {
    if (e.path.filename() == name || kept < keep) {
      ++kept;
      continue;
    }
    const std::string doomed =
        absl::StrCat(e.path.string(), ".pruned-", static_cast<long>(::getpid()));
    if (::rename(e.path.c_str(), doomed.c_str()) != 0) {
      return ErrnoStatus(errno, "checkpoint written, but cannot remove the old", e.path.string());
    }
    CrashPoint("checkpoint.pruning");
    fs::remove_all(doomed, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("checkpoint written, but cannot remove the old '",
                                              doomed, "': ", ec.message()));
    }
  }
  return absl::OkStatus();
}

// ---- the writer's lock ----

absl::StatusOr<CheckpointLock> CheckpointLock::Acquire(const std::string& dir) {
  std::error_code ec;
  const fs::path root = NormalizeDir(dir);
  fs::create_directories(root, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create checkpoint directory '", root.string(), "': ", ec.message()));
  }
  if (!fs::is_directory(root, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory '", root.string(), "' is not a directory"));
  }
  const std::string path = (root / kLockFile).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  if (fd < 0) {
    absl::Status s = ErrnoStatus(errno, "cannot create the lock file", path);
    return absl::InvalidArgumentError(
        absl::StrCat(s.message(), " (a checkpoint directory must be writable)"));
  }
  CheckpointLock lock(fd, path);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return ErrnoStatus(errno, "cannot lock", path);
    absl::StatusOr<std::string> holder = ReadRegularFile(path, "lock file", 4096);
    std::string who = holder.ok() ? std::string(absl::StripTrailingAsciiWhitespace(*holder)) : "";
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint directory '", root.string(), "' is in use by another run",
        who.empty() ? "" : absl::StrCat(" (", who, ")"),
        ": two writers would destroy each other's saves; wait for it to end or save elsewhere (",
        path, " is locked)"));
  }
  // Who holds it, for the message a second writer gets.
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char when[64] = {};
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  const std::string line =
      absl::StrCat("pid ", static_cast<long>(::getpid()), " on ", host, " since ", when, "\n");
  if (::ftruncate(fd, 0) == 0) {
    [[maybe_unused]] ssize_t n = ::pwrite(fd, line.data(), line.size(), 0);
  }
  return lock;
}

CheckpointLock::CheckpointLock(CheckpointLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

CheckpointLock& CheckpointLock::operator=(CheckpointLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

CheckpointLock::~CheckpointLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

}  // namespace pipewright
