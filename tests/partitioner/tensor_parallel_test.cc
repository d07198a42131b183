// Tensor parallelism in the planner (docs/memory.md, "Tensor parallelism"): one device's share of
// a GPT's layers, the collectives it adds, the checks of tp, the plan search's choice and the
// plan JSON's tensor_parallel and sequence_parallel.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "pipewright/model.h"
#include "pipewright/partitioner.h"
#include "pipewright/plan.h"

namespace pipewright {
namespace {

using json = nlohmann::json;

// A GPT's costs with its shape, as `pipewright plan --preset` and `pipewright model` give them.
ModelCosts Gpt(const GptConfig& c, int64_t micro_batch_size) {
  absl::StatusOr<ModelCosts> m = GptModelCosts("gpt-test", c, micro_batch_size);
  EXPECT_TRUE(m.ok()) << m.status();
  m->transformer = TransformerShape{c.hidden, c.heads, 4 * c.hidden, c.vocab};
  return *m;
}

// gpt-small's shape: 6 blocks, h 256, 8 heads, s 128, V 256, untied.
GptConfig Small() { return {.layers = 6, .hidden = 256, .heads = 8, .seq = 128, .vocab = 256}; }

const LayerCost& Layer(const ModelCosts& m, const std::string& name) {
  for (const LayerCost& l : m.layers) {
    if (l.name == name) return l;
  }
  ADD_FAILURE() << "no layer " << name;
  return m.layers.front();
}

DeviceSpec Devices(int count, int64_t memory = 1000 * kGiB) {
  DeviceSpec d;
  d.count = count;
  d.memory_bytes = memory;
  return d;
}

double AllReduceSeconds(double bytes, int t, const DeviceSpec& d) {
  return 2.0 * (t - 1) / t * bytes / d.tp_bandwidth + 2.0 * (t - 1) * d.tp_latency_s;
}

TEST(TensorParallel, DegreeOneLeavesTheModelAndThePlanUnchanged) {
  const ModelCosts m = Gpt(Small(), 2);
  absl::StatusOr<TensorParallelCosts> one = ShardForTensorParallel(m, Devices(1), 1, false);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(ModelCostsToJson(one->rank), ModelCostsToJson(m));
  for (double s : one->forward_comm_s) EXPECT_EQ(s, 0);
  for (double s : one->backward_comm_s) EXPECT_EQ(s, 0);
  // A plan at tp 1 is the plan of a model without a shape, byte for byte.
  ModelCosts no_shape = m;
  no_shape.transformer.reset();
  PartitionOptions o;
  o.pp = 2;
  o.dp = 2;
  o.micro_batches = 4;
  absl::StatusOr<Plan> a = Partition(m, Devices(4), o), b = Partition(no_shape, Devices(4), o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(PlanToJson(*a), PlanToJson(*b));
  EXPECT_FALSE(json::parse(PlanToJson(*a)).contains("tensor_parallel"));
}

TEST(TensorParallel, WeightsGradientsAndOptimizerStateDivideByTp) {
  const GptConfig c = Small();
  const ModelCosts m = Gpt(c, 1);
  const int64_t h = c.hidden, V = c.vocab, s = c.seq;
  for (int t : {2, 4, 8}) {
    absl::StatusOr<TensorParallelCosts> r = ShardForTensorParallel(m, Devices(t), t, false);
    ASSERT_TRUE(r.ok()) << r.status();
    // A block's two LayerNorms and its two row-parallel biases (6h) stay whole.
    EXPECT_EQ(Layer(r->rank, "blocks.0").params, (12 * h * h + 7 * h) / t + 6 * h) << t;
    // The token table is split, the position table is not.
    EXPECT_EQ(Layer(r->rank, "embed").params, V * h / t + s * h) << t;
    EXPECT_EQ(Layer(r->rank, "lm_head").params, h * V / t) << t;
    EXPECT_EQ(Layer(r->rank, "ln_f").params, 2 * h) << t;
    // A whole-model stage holds exactly that, at 4 + 4 + 8 bytes each (fp32 Adam).
    int64_t per_device = 0;
    for (const LayerCost& l : r->rank.layers) per_device += l.params;
    PartitionOptions o;
    o.tp = t;
    absl::StatusOr<Plan> plan = Partition(m, Devices(t), o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->tensor_parallel, t);
    EXPECT_EQ(plan->devices, t);
    const StageMemory& mem = plan->stages[0].memory;
    EXPECT_EQ(mem.params, 4 * per_device);
    EXPECT_EQ(mem.grads, 4 * per_device);
    EXPECT_EQ(mem.optimizer, 8 * per_device);
  }
}

TEST(TensorParallel, ActivationsFollowKorthikantiInThisModelsBytes) {
  const GptConfig c = Small();
  const int64_t b = 2, n = b * c.seq, h = c.hidden, a = c.heads;
  const ModelCosts m = Gpt(c, b);
  // The cost model's block (fp32, no dropout): 64nh + 16n + 4an, Korthikanti's sbh(34 + 5as/h)
  // without the two dropout masks, in 4-byte elements and with flash attention's log-sum-exp.
  ASSERT_EQ(Layer(m, "blocks.0").activation_bytes, 64 * n * h + 16 * n + 4 * a * n);
  for (int t : {2, 4, 8}) {
    absl::StatusOr<TensorParallelCosts> tp = ShardForTensorParallel(m, Devices(t), t, false);
    absl::StatusOr<TensorParallelCosts> sp = ShardForTensorParallel(m, Devices(t), t, true);
    ASSERT_TRUE(tp.ok() && sp.ok());
    // sbh(10 + 24/t + 5as/(ht)): the LayerNorms' inputs and outputs and statistics whole, the
    // rest split.
    EXPECT_EQ(Layer(tp->rank, "blocks.0").activation_bytes,
              16 * n * h + 16 * n + (48 * n * h + 4 * a * n) / t)
        << t;
    // Sequence parallelism: sbh(34/t + 5as/(ht)), everything split.
    EXPECT_EQ(Layer(sp->rank, "blocks.0").activation_bytes, (64 * n * h + 16 * n + 4 * a * n) / t)
        << t;
    // Selective recomputation's 24nh: the LayerNorm outputs (8nh) are whole without SP.
    EXPECT_EQ(Layer(tp->rank, "blocks.0").selective_saving_bytes, 8 * n * h + 16 * n * h / t);
    EXPECT_EQ(Layer(sp->rank, "blocks.0").selective_saving_bytes, 24 * n * h / t);
    // What a stage boundary sends: whole without SP, 1/t with it.
    EXPECT_EQ(Layer(tp->rank, "blocks.0").output_bytes, 4 * n * h);
    EXPECT_EQ(Layer(sp->rank, "blocks.0").output_bytes, 4 * n * h / t);
    // Vocabulary-parallel logits.
    EXPECT_EQ(Layer(tp->rank, "lm_head").output_bytes, 4 * n * c.vocab / t);
  }
}

TEST(TensorParallel, ComputeDividesAndEachSubLayerAddsAnAllReduce) {
  const GptConfig c = Small();
  const int64_t n = c.seq, h = c.hidden;
  const ModelCosts m = Gpt(c, 1);
  DeviceSpec d = Devices(4);
  d.tp_bandwidth = 100e9;
  d.tp_latency_s = 3e-6;
  absl::StatusOr<TensorParallelCosts> r = ShardForTensorParallel(m, d, 4, false);
  ASSERT_TRUE(r.ok());
  const LayerCost &whole = Layer(m, "blocks.0"), &part = Layer(r->rank, "blocks.0");
  // The LayerNorms and residual adds (18nh forward, 30nh backward) are repeated on every device.
  EXPECT_DOUBLE_EQ(part.forward_flops, (whole.forward_flops - 18.0 * n * h) / 4 + 18.0 * n * h);
  EXPECT_DOUBLE_EQ(part.backward_flops, (whole.backward_flops - 30.0 * n * h) / 4 + 30.0 * n * h);
  EXPECT_DOUBLE_EQ(Layer(r->rank, "lm_head").forward_flops, Layer(m, "lm_head").forward_flops / 4);
  // Two all-reduces of the [b, s, h] activation forward, two backward.
  const double ar = AllReduceSeconds(4.0 * n * h, 4, d);
  const int block = 1;  // layer 0 is the embedding
  ASSERT_EQ(m.layers[block].name, "blocks.0");
  EXPECT_DOUBLE_EQ(r->forward_comm_s[block], 2 * ar);
  EXPECT_DOUBLE_EQ(r->backward_comm_s[block], 2 * ar);
  EXPECT_DOUBLE_EQ(r->forward_comm_s[0], ar);  // the vocabulary-parallel embedding
  EXPECT_EQ(r->backward_comm_s[0], 0);
  // Sequence parallelism: an all-gather and a reduce-scatter instead, the same bytes on a ring.
  absl::StatusOr<TensorParallelCosts> s = ShardForTensorParallel(m, d, 4, true);
  ASSERT_TRUE(s.ok());
  EXPECT_NEAR(s->forward_comm_s[block], 2 * ar, 1e-15);
  // ... and the backward gathers the column-parallel products' saved rows again: two all-gathers
  // (half an all-reduce each) more.
  EXPECT_NEAR(s->backward_comm_s[block], 3 * ar, 1e-15);
  // And in a plan: the stage's forward is the shard's FLOPs plus the collectives, not overlapped.
  PartitionOptions o;
  o.tp = 4;
  d.layer_overhead_s = 0;
  absl::StatusOr<Plan> plan = Partition(m, d, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  double flops = 0, comm = 0;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    flops += r->rank.layers[i].forward_flops;
    comm += r->forward_comm_s[i];
  }
  EXPECT_NEAR(plan->stages[0].forward_s, flops / (d.tflops * 1e12) + comm, 1e-12);
  EXPECT_GT(comm, 0);
}

TEST(TensorParallel, TpMustDivideHeadsHiddenAndVocabulary) {
  ModelCosts m = Gpt(Small(), 1);  // 8 heads, h 256, V 256
  EXPECT_TRUE(CheckTensorParallel(m, Devices(8), 8, false).ok());
  absl::Status s = CheckTensorParallel(m, Devices(6), 3, false);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_TRUE(absl::StrContains(s.message(),
                                "PartitionOptions.tp = 3 does not divide the model's "
                                "8 attention heads"))
      << s;
  m.transformer->vocab = 250;  // divisible by 2, not by 4
  EXPECT_TRUE(CheckTensorParallel(m, Devices(2), 2, false).ok());
  s = CheckTensorParallel(m, Devices(4), 4, false);
  EXPECT_TRUE(absl::StrContains(s.message(), "250 vocabulary entries")) << s;
  // Partition refuses it too, and the search never proposes it.
  PartitionOptions o;
  o.tp = 4;
  EXPECT_TRUE(absl::IsInvalidArgument(Partition(m, Devices(4), o).status()));
  absl::StatusOr<SearchResult> r = SearchPlans(m, Devices(4), SearchOptions{});
  ASSERT_TRUE(r.ok()) << r.status();
  for (const Plan& p : r->best) EXPECT_LE(p.tensor_parallel, 2);
  // A layer graph without a shape plans at tp 1 only.
  m.transformer.reset();
  s = CheckTensorParallel(m, Devices(2), 2, false);
  EXPECT_TRUE(absl::StrContains(s.message(), "no transformer shape")) << s;
  r = SearchPlans(m, Devices(4), SearchOptions{});
  ASSERT_TRUE(r.ok());
  for (const Plan& p : r->best) EXPECT_EQ(p.tensor_parallel, 1);
  // Sequence parallelism needs a tensor-parallel group, and a sequence it divides.
  EXPECT_TRUE(absl::StrContains(CheckTensorParallel(m, Devices(1), 1, true).message(), "tp >= 2"));
}

// Two blocks of h = 1024: 12.6M parameters, 201 MB of fp32 Adam state each, on devices of 160 MB:
// no pipeline split fits, one block over two or four devices does.
ModelCosts WideModel() {
  return Gpt({.layers = 2, .hidden = 1024, .heads = 8, .seq = 128, .vocab = 1024}, 1);
}

TEST(SearchTensorParallel, PicksTpAboveOneWhereMemoryDemandsIt) {
  const ModelCosts m = WideModel();
  const DeviceSpec d = Devices(4, 160 * 1000 * 1000);
  SearchOptions only_one;
  only_one.tp = 1;
  absl::StatusOr<SearchResult> without = SearchPlans(m, d, only_one);
  EXPECT_TRUE(absl::IsFailedPrecondition(without.status())) << without.status();
  absl::StatusOr<SearchResult> with = SearchPlans(m, d, SearchOptions{});
  ASSERT_TRUE(with.ok()) << with.status();
  for (const Plan& p : with->best) {
    EXPECT_GE(p.tensor_parallel, 2);
    EXPECT_EQ(p.pipeline_parallel * p.data_parallel * p.tensor_parallel, 4);
    EXPECT_LE(p.predicted.peak_memory_bytes, d.memory_bytes);
    EXPECT_TRUE(ValidatePlan(p, &m).empty()) << absl::StrJoin(ValidatePlan(p, &m), "\n");
  }
  // A fixed tp that does not fit says so, and names more tensor parallelism as what would.
  PartitionOptions o;
  o.pp = 4;
  absl::Status miss = Partition(m, d, o).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(miss));
  PartitionOptions two;
  two.pp = 2;
  two.dp = 2;
  two.micro_batches = 2;
  miss = Partition(m, d, two).status();
  EXPECT_TRUE(absl::StrContains(miss.message(), "PartitionOptions.tp = 2")) << miss;
}

TEST(SearchTensorParallel, TheGroupStaysInsideANode) {
  const ModelCosts m = WideModel();
  DeviceSpec d = Devices(4, 160 * 1000 * 1000);
  d.devices_per_node = 2;
  absl::StatusOr<SearchResult> r = SearchPlans(m, d, SearchOptions{});
  ASSERT_TRUE(r.ok()) << r.status();
  for (const Plan& p : r->best) EXPECT_EQ(p.tensor_parallel, 2);
  d.devices_per_node = 1;
  EXPECT_TRUE(absl::IsFailedPrecondition(SearchPlans(m, d, SearchOptions{}).status()));
  SearchOptions four;
  four.tp = 4;
  d.devices_per_node = 2;
  absl::Status s = SearchPlans(m, d, four).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_TRUE(absl::StrContains(s.message(), "more than DeviceSpec.devices_per_node (2)")) << s;
}

TEST(SearchTensorParallel, SequenceParallelismHalvesWhatTheBlocksKeep) {
  // Long sequences: the activations, not the weights, decide; with SP the same split holds less.
  const ModelCosts m = Gpt({.layers = 4, .hidden = 256, .heads = 8, .seq = 2048, .vocab = 256}, 1);
  PartitionOptions o;
  o.dp = 2;
  o.tp = 4;
  o.micro_batches = 8;
  absl::StatusOr<Plan> off = Partition(m, Devices(8), o);
  o.sequence_parallel = true;
  absl::StatusOr<Plan> on = Partition(m, Devices(8), o);
  ASSERT_TRUE(off.ok() && on.ok());
  EXPECT_TRUE(on->sequence_parallel);
  EXPECT_LT(on->stages[0].memory.activations, off->stages[0].memory.activations * 6 / 10);
  // (Not faster: its backward gathers the column-parallel products' saved rows again, two
  // all-gathers more per block, which is what the memory costs.)
  EXPECT_GT(on->predicted.step_time_s, 0);
}

// --- plan JSON ---------------------------------------------------------------------------------

Plan TpPlan() {
  const ModelCosts m = Gpt(Small(), 1);
  PartitionOptions o;
  o.pp = 2;
  o.dp = 1;
  o.tp = 2;
  o.sequence_parallel = true;
  o.micro_batches = 4;
  absl::StatusOr<Plan> p = Partition(m, Devices(4), o);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

bool Has(const std::vector<std::string>& problems, const std::string& path,
         const std::string& text) {
  for (const std::string& p : problems) {
    if (absl::StartsWith(p, path + ": ") && absl::StrContains(p, text)) return true;
  }
  return false;
}

std::vector<std::string> After(void (*edit)(json&), const ModelCosts* model = nullptr) {
  json j = json::parse(PlanToJson(TpPlan()));
  edit(j);
  return ValidatePlanJson(j.dump(), model);
}

TEST(PlanJsonTensorParallel, RoundTripsAndPlansWithoutTheKeysReadAsTpOne) {
  const Plan p = TpPlan();
  const std::string text = PlanToJson(p);
  json j = json::parse(text);
  EXPECT_EQ(j["tensor_parallel"], 2);
  EXPECT_EQ(j["sequence_parallel"], true);
  absl::StatusOr<Plan> back = PlanFromJson(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tensor_parallel, 2);
  EXPECT_TRUE(back->sequence_parallel);
  EXPECT_EQ(PlanToJson(*back), text);
  const ModelCosts m = Gpt(Small(), 1);
  EXPECT_TRUE(ValidatePlanJson(text, &m).empty())
      << absl::StrJoin(ValidatePlanJson(text, &m), "\n");
  // A plan written before tensor parallelism: no keys, tp 1.
  j.erase("tensor_parallel");
  j.erase("sequence_parallel");
  j["data_parallel"] = 2;
  absl::StatusOr<Plan> old = PlanFromJson(j.dump());
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->tensor_parallel, 1);
  EXPECT_FALSE(old->sequence_parallel);
}

TEST(PlanJsonTensorParallel, HostileValuesAreRefusedNamingTheField) {
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = int64_t{1} << 31; }),
                  "tensor_parallel", "must be <= 2147483647, got 2147483648"));
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = -2; }), "tensor_parallel",
                  "must be >= 1, got -2"));
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = 0; }), "tensor_parallel", ">= 1"));
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = 2.0; }), "tensor_parallel",
                  "must be an integer"));
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = "2"; }), "tensor_parallel",
                  "must be an integer"));
  // NaN has no JSON spelling: written from memory it is null.
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = nullptr; }), "tensor_parallel",
                  "must be an integer >= 1, got null"));
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = uint64_t{1} << 63; }),
                  "tensor_parallel", "must be <= 2147483647"));
  EXPECT_TRUE(Has(After([](json& j) { j["sequence_parallel"] = 1; }), "sequence_parallel",
                  "must be true or false, got 1"));
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = 1; }), "sequence_parallel",
                  "needs tensor_parallel >= 2"));
  EXPECT_TRUE(Has(After([](json& j) { j["tensor_parallel"] = 4; }), "pipeline_parallel",
                  "2 x data_parallel 1 x tensor_parallel 4 = 8 devices but devices.count is 4"));
  // Three ints whose product passes 2^63: reported, not wrapped.
  EXPECT_TRUE(Has(After([](json& j) {
                    j["pipeline_parallel"] = 2147483647;
                    j["data_parallel"] = 2147483647;
                    j["tensor_parallel"] = 2147483647;
                  }),
                  "pipeline_parallel", "more than 2^63"));
}

