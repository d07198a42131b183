// `pipewright model`: a model's per-layer costs as a pipewright.model/v1 layer graph (the
// partitioner's input), analytic from the layers' own Cost or measured with --profile, and a
// summary that puts a GPT's parameter and FLOP counts beside the published formulas.

#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipewright/cpu.h"
#include "pipewright/model.h"
#include "pipewright/plan.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {
namespace {

using json = nlohmann::json;

struct ModelFlags {
  std::string preset, gpt, output;
  int64_t micro_batch_size = 0;  // 0: the preset's default (1 for --gpt)
  bool profile = false, json = false;
  int reps = 5;
  bool reps_given = false;
  uint64_t seed = 1;
};

struct BuiltModel {
  ModelCosts costs;
  std::optional<GptConfig> gpt;  // for the formulas; absent for non-GPT presets (mlp)
  std::optional<LayerGraph> graph;
};

absl::StatusOr<BuiltModel> Build(const ModelFlags& f) {
  if (f.preset.empty() == f.gpt.empty()) {
    return absl::InvalidArgumentError("give exactly one of --preset NAME and --gpt SPEC");
  }
  if (f.reps_given && !f.profile) return absl::InvalidArgumentError("--reps needs --profile");
  BuiltModel m;
  if (IsModelSpec(f.preset)) {  // --model llama:… or gpt:… (docs/models.md)
    PW_ASSIGN_OR_RETURN(LayerGraph g, ModelFromSpec(f.preset, f.micro_batch_size));
    m.costs = ToModelCosts(g);
    if (absl::StatusOr<GptConfig> c = GptConfigOf(g); c.ok()) m.gpt = *c;
    m.graph = std::move(g);
  } else if (!f.preset.empty()) {
    PW_ASSIGN_OR_RETURN(m.costs, PresetModelCosts(f.preset, f.micro_batch_size));
    if (absl::StatusOr<GptConfig> c = PresetGptConfig(f.preset); c.ok()) m.gpt = *c;
    if (f.profile) {
      PW_ASSIGN_OR_RETURN(LayerGraph g, PresetModel(f.preset, f.micro_batch_size));
      m.graph = std::move(g);
    }
  } else {
    PW_ASSIGN_OR_RETURN(GptConfig c, ParseGptSpec(f.gpt));
    const std::string name = absl::StrFormat("gpt-l%d-h%d-a%d-s%d-v%d%s", c.layers, c.hidden,
                                             c.heads, c.seq, c.vocab, c.tied ? "" : "-untied");
    const int64_t b = f.micro_batch_size ? f.micro_batch_size : 1;
    PW_ASSIGN_OR_RETURN(m.costs, GptModelCosts(name, c, b));
    m.gpt = c;
    if (f.profile) {
      PW_ASSIGN_OR_RETURN(LayerGraph g, GptModel(name, c, b));
      m.graph = std::move(g);
    }
  }
  if (f.profile) {
    // One BLAS thread, as `pipewright train` runs every rank: the measured times are then
    // the ones a CPU pipeline stage sees.
    SetCpuKernelThreads(1);
    PW_ASSIGN_OR_RETURN(ModelCosts measured, ProfileModel(*m.graph, f.reps, f.seed));
    // Keep the analytic costs (with their ties) and take only the times.
    for (int i = 0; i < m.costs.num_layers(); ++i) {
      m.costs.layers[i].forward_time_s = measured.layers[i].forward_time_s;
      m.costs.layers[i].backward_time_s = measured.layers[i].backward_time_s;
    }
  }
  return m;
}

// The published formulas (Narayanan et al. 2021, section 5.1): parameters of a GPT with a tied
// head, and forward FLOPs of one sequence, a quarter of their 96·B·s·l·h²·(1 + s/6h + V/16lh)
// per iteration with activation recomputation (forward + recomputed forward + 2x backward).
double FormulaParams(const GptConfig& c) {
  const double l = c.layers, h = c.hidden, s = c.seq, v = c.vocab;
  return 12 * l * h * h + 13 * l * h + (v + s) * h;
}
double FormulaForwardFlops(const GptConfig& c) {
  const double l = c.layers, h = c.hidden, s = c.seq, v = c.vocab;
  return 24 * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h));
}

std::string Count(double n) { return HumanCount(n); }

// "1.0645e+15 (1064.5 TFLOP)"
std::string Flops(double f) {
  if (f >= 1e12) return absl::StrFormat("%.4e (%.1f TFLOP)", f, f / 1e12);
  if (f >= 1e9) return absl::StrFormat("%.4e (%.1f GFLOP)", f, f / 1e9);
  return absl::StrFormat("%.4e (%.1f MFLOP)", f, f / 1e6);
}

