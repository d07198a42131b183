// What `train` prints per step (commands.h, StepLog).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_format.h"
#include "tools/commands.h"

namespace pipewright::tools {

bool UnderLauncher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                        "MV2_COMM_WORLD_SIZE", "SLURM_PROCID"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

StepLog::StepLog(int64_t first, int64_t total, int64_t every, bool enabled)
    : first_(first), total_(total), start_(absl::Now()) {
  if (!enabled) return;
  const bool terminal = isatty(STDOUT_FILENO) && !UnderLauncher();
  bar_ = terminal && every == 0;
  every_ = every > 0 ? every : kDefaultEvery;
}

namespace {

std::string Duration(double s) {
  if (s < 60) return absl::StrFormat("%.1fs", s);
  if (s < 3600)
    return absl::StrFormat("%dm%02ds", static_cast<int>(s / 60), static_cast<int>(s) % 60);
  return absl::StrFormat("%dh%02dm", static_cast<int>(s / 3600), static_cast<int>(s / 60) % 60);
}

}  // namespace

std::string StepLog::Eta(int64_t done) const {
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start_);
  if (done <= first_) return Duration(elapsed) + " elapsed";
  const double per_step = elapsed / static_cast<double>(done - first_);
  return absl::StrCat(Duration(elapsed), " elapsed, eta ",
                      Duration(per_step * static_cast<double>(total_ - done)));
}

void StepLog::Update(int64_t done, const std::string& text) {
  if (bar_) {
    if (total_ <= 0) return;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * std::min(done, total_) / total_);
    std::string bar(filled, '#');
    bar.append(kWidth - filled, '.');
    std::printf("\r[%s] %lld/%lld %s, %s\033[K", bar.c_str(), static_cast<long long>(done),
                static_cast<long long>(total_), text.c_str(), Eta(done).c_str());
    std::fflush(stdout);
    drawn_ = true;
    return;
  }
  if (every_ == 0) return;  // disabled
  if (done % every_ != 0 && done != total_ && done != first_ + 1) return;
  std::printf("step %lld/%lld  %s  (%s)\n", static_cast<long long>(done),
              static_cast<long long>(total_), text.c_str(), Eta(done).c_str());
  std::fflush(stdout);
}

void StepLog::Finish() {
  if (drawn_) std::printf("\n");
  drawn_ = false;
}

}  // namespace pipewright::tools
