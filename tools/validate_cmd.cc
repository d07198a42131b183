// `pipewright validate PLAN [--model MODEL.json] [--json]`: checks a plan file against every
// rule of pipewright.plan/v1 (docs/plan.md) and, with --model, against the model it was made for.
//
// A valid plan prints one summary line and exits 0. An invalid one prints one "path: message"
// line per problem on stderr, with no prefix, so the output can be grepped or diffed, and exits
// 2. A file that cannot be read, or a --model file that is not a valid pipewright.model/v1, is
// bad input too (exit 2) and is reported like every other command's errors.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"
#include "tools/commands.h"

namespace pipewright::tools {
namespace {

struct ValidateFlags {
  std::string plan, model;
  bool json = false;
};

void PrintJson(bool valid, const std::vector<std::string>& problems) {
  nlohmann::ordered_json j = {{"valid", valid}, {"problems", problems}};
  std::printf("%s\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
}

// Bad input that is not a plan problem (an unreadable file, a broken --model): the usual
// "pipewright: ..." error on stderr and, with --json, the same text as the only problem.
int InputError(const ValidateFlags& f, const absl::Status& status) {
  if (f.json) PrintJson(false, absl::StrSplit(std::string(status.message()), '\n'));
  return ReportError(status);
}

std::string Summary(const std::string& path, const Plan& p) {
  std::string schedule = ScheduleKindName(p.schedule.kind);
  if (p.schedule.chunks > 1) absl::StrAppend(&schedule, " v=", p.schedule.chunks);
  return absl::StrCat(
      path, ": valid: ", p.model_name, ", ", p.num_layers, " layers, pp=", p.pipeline_parallel,
      " dp=", p.data_parallel, p.tensor_parallel > 1 ? absl::StrCat(" tp=", p.tensor_parallel) : "",
      p.sequence_parallel ? " sp" : "", p.zero ? absl::StrCat(" zero=", p.zero) : "", " ", schedule,
      ", ", p.schedule.micro_batches,
      p.schedule.micro_batches == 1 ? " micro-batch x " : " micro-batches x ", p.micro_batch_size,
      ", ", p.stages.size(), " stages");
}

int RunValidate(const ValidateFlags& f) {
  absl::StatusOr<std::string> text = ReadJsonFile(f.plan, "plan");
  if (!text.ok()) return InputError(f, text.status());
  std::optional<ModelCosts> model;
  if (!f.model.empty()) {
    absl::StatusOr<std::string> model_text = ReadJsonFile(f.model, "--model");
    if (!model_text.ok()) return InputError(f, model_text.status());
    absl::StatusOr<ModelCosts> parsed = ModelCostsFromJson(*model_text);
    if (!parsed.ok()) {
      return InputError(f, absl::InvalidArgumentError(
                               absl::StrCat("--model ", f.model, " is not a valid ", kModelFormat,
                                            " file:\n", parsed.status().message())));
    }
    model = *std::move(parsed);
  }
  const ModelCosts* m = model ? &*model : nullptr;
  const std::vector<std::string> problems = ValidatePlanJson(*text, m);
  if (f.json) {
    // The problems are in the JSON; stderr stays empty so a caller can keep both streams.
    PrintJson(problems.empty(), problems);
    return problems.empty() ? 0 : 2;
  }
  if (!problems.empty()) {
    for (const std::string& p : problems) std::fprintf(stderr, "%s\n", p.c_str());
    return 2;
  }
  // Valid means PlanFromJson succeeds; it supplies the fields of the summary.
  absl::StatusOr<Plan> plan = PlanFromJson(*text, m);
  if (!plan.ok()) return ReportError(plan.status());
  std::printf("%s\n", Summary(f.plan, *plan).c_str());
  return 0;
}

}  // namespace

void RegisterValidate(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ValidateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "validate", "Check a plan file (pipewright.plan/v1) and, with --model, that it fits a model");
  cmd->add_option("plan", f->plan, "Plan JSON file")->required();
  cmd->add_option("--model", f->model,
                  "Model costs (pipewright.model/v1) the plan must match: name, layers and "
                  "fingerprint");
  cmd->add_flag("--json", f->json, "Print {\"valid\": bool, \"problems\": [...]}");
  cmd->callback([f, exit_code] { *exit_code = RunValidate(*f); });
}

}  // namespace pipewright::tools
