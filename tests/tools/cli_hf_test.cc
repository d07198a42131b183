// Hugging Face interop (issue 17, part 5): `pipewright export --format hf` writes transformers'
// names and Conv1D layouts, `pipewright import --format hf` reads them back bit for bit, and —
// where a Python with torch and transformers is found — transformers' GPT2LMHeadModel reproduces
// pipewright's eval loss (scripts/hf-check). Without that Python the last test skips.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "pipewright/checkpoint.h"
#include "tests/tools/cli_util.h"

namespace {

namespace fs = std::filesystem;
using namespace pipewright::cli_test;
using json = nlohmann::json;

class CliHf : public CliDirTest {
 protected:
  CliHf() : CliDirTest("hf_") {}
  // A short gpt-tiny run saved at `name`; `tied`: --tied 1.
  std::string Trained(const std::string& name, bool tied) {
    Result r = RunCli(std::string("train --preset gpt-tiny --pp 2 --steps 3 "
                                  "--seed 3 --save ") +
                      Path(name) + (tied ? " --tied 1" : ""));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return Path(name);
  }
  double EvalLoss(const std::string& ck) {
    Result r = RunCli("eval --checkpoint " + ck + " --batches 2 --json");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? json::parse(r.out)["loss"].get<double>() : -1;
  }
};

std::vector<float> Values(const pipewright::Tensor& t) { return t.ToVector(); }

TEST_F(CliHf, ExportWritesTransformersLayoutsAndImportReadsThemBack) {
  const std::string ck = Trained("ck", /*tied=*/true);
  Result e = RunCli("export --checkpoint " + ck + " --format hf " + Path("hf"));
  ASSERT_EQ(e.exit_code, 0) << e.err;
  const json config = json::parse(ReadAll(Path("hf/config.json")));
  EXPECT_EQ(config["model_type"], "gpt2");
  EXPECT_EQ(config["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(config["n_layer"], 4);
  EXPECT_EQ(config["n_embd"], 64);
  EXPECT_EQ(config["n_head"], 4);
  EXPECT_EQ(config["n_positions"], 32);
  EXPECT_EQ(config["vocab_size"], 256);
  EXPECT_EQ(config["tie_word_embeddings"], true);
  EXPECT_EQ(config["activation_function"], "gelu_new");

  auto hf = pipewright::ReadSafetensors(Path("hf/model.safetensors"));
  ASSERT_TRUE(hf.ok()) << hf.status();
  auto ours = pipewright::ReadCheckpoint(ck);
  ASSERT_TRUE(ours.ok()) << ours.status();
  EXPECT_EQ(hf->tensors.count("lm_head.weight"), 0u);  // tied: transformers ties it to wte
  EXPECT_EQ(hf->tensors.size(), ours->model.size());   // the same tensors, renamed
  EXPECT_EQ(Values(hf->tensors.at("transformer.wte.weight")),
            Values(ours->model.at("embed.wte.weight")));
  // Conv1D: [in, out], the transpose of our Linear's [out, in].
  const pipewright::Tensor& c_attn = hf->tensors.at("transformer.h.1.attn.c_attn.weight");
  const pipewright::Tensor& qkv = ours->model.at("blocks.1.attn.qkv.weight");
  ASSERT_EQ(c_attn.shape(), (std::vector<int64_t>{64, 192}));
  ASSERT_EQ(qkv.shape(), (std::vector<int64_t>{192, 64}));
  for (int64_t i : {0, 5, 191}) {
    for (int64_t j : {0, 7, 63}) {
      EXPECT_EQ(c_attn.data<float>()[j * 192 + i], qkv.data<float>()[i * 64 + j]);
    }
  }
  EXPECT_EQ(hf->tensors.at("transformer.h.3.mlp.c_proj.weight").shape(),
            (std::vector<int64_t>{256, 64}));

  // Back: the imported checkpoint evaluates to the same loss, and training resumes from it.
  Result i = RunCli("import --format hf --preset gpt-tiny " + Path("hf") + " " + Path("back"));
  ASSERT_EQ(i.exit_code, 0) << i.err;
  EXPECT_EQ(EvalLoss(Path("back")), EvalLoss(ck));
  Result t =
      RunCli("train --preset gpt-tiny --tied 1 --steps 2 --resume " + Path("back") + " --json");
  EXPECT_EQ(t.exit_code, 0) << t.err;
  EXPECT_EQ(Losses(t).size(), 2u);
}

TEST_F(CliHf, BadInputIsNamedAndNothingIsOverwritten) {
  const std::string ck = Trained("ck", /*tied=*/false);
  fs::create_directories(Path("full"));
  { std::ofstream(Path("full/keep.txt")) << "mine"; }
  Result busy = RunCli("export --checkpoint " + ck + " --format hf " + Path("full"));
  EXPECT_EQ(busy.exit_code, 2);
  EXPECT_NE(busy.err.find("not empty"), std::string::npos) << busy.err;
  EXPECT_EQ(ReadAll(Path("full/keep.txt")), "mine");

  Result format = RunCli("export --checkpoint " + ck + " --format onnx " + Path("x"));
  EXPECT_EQ(format.exit_code, 2);
  EXPECT_NE(format.err.find("--format onnx"), std::string::npos) << format.err;

  ASSERT_EQ(RunCli("export --checkpoint " + ck + " --format hf " + Path("hf")).exit_code, 0);
  Result shape = RunCli("import --format hf --preset gpt-small " + Path("hf") + " " + Path("b"));
  EXPECT_EQ(shape.exit_code, 2);
  EXPECT_NE(shape.err.find("n_layer=4"), std::string::npos) << shape.err;
  EXPECT_NE(shape.err.find("does not fit preset 'gpt-small'"), std::string::npos) << shape.err;
  EXPECT_FALSE(fs::exists(Path("b")));

  Result mlp = RunCli("train --preset mlp --steps 1 --save " + Path("mlp"));
  ASSERT_EQ(mlp.exit_code, 0) << mlp.err;
  Result not_gpt = RunCli("export --checkpoint " + Path("mlp") + " --format hf " + Path("m"));
  EXPECT_EQ(not_gpt.exit_code, 2);
  EXPECT_NE(not_gpt.err.find("neither a GPT nor a Llama model"), std::string::npos) << not_gpt.err;

  Result tied_mlp = RunCli("train --preset mlp --tied 1 --steps 1");
  EXPECT_EQ(tied_mlp.exit_code, 2);
  EXPECT_NE(tied_mlp.err.find("not a GPT"), std::string::npos) << tied_mlp.err;
}

// Llama (docs/models.md): the fused q|k|v and gate|up products split into transformers'
// q_proj, k_proj, v_proj, gate_proj and up_proj of LlamaForCausalLM, and import fuses them back
// bit for bit (into the preset or spec given, with the file's tying); a config this model does
// not compute is refused naming its fields.
const char kLlamaSpec[] =
    "llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=96,seq=32,vocab=256,rope_theta=500000";

TEST_F(CliHf, LlamaExportsAsLlamaForCausalLMAndImportsBack) {
  Result t =
      RunCli(std::string("train --model ") + kLlamaSpec + " --pp 2 --steps 3 --save " + Path("ll"));
  ASSERT_EQ(t.exit_code, 0) << t.err;
  Result e = RunCli("export --checkpoint " + Path("ll") + " --format hf " + Path("llhf"));
  ASSERT_EQ(e.exit_code, 0) << e.err;
  const json config = json::parse(ReadAll(Path("llhf/config.json")));
  EXPECT_EQ(config["model_type"], "llama");
  EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(config["num_hidden_layers"], 2);
  EXPECT_EQ(config["num_key_value_heads"], 2);
  EXPECT_EQ(config["intermediate_size"], 96);
  EXPECT_EQ(config["rope_theta"], 500000.0);
  EXPECT_EQ(config["tie_word_embeddings"], false);
  auto hf = pipewright::ReadSafetensors(Path("llhf/model.safetensors"));
  ASSERT_TRUE(hf.ok()) << hf.status();
  const auto& k = hf->tensors.at("model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(k.shape(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(hf->tensors.at("model.layers.0.mlp.up_proj.weight").shape(),
            (std::vector<int64_t>{96, 64}));
  EXPECT_EQ(hf->tensors.count("lm_head.weight"), 1u);
  Result i = RunCli(std::string("import --format hf --preset ") + kLlamaSpec + " " + Path("llhf") +
                    " " + Path("llimp"));
  ASSERT_EQ(i.exit_code, 0) << i.err;
  EXPECT_EQ(EvalLoss(Path("llimp")), EvalLoss(Path("ll")));
  // Into another shape: refused naming the fields; a config with rope scaling too.
  Result wrong =
      RunCli("import --format hf --preset llama-tiny " + Path("llhf") + " " + Path("llwrong"));
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.err.find("num_hidden_layers=2"), std::string::npos) << wrong.err;
  json scaled = config;
  scaled["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  fs::create_directories(Path("llscaled"));
  std::ofstream(Path("llscaled/config.json")) << scaled.dump();
  fs::copy_file(Path("llhf/model.safetensors"), Path("llscaled/model.safetensors"));
  Result s = RunCli(std::string("import --format hf --preset ") + kLlamaSpec + " " +
                    Path("llscaled") + " " + Path("llscaled_imp"));
  EXPECT_NE(s.exit_code, 0);
  EXPECT_NE(s.err.find("rope_scaling"), std::string::npos) << s.err;
}

// A Python that imports torch and transformers: $PIPEWRIGHT_HF_PYTHON, the peers' venv of this
// source tree (scripts/hf-check --setup), or python3; "" when none does.
std::string HfPython() {
  std::vector<std::string> candidates;
  if (const char* p = std::getenv("PIPEWRIGHT_HF_PYTHON")) candidates.push_back(p);
  candidates.push_back(std::string(PIPEWRIGHT_SOURCE_DIR) + "/build-peers/venv/bin/python");
  candidates.push_back("python3");
  for (const std::string& py : candidates) {
    if (py.find('/') != std::string::npos && !fs::exists(py)) continue;
    const std::string cmd = py + " -c 'import torch, transformers' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return "";
}

// docs/checkpoint.md, "Hugging Face": transformers' loss on the eval tokens equals pipewright's
// within 1e-5, tied and untied, and the import round trip gives the same eval loss.
TEST_F(CliHf, TransformersReproducesTheEvalLoss) {
  const std::string py = HfPython();
  if (py.empty())
    GTEST_SKIP() << "no Python with torch and transformers (scripts/hf-check --setup)";
  for (bool tied : {true, false}) {
    const std::string ck = Trained(tied ? "tied" : "untied", tied);
    Result r =
        RunCliWith("PIPEWRIGHT_HF_PYTHON=" + py + " bash " + std::string(PIPEWRIGHT_SOURCE_DIR) +
                       "/scripts/hf-check --pipewright " + Bin(),
                   ck);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("hf-check: ok"), std::string::npos) << r.out;
    const json check = json::parse(r.out.substr(0, r.out.find('\n')));
    EXPECT_LE(check["abs_diff"].get<double>(), 1e-5);
    EXPECT_EQ(check["tie_word_embeddings"].get<bool>(), tied);
    EXPECT_EQ(check["lm_head_is_wte"].get<bool>(), tied);
  }
  // LlamaForCausalLM, tied and untied, with grouped-query attention.
  for (const std::string tied : {"0", "1"}) {
    const std::string ck = Path("llama" + tied);
    Result t = RunCli(std::string("train --model ") + kLlamaSpec + ",tied=" + tied +
                      " --steps 3 --save " + ck);
    ASSERT_EQ(t.exit_code, 0) << t.err;
    Result r =
        RunCliWith("PIPEWRIGHT_HF_PYTHON=" + py + " bash " + std::string(PIPEWRIGHT_SOURCE_DIR) +
                       "/scripts/hf-check --pipewright " + Bin(),
                   ck);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const json check = json::parse(r.out.substr(0, r.out.find('\n')));
    EXPECT_EQ(check["model_type"], "llama");
    EXPECT_LE(check["abs_diff"].get<double>(), 1e-5 * check["pipewright_loss"].get<double>());
    EXPECT_EQ(check["lm_head_is_wte"].get<bool>(), tied == "1");
  }
}

}  // namespace