TEST(PlanJsonTensorParallel, TpMustDivideTheModelsHeadsAndVocabulary) {
  ModelCosts m = Gpt(Small(), 1);
  m.transformer->heads = 6;  // the plan's tp 2 divides these
  m.transformer->hidden = 258;
  EXPECT_FALSE(Has(After([](json&) {}, &m), "tensor_parallel", ""));
  m.transformer->vocab = 255;
  EXPECT_TRUE(Has(After([](json&) {}, &m), "tensor_parallel",
                  "2 does not divide the model's 255 vocabulary entries"));
  m.transformer->heads = 5;
  EXPECT_TRUE(Has(After([](json&) {}, &m), "tensor_parallel", "5 attention heads"));
  m.transformer.reset();
  EXPECT_TRUE(Has(After([](json&) {}, &m), "tensor_parallel", "no transformer shape"));
}

// The Llama block (Note [Tensor-parallel costs]): of its 4(8nh + 2n + an + 3nf) saved bytes the
// norms' inputs, statistics and outputs (4(4nh + 2n)) are whole without SP; of its parameters
// only the two RMSNorm weights; a tp that does not divide the key-value heads is refused.
TEST(TensorParallel, TheLlamaBlockSplitsAllButItsNorms) {
  LlamaConfig c;
  c.layers = 2;
  c.hidden = 256;
  c.heads = 8;
  c.kv_heads = 4;
  c.ffn = 688;
  c.seq = 128;
  c.vocab = 512;
  const int64_t b = 2, n = b * c.seq, h = c.hidden, a = c.heads, f = c.ffn;
  absl::StatusOr<LayerGraph> g = LlamaModel("llama-test", c, b);
  ASSERT_TRUE(g.ok()) << g.status();
  const ModelCosts m = ToModelCosts(*g);
  ASSERT_TRUE(m.transformer.has_value()) << "a Llama graph has a shape under any name";
  EXPECT_EQ(m.transformer->kv_heads, 4);
  EXPECT_EQ(m.transformer->ffn_hidden, f);
  const LayerCost& whole = Layer(m, "blocks.0");
  ASSERT_EQ(whole.activation_bytes, 4 * (8 * n * h + 2 * n + a * n + 3 * n * f));
  ASSERT_EQ(whole.selective_saving_bytes, 4 * (2 * n * h + n * f));
  for (int t : {2, 4}) {
    absl::StatusOr<TensorParallelCosts> tp = ShardForTensorParallel(m, Devices(t), t, false);
    absl::StatusOr<TensorParallelCosts> sp = ShardForTensorParallel(m, Devices(t), t, true);
    ASSERT_TRUE(tp.ok() && sp.ok()) << tp.status() << sp.status();
    const LayerCost& r = Layer(tp->rank, "blocks.0");
    EXPECT_EQ(r.activation_bytes, 4 * (4 * n * h + 2 * n) + 4 * (4 * n * h + a * n + 3 * n * f) / t)
        << t;
    EXPECT_EQ(Layer(sp->rank, "blocks.0").activation_bytes, whole.activation_bytes / t) << t;
    EXPECT_EQ(r.selective_saving_bytes, 8 * n * h + 4 * n * f / t) << t;
    EXPECT_EQ(r.params, 2 * h + (whole.params - 2 * h) / t) << t;
    EXPECT_EQ(Layer(tp->rank, "embed").params, c.vocab * h / t) << t;
    EXPECT_EQ(Layer(sp->rank, "norm").output_bytes, 4 * n * h / t) << t;
    EXPECT_GT(tp->forward_comm_s[1], 0);
  }
  EXPECT_TRUE(absl::StrContains(CheckTensorParallel(m, Devices(8), 8, false).message(),
                                "4 key-value heads"));
  // The shape round-trips through the model JSON with its kv_heads, which must divide heads.
  const std::string text = ModelCostsToJson(m);
  absl::StatusOr<ModelCosts> back = ModelCostsFromJson(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->transformer->kv_heads, 4);
  json j = json::parse(text);
  j["transformer"]["kv_heads"] = 3;
  EXPECT_TRUE(absl::StrContains(ModelCostsFromJson(j.dump()).status().message(),
                                "transformer.kv_heads: 3 does not divide"));
  j["transformer"]["kv_heads"] = 9;
  EXPECT_TRUE(
      absl::StrContains(ModelCostsFromJson(j.dump()).status().message(), "transformer.kv_heads"));
}

