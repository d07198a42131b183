// Stages a custom model through the C++ API: builds a layer graph, prints each layer's cost,
// instantiates two halves as separate stages (as two pipeline ranks would), checks that running
// them back to back gives the same loss as the whole model, then trains the whole model briefly.
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "pipewright/model.h"
#include "pipewright/train.h"

using namespace pipewright;

absl::Status Run() {
  ModelBuilder b("custom-gpt", {.batch = 4, .seq_len = 16});
  b.Add("embed", layers::Embedding(/*vocab=*/256, /*max_seq=*/16, /*dim=*/32));
  for (int i = 0; i < 3; ++i) b.Add(absl::StrCat("blocks.", i), layers::TransformerBlock(32, 4));
  b.Add("ln_f", layers::LayerNorm(32));
  b.Add("lm_head", layers::LmHead(32, 256));
  b.Add("loss", layers::CrossEntropyLoss());
  PW_ASSIGN_OR_RETURN(LayerGraph graph, b.Build());

  std::printf("%-10s %-20s %10s %14s %14s\n", "layer", "kind", "params", "fwd MFLOP", "saved KiB");
  for (const LayerNode& n : graph.nodes()) {
    std::printf("%-10s %-20s %10lld %14.2f %14.1f\n", n.name.c_str(), n.spec->kind().c_str(),
                static_cast<long long>(n.cost.params), n.cost.forward_flops / 1e6,
                n.cost.activation_bytes / 1024.0);
  }

  // Two stages, [0, 3) and [3, 7): each allocates only its own layers.
  PW_ASSIGN_OR_RETURN(auto first, graph.Instantiate(0, 3, /*seed=*/7));
  PW_ASSIGN_OR_RETURN(auto second, graph.Instantiate(3, graph.num_layers(), /*seed=*/7));
  PW_ASSIGN_OR_RETURN(auto whole, graph.Instantiate(0, graph.num_layers(), /*seed=*/7));
  auto data = SyntheticDataset(16, 7);
  BatchLayout layout{1, 4, 16, 1};
  StepBatch batch = MakeStepBatch(*data, layout, 0, 0);
  LayerContext ctx{nullptr, &batch.targets[0]};
  std::vector<Saved> s1, s2, s3;
  PW_ASSIGN_OR_RETURN(Tensor h, first->Forward(batch.inputs[0], ctx, &s1));
  PW_ASSIGN_OR_RETURN(Tensor split_loss, second->Forward(h, ctx, &s2));
  PW_ASSIGN_OR_RETURN(Tensor whole_loss, whole->Forward(batch.inputs[0], ctx, &s3));
  std::printf("loss through two stages %.6f, through one %.6f\n", split_loss.data<float>()[0],
              whole_loss.data<float>()[0]);
  if (split_loss.data<float>()[0] != whole_loss.data<float>()[0]) {
    return absl::InternalError("two stages and the whole model give different losses");
  }

  TrainOptions o;
  o.steps = 20;
  o.lr = 3e-3f;
  PW_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(graph, /*micro_batches=*/4, o));
  std::vector<double> losses;
  for (int i = 0; i < o.steps; ++i) {
    PW_ASSIGN_OR_RETURN(StepResult r, trainer->Step());
    losses.push_back(r.loss);
    if (i % 5 == 0 || i + 1 == o.steps) std::printf("step %2d loss %.4f\n", i, r.loss);
  }
  if (!(losses.back() < losses.front())) return absl::InternalError("the loss did not fall");
  return absl::OkStatus();
}

int main() {
  absl::Status s = Run();
  if (!s.ok()) {
    std::fprintf(stderr, "custom_model: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