double RelativeError(double ours, double formula) { return (ours - formula) / formula; }

json Summary(const BuiltModel& m, const std::string& output) {
  const ModelCosts& c = m.costs;
  double fwd = 0, bwd = 0;
  int64_t total = 0;
  for (const LayerCost& l : c.layers) {
    fwd += l.forward_flops;
    bwd += l.backward_flops;
    total += l.params;
  }
  const double per_seq = fwd / static_cast<double>(c.micro_batch_size);
  json j = {{"name", c.name},
            {"num_layers", c.num_layers()},
            {"micro_batch_size", c.micro_batch_size},
            {"seq_len", c.seq_len},
            {"params", c.UniqueParams()},
            {"params_stored", total},
            {"forward_flops_per_sequence", per_seq},
            {"forward_flops_per_micro_batch", fwd},
            {"backward_flops_per_micro_batch", bwd}};
  if (!output.empty()) j["output"] = output;
  if (m.gpt) {
    const GptConfig& g = *m.gpt;
    j["gpt"] = {{"layers", g.layers}, {"hidden", g.hidden}, {"heads", g.heads},
                {"seq", g.seq},       {"vocab", g.vocab},   {"tied", g.tied}};
    // The formula counts a tied head; an untied one adds its own V*h weights to it.
    const double formula_params =
        FormulaParams(g) + (g.tied ? 0.0 : static_cast<double>(g.vocab) * g.hidden);
    j["params_formula"] = formula_params;
    j["params_relative_error"] =
        RelativeError(static_cast<double>(c.UniqueParams()), formula_params);
    j["forward_flops_formula"] = FormulaForwardFlops(g);
    j["forward_flops_relative_error"] = RelativeError(per_seq, FormulaForwardFlops(g));
  }
  bool profiled = false;
  json times = json::array();
  for (const LayerCost& l : c.layers) {
    if (!l.forward_time_s) continue;
    profiled = true;
    times.push_back({{"name", l.name},
                     {"forward_time_s", *l.forward_time_s},
                     {"backward_time_s", l.backward_time_s.value_or(0.0)}});
  }
  if (profiled) j["profile"] = std::move(times);
  return j;
}

void PrintHuman(const json& s) {
  std::printf("model %s: %d layers, micro-batch %lld x seq %lld\n",
              s["name"].get<std::string>().c_str(), s["num_layers"].get<int>(),
              static_cast<long long>(s["micro_batch_size"].get<int64_t>()),
              static_cast<long long>(s["seq_len"].get<int64_t>()));
  const double params = s["params"].get<double>();
  const double stored = s["params_stored"].get<double>();
  std::string tie;
  if (s.contains("gpt")) tie = s["gpt"]["tied"].get<bool>() ? " (tied LM head)" : " (untied)";
  std::printf("parameters        %s%s", Count(params).c_str(), tie.c_str());
  if (stored != params) std::printf(", %s stored with the head's copy", Count(stored).c_str());
  std::printf("\n");
  std::printf("forward FLOPs     %s per sequence, %s per micro-batch\n",
              Flops(s["forward_flops_per_sequence"].get<double>()).c_str(),
              Flops(s["forward_flops_per_micro_batch"].get<double>()).c_str());
  std::printf("backward FLOPs    %s per micro-batch\n",
              Flops(s["backward_flops_per_micro_batch"].get<double>()).c_str());
  if (s.contains("gpt")) {
    std::printf("paper formulas (Narayanan et al. 2021):\n");
    std::printf("  params 12lh^2 + 13lh + (V+s)h%s %s   ours %+.4f%%\n",
                s["gpt"]["tied"].get<bool>() ? "        " : " + Vh   ",
                Count(s["params_formula"].get<double>()).c_str(),
                100 * s["params_relative_error"].get<double>());
    std::printf("  forward 24slh^2(1 + s/6h + V/16lh)    %s   ours %+.4f%%\n",
                Flops(s["forward_flops_formula"].get<double>()).c_str(),
                100 * s["forward_flops_relative_error"].get<double>());
    std::printf(
        "  (ours adds the final LayerNorm's 2h parameters; its FLOPs add the LM head's full\n"
        "   2sVh where the formula has 1.5sVh, softmax and masking, LayerNorms, GELU, biases,\n"
        "   residual adds and the loss)\n");
  }
  if (s.contains("profile")) {
    std::printf("measured per micro-batch (median):\n");
    std::printf("  %-16s %14s %14s\n", "layer", "forward ms", "backward ms");
    double f = 0, b = 0;
    for (const json& l : s["profile"]) {
      const double lf = l["forward_time_s"].get<double>(), lb = l["backward_time_s"].get<double>();
      f += lf;
      b += lb;
      std::printf("  %-16s %14.4f %14.4f\n", l["name"].get<std::string>().c_str(), 1e3 * lf,
                  1e3 * lb);
    }
    std::printf("  %-16s %14.4f %14.4f\n", "total", 1e3 * f, 1e3 * b);
  }
  if (s.contains("output")) std::printf("wrote %s\n", s["output"].get<std::string>().c_str());
}

