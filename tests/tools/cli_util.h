// Helpers for the end-to-end tests of the `pipewright` binary: run it, capture stdout, stderr
// and the exit code, parse JSON lines.
#ifndef PIPEWRIGHT_TESTS_TOOLS_CLI_UTIL_H_
#define PIPEWRIGHT_TESTS_TOOLS_CLI_UTIL_H_

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace pipewright::cli_test {

struct Result {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

inline std::string Bin() {
  const char* b = std::getenv("PIPEWRIGHT_BIN");  // override to test another build
  return b ? b : PIPEWRIGHT_BIN_PATH;
}

inline std::string TempPath(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / ("pw_cli_" + name)).string();
}

// Runs `command args` (command: the binary, or a launcher line ending with it).
inline Result RunCliWith(const std::string& command, const std::string& args) {
  // One stderr file per process: ctest runs the tests of this binary in parallel.
  static int counter = 0;
  std::string err_file =
      TempPath("stderr_" + std::to_string(getpid()) + "_" + std::to_string(counter++) + ".txt");
  std::string cmd = command + " " + args + " 2>" + err_file;
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream e(err_file);
  r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  return r;
}

inline Result RunCli(const std::string& args) { return RunCliWith(Bin(), args); }

inline std::vector<nlohmann::json> JsonLines(const std::string& text) {
  std::vector<nlohmann::json> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
    start = end + 1;
  }
  return out;
}

inline std::vector<double> Losses(const std::vector<nlohmann::json>& lines) {
  std::vector<double> l;
  for (const auto& j : lines) {
    if (j.contains("loss")) l.push_back(j["loss"].get<double>());
  }
  return l;
}

// The per-step losses of a `train --json` run.
inline std::vector<double> Losses(const Result& r) { return Losses(JsonLines(r.out)); }

}  // namespace pipewright::cli_test

#endif  // PIPEWRIGHT_TESTS_TOOLS_CLI_UTIL_H_
