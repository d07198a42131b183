// Whole-file reads and writes for the subcommands, with errors that name the file.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "tools/commands.h"

namespace pipewright::tools {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::NotFoundError(absl::StrCat("cannot read ", what, " '", path, "': a directory"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read ", what, " '", path, "': ", std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::NotFoundError(absl::StrCat("cannot read ", what, " '", path, "'"));
  return text.str();
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return absl::NotFoundError(
        absl::StrCat("cannot open '", path, "' for writing: ", std::strerror(errno)));
  }
  out << text;
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("short write to '", path, "'"));
  return absl::OkStatus();
}

}  // namespace pipewright::tools