absl::Status RunModel(const ModelFlags& f) {
  // Before the model is built (--profile takes a while): an output that cannot be written.
  if (!f.output.empty()) PW_RETURN_IF_ERROR(CheckOutputPath(f.output, "--output"));
  PW_ASSIGN_OR_RETURN(BuiltModel m, Build(f));
  std::string text = ModelCostsToJson(m.costs);
  if (text.empty() || text.back() != '\n') text += '\n';
  if (f.output.empty()) {
    // stdout is the layer graph itself, ready to pipe into `pipewright plan --model`.
    std::fwrite(text.data(), 1, text.size(), stdout);
    return absl::OkStatus();
  }
  PW_RETURN_IF_ERROR(WriteFile(f.output, text, "--output"));
  const json summary = Summary(m, f.output);
  if (f.json) {
    std::printf("%s\n", summary.dump().c_str());
  } else {
    PrintHuman(summary);
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterModel(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ModelFlags>();
  CLI::App* cmd = app.add_subcommand(
      "model", "Write a model's per-layer costs (pipewright.model/v1), analytic or profiled");
  cmd->footer(
      "Exactly one of --preset and --gpt. Without -o the layer graph JSON goes to stdout; with\n"
      "-o FILE it goes to FILE and a summary is printed (--json: as one JSON object), with a\n"
      "GPT's parameters and forward FLOPs beside the formulas of Narayanan et al. 2021:\n"
      "12lh^2 + 13lh + (V+s)h and 24slh^2(1 + s/6h + V/16lh) per sequence.\n"
      "\n"
      "Tied LM head: --gpt ties the head to the token embedding unless tied=0 (GPT-3 and\n"
      "Megatron-LM do; the tied head's V*h weights are then not counted again). The presets\n"
      "gpt2-124m, gpt3-175b and megatron-* are tied; gpt-tiny, gpt-small and mlp are untied.\n"
      "The runtime trains either (docs/memory.md, \"Tied embeddings\").\n"
      "\n"
      "--profile runs the model on this CPU (one BLAS thread, like every rank of `pipewright\n"
      "train`) and records each layer's median forward and backward seconds; models whose fp32\n"
      "weights and gradients exceed 4 GiB are refused.");
  cmd->add_option("--preset", f->preset,
                  "mlp | gpt-tiny | gpt-small | gpt2-124m | gpt3-175b | megatron-1.7b | "
                  "megatron-3.6b | "
                  "megatron-7.5b | megatron-18.4b | megatron-39.1b | megatron-76.1b | "
                  "megatron-145.6b | megatron-310.1b | megatron-529.6b | megatron-1t");
  cmd->add_option("--model", f->preset,
                  "A preset or a model spec, llama:layers=L,hidden=H,heads=A,kv_heads=K,ffn=F,"
                  "seq=S,vocab=V[,tied=0|1,rope_theta=T] or gpt:… (docs/models.md)");
  cmd->add_option("--gpt", f->gpt,
                  "layers=L,hidden=H,heads=A,seq=S,vocab=V[,tied=0|1] (tied defaults to 1)");
  AddInt(cmd, "--micro-batch-size", &f->micro_batch_size,
         {0, kMaxMicroBatchSize, "0: the preset's default; --gpt: 1"},
         "Sequences per micro-batch the costs are for (default: the preset's; --gpt: 1)");
  cmd->add_flag("--profile", f->profile, "Measure every layer's forward and backward time here");
  CLI::Option* reps = AddInt(cmd, "--reps", &f->reps, {1, 10000},
                             "Timed repetitions per layer with --profile (default 5)");
  AddUint64(cmd, "--seed", &f->seed, "Weights and synthetic batch seed for --profile");
  cmd->add_option("-o,--output", f->output, "Write the layer graph to FILE and print a summary");
  cmd->add_flag("--json", f->json, "Print the summary as JSON");
  cmd->callback([f, exit_code, reps] {
    f->reps_given = reps->count() > 0;
    absl::Status st = RunModel(*f);
    *exit_code = st.ok() ? 0 : ReportError(st);
  });
}

}  // namespace pipewright::tools
