// The command tree of `pipewright` (main.cc parses it; tests parse it in-process) and the exit
// code of an error.
#include "tools/commands.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tools/flags.h"

namespace pipewright::tools {

void RegisterCommands(CLI::App& app, int* exit_code) {
  RegisterTrain(app, exit_code);
  RegisterEval(app, exit_code);
  RegisterGenerate(app, exit_code);
  RegisterPlot(app, exit_code);
  RegisterBench(app, exit_code);
  RegisterSimulate(app, exit_code);
  RegisterModel(app, exit_code);
  RegisterPlan(app, exit_code);
  RegisterValidate(app, exit_code);
  RegisterData(app, exit_code);
  RegisterExport(app, exit_code);
  RegisterImport(app, exit_code);
  // No option of any subcommand takes an empty value ("--save ''"); each numeric option's range
  // was attached where it was registered (tools/flags.h).
  RequireValues(app);
}

namespace {

// Edit distance (insertions, deletions, substitutions) between two short option names.
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The subcommand of `app` named `name`, or null.
const CLI::App* Subcommand(const CLI::App& app, const std::string& name) {
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (sub->get_name() == name) return sub;
  }
  return nullptr;
}

}  // namespace

std::string UsageHint(const CLI::App& app, int argc, const char* const* argv) {
  // The deepest subcommand the words name ("data prepare"), and its path.
  const CLI::App* cmd = &app;
  std::string path = "pipewright";
  int i = 1;
  for (; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.rfind("-", 0) == 0) break;
    const CLI::App* sub = Subcommand(*cmd, word);
    if (sub == nullptr) break;
    cmd = sub;
    path += " " + word;
  }
  std::string out;
  if (cmd != &app) {
    std::vector<std::string> known;  // "--steps", "-h"
    for (const CLI::Option* opt : cmd->get_options()) {
      for (const std::string& n : opt->get_lnames()) known.push_back("--" + n);
      for (const std::string& n : opt->get_snames()) known.push_back("-" + n);
    }
    for (int k = i; k < argc; ++k) {
      std::string word = argv[k];
      if (word.rfind("--", 0) != 0 || word.size() == 2) continue;
      word = word.substr(0, word.find('='));
      if (std::find(known.begin(), known.end(), word) != known.end()) continue;
      std::string best;
      size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;  // farther is no suggestion
      for (const std::string& n : known) {
        const size_t d = EditDistance(word, n);
        if (d < best_d) {
          best_d = d;
          best = n;
        }
      }
      absl::StrAppend(&out, "unknown option ", word, " for '", path, "'",
                      best.empty() ? "" : absl::StrCat("; did you mean ", best, "?"), "\n");
    }
  }
  absl::StrAppend(&out, "run '", path, " --help' for ",
                  cmd == &app ? "usage" : "its options and their defaults", "\n");
  return out;
}

std::string HumanBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::abs(b) >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%.0f B", b) : absl::StrFormat("%.2f %s", b, units[u]);
}

std::string HumanCount(double n) {
  if (n >= 1e12) return absl::StrFormat("%.2fT", n / 1e12);
  if (n >= 1e9) return absl::StrFormat("%.2fB", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2fM", n / 1e6);
  if (n >= 1e3) return absl::StrFormat("%.2fK", n / 1e3);
  return absl::StrFormat("%.0f", n);
}

std::string HumanSeconds(double s) {
  if (s < 1e-6) return absl::StrFormat("%.3g ns", s * 1e9);
  if (s < 1e-3) return absl::StrFormat("%.3g us", s * 1e6);
  if (s < 1) return absl::StrFormat("%.3g ms", s * 1e3);
  return absl::StrFormat("%.4g s", s);
}

int ReportError(const absl::Status& status) {
  // The library names fields; the user typed flags (Note [Field names to flags], flags.h).
  std::fprintf(stderr, "pipewright: %s\n", InFlagTerms(status.message()).c_str());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kAlreadyExists:
      return 2;
    default:
      return 1;
  }
}

}  // namespace pipewright::tools