TEST(ModelJsonTensorParallel, TheShapeRoundTripsAndIsChecked) {
  const ModelCosts m = Gpt(Small(), 1);
  const std::string text = ModelCostsToJson(m);
  absl::StatusOr<ModelCosts> back = ModelCostsFromJson(text);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(back->transformer.has_value());
  EXPECT_EQ(back->transformer->heads, 8);
  EXPECT_EQ(back->transformer->ffn_hidden, 1024);
  EXPECT_EQ(ModelCostsToJson(*back), text);
  json j = json::parse(text);
  j["transformer"]["heads"] = 0;
  absl::Status s = ModelCostsFromJson(j.dump()).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "transformer.heads: must be >= 1")) << s;
  j["transformer"]["heads"] = 3;
  s = ModelCostsFromJson(j.dump()).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "transformer.heads: 3 does not divide")) << s;
  j["transformer"] = {{"hidden", 256}};
  s = ModelCostsFromJson(j.dump()).status();
  EXPECT_TRUE(absl::StrContains(s.message(), "transformer.heads: missing")) << s;
  // A layer graph without it (every file written before tensor parallelism) still reads.
  j.erase("transformer");
  back = ModelCostsFromJson(j.dump());
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->transformer.has_value());
}

}  // namespace
}  // namespace pipewright
