// Helpers for the end-to-end tests of the `pipewright` binary: run it, capture stdout, stderr
// and the exit code, parse JSON lines.
#ifndef PIPEWRIGHT_TESTS_TOOLS_CLI_UTIL_H_
#define PIPEWRIGHT_TESTS_TOOLS_CLI_UTIL_H_

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
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

// What this test process writes under the temp directory starts with this prefix (its pid in
// it, so two suites running at once never share a name); it is all removed when the process's
// tests pass (TempCleanup below) and kept for a look when one fails.
inline std::string TempPrefix() { return "pw_cli_" + std::to_string(getpid()) + "_"; }

inline std::string TempPath(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / (TempPrefix() + name)).string();
}

class TempCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!::testing::UnitTest::GetInstance()->Passed()) return;
    std::error_code ec;
    const std::string prefix = TempPrefix();
    for (const auto& e : std::filesystem::directory_iterator(::testing::TempDir(), ec)) {
      if (e.path().filename().string().rfind(prefix, 0) == 0) {
        std::filesystem::remove_all(e.path(), ec);
      }
    }
  }
};
// Registered once per test binary, whichever of its files include this header.
inline const bool kTempCleanupRegistered =
    (::testing::AddGlobalTestEnvironment(new TempCleanup), true);

// A fixture giving each test a fresh directory of its own under the temp directory (`prefix`
// and the test's name), removed when the test passes and kept for a look when it fails.
class CliDirTest : public ::testing::Test {
 protected:
  explicit CliDirTest(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override {
    root_ = TempPath(prefix_ + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(root_);
  }
  std::string Path(const std::string& name) const { return root_ + "/" + name; }
  std::string root_;

 private:
  std::string prefix_;
};

// Runs `command args` (command: the binary, or a launcher line ending with it).
inline Result RunCliWith(const std::string& command, const std::string& args) {
  // One stderr file per process: ctest runs the tests of this binary in parallel.
  static int counter = 0;
  std::string err_file = TempPath("stderr_" + std::to_string(counter++) + ".txt");
  std::string cmd = command + " " + args + " 2>" + err_file;
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  {
    std::ifstream e(err_file);
    r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  }
  std::error_code ec;
  std::filesystem::remove(err_file, ec);
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

// The run's --json summary object (null when it printed none).
inline nlohmann::json Summary(const Result& r) {
  nlohmann::json summary;
  for (const auto& l : JsonLines(r.out)) {
    if (l.contains("summary")) summary = l["summary"];
  }
  return summary;
}

// The per-step losses of a `train --json` run.
inline std::vector<double> Losses(const Result& r) { return Losses(JsonLines(r.out)); }

// (step, loss) of each complete JSON step line; a line cut short by a kill is ignored.
inline std::vector<std::pair<int, double>> StepLosses(const std::string& text) {
  std::vector<std::pair<int, double>> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) break;  // no newline: cut short
    auto j = nlohmann::json::parse(text.substr(start, end - start), nullptr, false);
    if (!j.is_discarded() && j.contains("loss") && j.contains("step")) {
      out.emplace_back(j["step"].get<int>(), j["loss"].get<double>());
    }
    start = end + 1;
  }
  return out;
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Starts `command args` (the binary, or a launcher line ending with it) with stdout and stderr
// to files, without waiting; returns the pid of `command` itself (signals reach it).
inline pid_t SpawnWith(const std::string& command, const std::string& args, const std::string& out,
                       const std::string& err) {
  const std::string cmd = "exec " + command + " " + args + " >" + out + " 2>" + err;
  pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Waits for `pid`; its exit code, or 128 + the signal that ended it.
inline int Reap(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Whether process `pid` has ended (a zombie not yet reaped counts as ended).
inline bool Ended(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] == 'Z';
}

// Waits until `path` holds at least `lines` step lines; false when `limit` passes first or
// process `pid` (when > 0) ends first.
inline bool WaitForSteps(const std::string& path, size_t lines, std::chrono::seconds limit,
                         pid_t pid = 0) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (StepLosses(ReadAll(path)).size() >= lines) return true;
    if (pid > 0 && Ended(pid)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

inline pid_t Spawn(const std::string& args, const std::string& out, const std::string& err) {
  return SpawnWith(Bin(), args, out, err);
}

}  // namespace pipewright::cli_test

#endif  // PIPEWRIGHT_TESTS_TOOLS_CLI_UTIL_H_
