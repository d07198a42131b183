#include "bench/partitioner_suite.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "pipewright/model.h"
#include "pipewright/partitioner.h"

namespace pipewright::bench {
namespace {

// Layers of uneven cost (a factor of 10 apart) and memory: the exact search cannot lean on
// uniformity, and its pruning is exercised.
ModelCosts UnevenModel(int layers, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> flops(1e10, 1e11);
  std::uniform_int_distribution<int64_t> params(1 << 20, 16 << 20), bytes(8 << 20, 64 << 20);
  ModelCosts m;
  m.name = absl::StrCat("uneven-", layers);
  m.fingerprint = "sha256:bench";
  m.input_bytes = 1 << 20;
  for (int i = 0; i < layers; ++i) {
    LayerCost l;
    l.name = absl::StrCat("layer.", i);
    l.kind = "synthetic";
    l.params = params(rng);
    l.forward_flops = flops(rng);
    l.backward_flops = 2 * l.forward_flops;
    l.activation_bytes = bytes(rng);
    l.output_bytes = 4 << 20;
    m.layers.push_back(l);
  }
  return m;
}

PartitionerRow Describe(const std::string& name, const ModelCosts& m, const Plan& plan,
                        const DeviceSpec& dev) {
  PartitionerRow row;
  row.name = name;
  row.layers = m.num_layers();
  row.stages = static_cast<int>(plan.stages.size());
  row.micro_batches = plan.schedule.micro_batches;
  row.schedule = ScheduleKindName(plan.schedule.kind);
  const ModelCosts scaled = m.WithMicroBatchSize(plan.micro_batch_size);
  double sum = 0, largest = 0;
  for (const LayerCost& l : scaled.layers) {
    const double t =
        (l.forward_flops + l.backward_flops) / (dev.tflops * 1e12) + 2 * dev.layer_overhead_s;
    sum += t;
    largest = std::max(largest, t);
  }
  row.lower_bound_s = std::max(sum / row.stages, largest);
  for (const PlanStage& s : plan.stages) {
    row.bottleneck_s = std::max(row.bottleneck_s, s.forward_s + s.backward_s);
    row.recomputed_stages += s.recompute == Recompute::kFull;
  }
  return row;
}

}  // namespace

absl::StatusOr<std::vector<PartitionerRow>> RunPartitionerSuite(int repetitions) {
  std::vector<PartitionerRow> rows;
  const ModelCosts uneven = UnevenModel(1000, 42);
  struct Case {
    std::string name;
    ScheduleKind kind;
    int chunks;
    int64_t memory;
  };
  for (const Case& c : {Case{"1000 uneven layers, ample memory", ScheduleKind::k1F1B, 1, 80 * kGiB},
                        Case{"1000 uneven layers, 24 GiB (recompute where needed)",
                             ScheduleKind::k1F1B, 1, 24 * kGiB},
                        Case{"1000 uneven layers, interleaved x2 (128 virtual stages)",
                             ScheduleKind::kInterleaved, 2, 80 * kGiB}}) {
    DeviceSpec dev;
    dev.count = 64;
    dev.memory_bytes = c.memory;
    PartitionOptions o;
    o.pp = 64;
    o.schedule = c.kind;
    o.chunks = c.chunks;
    o.micro_batches = 128;
    absl::StatusOr<Plan> plan;
    const double s = MedianSeconds(repetitions, [&] { plan = Partition(uneven, dev, o); });
    if (!plan.ok()) return plan.status();
    rows.push_back(Describe(c.name, uneven, *plan, dev));
    rows.back().seconds = s;
  }
  // The whole plan search for GPT-3 175B on 64 GPUs of 80 GiB at global batch 512.
  PW_ASSIGN_OR_RETURN(const ModelCosts m, PresetModelCosts("gpt3-175b", 1));
  DeviceSpec dev;
  dev.count = 64;
  dev.memory_bytes = 80 * kGiB;
  dev.tflops = 300;
  SearchOptions so;
  so.global_batch = 512;
  so.precision = Precision::kBf16;
  absl::StatusOr<SearchResult> r;
  const double s =
      MedianSeconds(std::max(1, repetitions / 3), [&] { r = SearchPlans(m, dev, so); });
  if (!r.ok()) return r.status();
  rows.push_back(Describe("gpt3-175b plan search, 64 x 80 GiB, bf16, global batch 512", m,
                          r->best.front(), dev));
  rows.back().seconds = s;
  rows.back().candidates = r->candidates;
  return rows;
}

}  // namespace pipewright::bench
