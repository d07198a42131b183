// `pipewright train`'s command line: every flag, its range and its help (train_flags.h).
#include "tools/train_flags.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "pipewright/comm.h"
#include "pipewright/run_spec.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace pipewright::tools {

void RegisterTrain(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "Train a model: pp x dp x tp ranks on CPU threads");
  CLI::Option* preset =
      cmd->add_option("--preset", f->preset,
                      "Model preset: mlp, gpt-tiny, gpt-small, gpt2-124m, llama-tiny, smollm2-135m")
          ->check(CLI::IsMember(TrainablePresets()));
  cmd->add_option("--model", f->preset,
                  "A model spec instead of --preset: llama:layers=L,hidden=H,heads=A,kv_heads=K,"
                  "ffn=F,seq=S,vocab=V[,tied=0|1,rope_theta=T] or gpt:layers=L,hidden=H,heads=A,"
                  "seq=S,vocab=V[,tied=0|1] (docs/models.md)")
      ->excludes(preset);
  AddInt(cmd, "--tied", &f->tied, {0, 1},
         "1: tie the LM head to the token embedding (GPT-2's weight tying); 0: untie it "
         "(default: the preset's; gpt2-124m is tied, gpt-tiny and gpt-small are not)");
  AddInt(cmd, "--zero", &f->zero, {0, 2},
         "The sharded optimizer: 1 (ZeRO-1): each dp replica keeps and updates the optimizer "
         "state of its share of every gradient bucket (reduce-scatter, then all-gather); 2 "
         "(ZeRO-2): its gradient buffers shrink to that share too, for a reduce-scatter per "
         "micro-batch (dp >= 2; default: the plan's, else 0)");
  AddInt(cmd, "--zero-buffers", &f->zero_buffers, {1, 2},
         "ZeRO-2's bucket-sized gradient buffers per stage: 2 overlaps each bucket's "
         "reduce-scatter with the backward of the next; 1 waits for it, holding one bucket less "
         "(--zero 2 only; same losses either way)");
  AddInt(cmd, "--pp", &f->pp, {1, kMaxParallel}, "Pipeline-parallel stages");
  AddInt(cmd, "--dp", &f->dp, {1, kMaxParallel}, "Data-parallel replicas");
  AddInt(cmd, "--tp", &f->tp, {1, kMaxTensorParallel},
         "Tensor-parallel ranks per pipeline rank: each block's heads and MLP width, the "
         "embedding's and the LM head's vocabulary split over them (Megatron-style)");
  cmd->add_flag("--sequence-parallel", f->sequence_parallel,
                "With --tp: split the activations between the products (LayerNorms, residuals, "
                "what stages send) along the sequence too (GPT models)");
  cmd->add_option("--schedule", f->schedule, "Pipeline schedule")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"}));
  cmd->add_option("--split", f->split,
                  "The stages' layers by hand: the first layer of every stage but the first, "
                  "e.g. 3,6 for [0,3) [3,6) [6,L) (default: balanced by FLOPs; `model` lists the "
                  "layers)");
  AddInt(cmd, "--chunks", &f->chunks, {1, kMaxParallel},
         "Model chunks per rank (interleaved: 2 when not given, as in `plan`)");
  AddInt(cmd, "--micro-batches", &f->micro_batches, {1, kMaxMicroBatches},
         "Micro-batches per step (per replica)");
  AddInt(cmd, "--micro-batch-size", &f->micro_batch_size,
         {0, kMaxMicroBatchSize, "0: the preset's default"},
         "Sequences per micro-batch (0: the preset's default)");
  cmd->add_option("--recompute", f->recompute,
                  "Activation recomputation: none|selective|full (docs/memory.md)");
  cmd->add_option("--plan", f->plan,
                  "Partition plan JSON (`plan -o`), or a minimal one of only stages[].layers "
                  "(docs/plan.md, \"Minimal plans\")");
  cmd->add_option("--calibrate-out", f->calibrate_out,
                  "After the run, write the model's costs calibrated to it (measured per-layer "
                  "times and activation memory) for `plan --model FILE` (docs/plan.md, "
                  "\"Calibration\")");
  cmd->add_option("--program", f->program,
                  "A hand-written schedule: one 'rank R: F0@s0 ...' line per rank "
                  "(docs/schedules.md); sets pp, the stages and the micro-batches");
  AddInt(cmd, "--steps", &f->steps, {0, kMaxSteps},
         "Total optimizer steps (a resumed run continues to it)");
  AddInt(cmd, "--stop-after", &f->stop_after, {0, kMaxSteps, "0: no limit"},
         "Stop after this many steps in this run (the LR schedule still spans --steps; 0: no "
         "limit)");
  AddInt(cmd, "--log-every", &f->log_every, {0, kMaxSteps, "0: automatic"},
         "Print a plain line every N steps (0: a progress bar with an ETA on a terminal, else a "
         "line every 10 steps; never control codes under a launcher or into a file or pipe)");
  cmd->add_option("--data", f->data,
                  "synthetic, a token file ('pipewright data prepare'), or a text file "
                  "(byte-level tokens); files are memory-mapped");
  AddInt(cmd, "--data-workers", &f->data_workers, {0, 64},
         "Loader threads per data-loading rank building whole steps ahead (0: build "
         "each step on the rank's thread); results do not depend on it");
  AddInt(cmd, "--data-delay-us", &f->data_delay_us, {0, 10'000'000},
         "Benchmark only: sleep this long per sample (an artificially slow data source)")
      ->group("");  // hidden from --help
  AddUint64(cmd, "--seed", &f->seed,
            "Seed for weights and data (default 1; a resumed run: the checkpoint's)");
  AddReal(cmd, "--lr", &f->lr, RealRange::LeftOpen(0, 1e3),
          "Peak learning rate for --base-batch sequences");
  cmd->add_option(
      "--lr-scaling", f->lr_scaling,
      "none|linear|sqrt: scale --lr with the global batch (sqrt: the square-root rule for "
      "Adam-family optimizers)");
  AddInt(cmd, "--base-batch", &f->base_batch, {1, int64_t{1} << 40},
         "Batch that --lr is tuned for");
  AddInt(cmd, "--warmup", &f->warmup, {0, kMaxSteps}, "Linear warm-up steps before cosine decay");
  AddReal(cmd, "--min-lr-ratio", &f->min_lr_ratio, RealRange::Closed(0, 1),
          "Final lr as a fraction of the peak");
  AddReal(cmd, "--clip", &f->clip, RealRange::Closed(0, 1e9, "0: off"),
          "Clip gradients to this global norm (0: off)");
  cmd->add_option("--optimizer", f->optimizer, "adamw|sgd");
  AddReal(cmd, "--weight-decay", &f->weight_decay, RealRange::Closed(0, 1e3),
          "Decoupled weight decay");
  cmd->add_option("--device", f->device,
                  "cpu | cuda (ranks over every visible GPU) | cuda:N (every rank on GPU N)");
  cmd->add_option("--inject-failure", f->inject_failure,
                  "RANK:STEP: make that global rank fail in its first backward of that step "
                  "(tests of failure handling)")
      ->group("");  // hidden from --help
  cmd->add_option("--comm", f->comm,
                  "auto | local | nccl: how ranks talk (auto: NCCL when every rank has its own "
                  "GPU)")
      ->check(CLI::IsMember({"auto", "local", "nccl"}));
  cmd->add_option("--precision", f->precision,
                  "fp32|bf16|fp16: bf16/fp16 run matrix products on 16-bit inputs with fp32 "
                  "accumulation and fp32 master weights");
  AddReal(cmd, "--loss-scale", &f->loss_scale, RealRange::Closed(1, 16777216),
          "fp16: initial dynamic loss scale (65536)");
  AddInt(cmd, "--loss-scale-window", &f->loss_scale_window, {1, kMaxSteps},
         "fp16: finite steps in a row before the loss scale doubles (1000)");
  cmd->add_option("--trace", f->trace, "Write a Chrome trace of every rank here");
  cmd->add_option("--svg", f->svg, "Write the last step's measured timeline (SVG) here");
  AddReal(cmd, "--timeout", &f->timeout_s, RealRange::LeftOpen(0, 1e7),
          "Seconds a receive or collective may wait before the run fails");
  AddReal(cmd, "--bucket-mb", &f->bucket_mb, RealRange::Closed(1e-6, 1048576),
          "Gradient all-reduce bucket size (MiB)");
  cmd->add_option("--grad-compression", f->grad_compression,
                  "Gradients between replicas: none (fp32 all-reduce), bf16 (half the bytes, "
                  "fp32 sums, error feedback) or powersgd:R (rank-R factors of every matrix, "
                  "error feedback); needs --dp >= 2");
  cmd->add_option("--dp-mode", f->dp_mode,
                  "sync (every step sums all replicas' gradients) or async (bounded staleness: "
                  "each replica's gradients applied as they come by the parameters' owners; "
                  "needs --dp >= 2)");
  AddInt(cmd, "--staleness", &f->staleness, {0, 65536, "0: lock-step"},
         "async: the most steps a replica may run ahead of the slowest (0: lock-step; "
         "default 1)");
  cmd->add_option("--slow-replica", f->slow_replica,
                  "R:FACTOR: replica R computes FACTOR times slower (benchmarks of stragglers)");
  AddInt(cmd, "--threads-per-rank", &f->threads_per_rank, {0, 255, "0: automatic"},
         "Threads each CPU rank runs its kernels on (0: automatic, the usable cores "
         "divided among the ranks)");
  cmd->add_option("--save", f->save,
                  "Checkpoint directory: DIR/step-NNNNNN per saved step and DIR/latest naming the "
                  "newest; written at the end, every --save-every steps, and on SIGTERM/SIGINT/"
                  "SIGUSR1");
  AddInt(cmd, "--save-every", &f->save_every, {0, kMaxSteps, "0: only at the end"},
         "Save a checkpoint every N steps (needs --save; 0: only at the end)");
  cmd->add_option("--flight-dir", f->flight_dir,
                  "Where each rank's flight record (its last actions) goes on a failure or "
                  "SIGUSR2 (default: --save DIR, else .)");
  AddInt(cmd, "--keep", &f->keep, {0, 1 << 20, "0: all"},
         "Keep the newest K step checkpoints (0: all; needs --save)");
  cmd->add_option("--resume", f->resume,
                  "Continue from a checkpoint (or a checkpoint directory's newest verified one); "
                  "'auto': from --save DIR when it holds one");
  cmd->add_option("--valid-data", f->valid_data,
                  "Held-out data evaluated during the run (a text or token file, or synthetic; "
                  "default with --eval-every: held-out windows of --data); at the end, and "
                  "every --eval-every steps");
  AddInt(cmd, "--eval-every", &f->eval_every, {0, kMaxSteps, "0: only at the end"},
         "Evaluate the held-out loss every N steps (0: only at the end, when --valid-data is "
         "given)");
  AddInt(cmd, "--eval-batches", &f->eval_batches, {1, 65536},
         "Micro-batches of held-out data per evaluation");
  cmd->add_option("--metrics", f->metrics,
                  "Write one CSV row per step here (step, loss, lr, grad norm, step time, "
                  "samples/s, tokens/s, peak memory, loss scale, skipped, eval loss, model "
                  "TFLOP/s, MFU); `pipewright plot` draws it");
  AddReal(cmd, "--peak-tflops", &f->peak_tflops, RealRange::Closed(0, 1e9, "0: unknown"),
          "One device's (rank's) peak TFLOP/s, for the --metrics file's mfu column (model "
          "FLOP/s over pp x dp x this; 0: unknown, the column is left empty)");
  cmd->add_flag("--json", f->json, "One JSON object per step and a final summary");
  cmd->callback([f, cmd, exit_code] {
    for (const CLI::Option* opt : cmd->get_options()) {
      if (opt->count() > 0) f->given.insert(opt->get_name());
    }
    absl::Status s = RunTrain(*f);
    // Another process's failure relayed to this one is reported by the root process alone: a
    // job's failure reads as one line per cause, not one per process.
    if (!s.ok() && !TrainRootProcess() && IsRelayedAbort(s)) {
      *exit_code = 1;
      return;
    }
    *exit_code = s.ok() ? 0 : ReportError(s);
  });
}

}  // namespace pipewright::tools
