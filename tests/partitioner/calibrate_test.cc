// CalibrateModelCosts (Note [Calibration] in partitioner/calibrate.cc): a run's measured stage
// times and rank peaks written back into the layers, so that the same configuration predicts
// them, and every measurement that does not fit is refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "pipewright/partitioner.h"
#include "pipewright/plan.h"
#include "pipewright/schedule.h"

namespace pipewright {
namespace {

ModelCosts TenLayers() {
  ModelCosts m;
  m.name = "ten";
  m.fingerprint = "sha256:test";
  m.micro_batch_size = 4;
  m.input_bytes = 512;
  for (int i = 0; i < 10; ++i) {
    LayerCost l;
    l.name = "layer" + std::to_string(i);
    l.kind = "test";
    l.params = 1000 * (i + 1);
    l.forward_flops = 1e9 * (i % 3 + 1);
    l.backward_flops = 2e9 * (i % 3 + 1);
    l.activation_bytes = 4096 * (i + 1);
    l.selective_saving_bytes = 1024 * (i + 1);
    l.output_bytes = 2048;
    m.layers.push_back(l);
  }
  return m;
}

// A 1F1B pp 2 run at micro-batch size 8 of TenLayers split at 4, with the given measurements.
RunMeasurement MeasuredRun(const Schedule& s) {
  RunMeasurement r;
  r.schedule = s;
  r.micro_batch_size = 8;
  r.boundaries = {0, 4, 10};
  r.recompute = {Recompute::kNone, Recompute::kNone};
  r.param_bytes = BytesPerParam(Precision::kFp32);
  r.stage_forward_s = {0.150, 0.210};
  r.stage_backward_s = {0.300, 0.390};
  r.rank_peak_bytes = {5000000, 4000000};
  return r;
}

TEST(Calibrate, TheSameConfigurationPredictsTheMeasuredTimesAndPeaks) {
  absl::StatusOr<Schedule> s = GenerateSchedule({ScheduleKind::k1F1B, 2, 4, 1});
  ASSERT_TRUE(s.ok()) << s.status();
  const RunMeasurement run = MeasuredRun(*s);
  const DeviceSpec dev;
  absl::StatusOr<ModelCosts> c = CalibrateModelCosts(TenLayers(), dev, run);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->micro_batch_size, 8);
  // The layers' times sum to each stage's measured ones, shared as the FLOPs were.
  for (int st = 0; st < 2; ++st) {
    double f = 0, b = 0;
    for (int i = run.boundaries[st]; i < run.boundaries[st + 1]; ++i) {
      ASSERT_TRUE(c->layers[i].forward_time_s.has_value());
      f += *c->layers[i].forward_time_s;
      b += *c->layers[i].backward_time_s;
    }
    EXPECT_NEAR(f, run.stage_forward_s[st], 1e-12);
    EXPECT_NEAR(b, run.stage_backward_s[st], 1e-12);
  }
  EXPECT_GT(*c->layers[2].forward_time_s, *c->layers[0].forward_time_s);  // 3 vs 1 GFLOP
  // A plan of the same configuration predicts the measured figures.
  Plan plan;
  plan.model_name = "ten";
  plan.num_layers = 10;
  plan.fingerprint = "sha256:test";
  plan.pipeline_parallel = 2;
  plan.devices = 2;
  plan.device_memory_bytes = dev.memory_bytes;
  plan.schedule = s->spec;
  plan.micro_batch_size = 8;
  plan.stages.resize(2);
  plan.stages[0].end = plan.stages[1].begin = 4;
  plan.stages[1].index = plan.stages[1].rank = 1;
  plan.stages[1].end = 10;
  ASSERT_TRUE(Predict(*c, dev, Precision::kFp32, plan).ok());
  for (int st = 0; st < 2; ++st) {
    EXPECT_NEAR(plan.stages[st].forward_s, run.stage_forward_s[st], 1e-12);
    EXPECT_NEAR(plan.stages[st].backward_s, run.stage_backward_s[st], 1e-12);
    // The peak to within the rounding of each layer's bytes.
    EXPECT_NEAR(static_cast<double>(plan.stages[st].memory.total),
                static_cast<double>(run.rank_peak_bytes[st]), 16.0)
        << st;
  }
  // Calibrating again from what the calibrated model predicts changes nothing.
  absl::StatusOr<ModelCosts> again = CalibrateModelCosts(*c, dev, run);
  ASSERT_TRUE(again.ok());
  for (int i = 0; i < 10; ++i) {
    EXPECT_NEAR(*again->layers[i].forward_time_s, *c->layers[i].forward_time_s, 1e-15);
    EXPECT_NEAR(static_cast<double>(again->layers[i].activation_bytes),
                static_cast<double>(c->layers[i].activation_bytes), 2.0);
    EXPECT_LE(again->layers[i].selective_saving_bytes, again->layers[i].activation_bytes);
  }
}

TEST(Calibrate, MeasurementsThatDoNotFitAreRefusedByName) {
  absl::StatusOr<Schedule> s = GenerateSchedule({ScheduleKind::k1F1B, 2, 4, 1});
  ASSERT_TRUE(s.ok());
  const DeviceSpec dev;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  struct Case {
    void (*edit)(RunMeasurement&, double);
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](RunMeasurement& r, double) {
         r.boundaries = {0, 4, 9};
       },
       "RunMeasurement.boundaries"},
      {[](RunMeasurement& r, double) {
         r.boundaries = {0, 4, 4, 10};
       },
       "RunMeasurement.boundaries"},
      {[](RunMeasurement& r, double) {
         r.boundaries = {0, 10, 10};
       },
       "stage 1 has no layers"},
      {[](RunMeasurement& r, double n) { r.stage_forward_s[1] = n; }, "stage 1: measured forward"},
      {[](RunMeasurement& r, double) { r.stage_backward_s[0] = 0; }, "stage 0: measured forward"},
      {[](RunMeasurement& r, double) { r.stage_backward_s.pop_back(); }, "one entry per stage (2)"},
      {[](RunMeasurement& r, double) { r.rank_peak_bytes = {1}; },
       "RunMeasurement.rank_peak_bytes"},
      {[](RunMeasurement& r, double) { r.micro_batch_size = 0; },
       "RunMeasurement.micro_batch_size = 0"},
  };
  for (const Case& c : cases) {
    RunMeasurement run = MeasuredRun(*s);
    c.edit(run, nan);
    absl::StatusOr<ModelCosts> out = CalibrateModelCosts(TenLayers(), dev, run);
    ASSERT_FALSE(out.ok()) << c.message;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_NE(std::string(out.status().message()).find(c.message), std::string::npos)
        << out.status();
  }
}

}  // namespace
}  // namespace pipewright
