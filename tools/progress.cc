#include <unistd.h>

#include <cstdio>

#include "tools/commands.h"

namespace pipewright::tools {

ProgressBar::ProgressBar(int64_t total, bool enabled)
    : total_(total), enabled_(enabled && isatty(STDOUT_FILENO)) {}

void ProgressBar::Update(int64_t done, const std::string& text) {
  if (!enabled_ || total_ <= 0) return;
  constexpr int kWidth = 30;
  int filled = static_cast<int>(kWidth * done / total_);
  std::string bar(filled, '#');
  bar.append(kWidth - filled, '.');
  std::printf("\r[%s] %lld/%lld %s\033[K", bar.c_str(), static_cast<long long>(done),
              static_cast<long long>(total_), text.c_str());
  std::fflush(stdout);
}

void ProgressBar::Finish() {
  if (enabled_) std::printf("\n");
}

}  // namespace pipewright::tools
