#!/usr/bin/env python3
"""Reads the runs scripts/bench-peers wrote into a directory and prints the ratio table.

  report.py DIR [--json]

DIR holds meta.json, and per pipeline depth P and repeat R: pp{P}-r{R}-pipewright.jsonl (the
stdout of `pipewright train --json`) and pp{P}-r{R}-torch.json (the stdout of gpt.py or
llama.py).
Both sides' samples/s = global batch / median step time over the steps after `skip`; a row's
figure is the median over repeats. Exit status 1 when the two models differ (parameter count,
tensor names) or a loss curve departs from the other side's.
"""

import glob
import json
import os
import re
import statistics
import struct
import sys

# The most two loss curves may depart, per precision (docs/benchmarks-peers.md, "Against PyTorch"
# and "More models and bf16"). fp32: reductions in another order drift apart slowly over steps
# (about 2e-4 after 8 steps). bf16: the two sides round different tensors to 8-bit mantissas
# (pipewright the products' inputs only; autocast also the products' outputs, attention and the
# MLP's activation), and training amplifies such perturbations: within 8 steps a bf16 run departs
# from its own fp32 run by up to 5.2e-2 (gpt-small) and the two sides' bf16 runs from each other
# by up to 1.6e-2.
LOSS_TOLERANCE = {"fp32": 1e-2, "bf16": 5e-2}


def pipewright_run(path, skip):
    steps, summary = [], None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            if "summary" in d:
                summary = d["summary"]
            elif "step" in d:
                steps.append(d)
    if summary is None:
        raise SystemExit(f"{path}: no summary line")
    G = summary["global_batch"]
    times = [s["step_time_s"] for s in steps]
    timed = times[skip:] if len(times) > skip else times
    med = statistics.median(timed)
    return {"samples_per_s": G / med, "median_step_time_s": med, "step_time_s": times,
            "loss": [s["loss"] for s in steps], "grad_norm": [s.get("grad_norm") for s in steps],
            "parameters": summary["parameters"], "stage_boundaries": summary["stage_boundaries"],
            "global_batch": G, "summary_samples_per_s": summary["samples_per_s"]}


def checkpoint_dir(ckpt):
    """A checkpoint, or the one a checkpoint directory's `latest` names (docs/checkpoint.md)."""
    if not os.path.exists(os.path.join(ckpt, "manifest.json")):
        with open(os.path.join(ckpt, "latest")) as f:
            return os.path.join(ckpt, f.read().strip())
    return ckpt


def checkpoint_names(ckpt):
    path = os.path.join(checkpoint_dir(ckpt), "model.safetensors")
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return sorted(k for k in header if k != "__metadata__")


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    d = sys.argv[1]
    as_json = "--json" in sys.argv[2:]
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    skip = meta["skip"]
    precision = meta.get("precision", "fp32")
    tolerance = LOSS_TOLERANCE[precision]
    ckpt_names = checkpoint_names(meta["init_checkpoint"]) if meta.get("init_checkpoint") else None
    problems = []
    rows = []
    versions = None
    for pp in meta["pp"]:
        reps = []
        for path in sorted(glob.glob(os.path.join(d, f"pp{pp}-r*-pipewright.jsonl")),
                           key=lambda p: int(re.search(r"-r(\d+)-", p).group(1))):
            r = int(re.search(r"-r(\d+)-", path).group(1))
            tpath = os.path.join(d, f"pp{pp}-r{r}-torch.json")
            if not os.path.exists(tpath):
                continue
            pw = pipewright_run(path, skip)
            with open(tpath) as f:
                pt = json.load(f)
            versions = versions or pt.get("versions")
            # pipewright's train summary counts a tied head's copy again: accept either count.
            tied = pt.get("tied_parameters", 0)
            if pw["parameters"] not in (pt["parameters"], pt["parameters"] + tied):
                problems.append(f"pp={pp} repeat {r}: parameters differ: pipewright {pw['parameters']}, "
                                f"PyTorch {pt['parameters']}")
            if ckpt_names is not None and sorted(pt["parameter_names"]) != ckpt_names:
                problems.append(f"pp={pp} repeat {r}: PyTorch tensor names differ from the checkpoint's")
            if pp > 1 and pt.get("stage_boundaries") != pw["stage_boundaries"]:
                problems.append(f"pp={pp} repeat {r}: split differs: pipewright {pw['stage_boundaries']}, "
                                f"PyTorch {pt.get('stage_boundaries')}")
            n = min(len(pw["loss"]), len(pt["loss"]))
            dloss = max((abs(a - b) for a, b in zip(pw["loss"][:n], pt["loss"][:n])), default=0.0)
            if meta.get("init_checkpoint") and dloss > tolerance:
                problems.append(f"pp={pp} repeat {r}: losses depart by {dloss:.3g} > {tolerance:g} "
                                f"(pipewright {pw['loss']}, PyTorch {pt['loss']})")
            reps.append({"repeat": r, "order": meta["order"].get(f"{pp}-{r}", ""),
                         "pipewright_samples_per_s": pw["samples_per_s"],
                         "peer_samples_per_s": pt["samples_per_s"],
                         "ratio": pw["samples_per_s"] / pt["samples_per_s"],
                         "pipewright_step_time_s": pw["step_time_s"],
                         "peer_step_time_s": pt["step_time_s"],
                         "pipewright_loss": pw["loss"], "peer_loss": pt["loss"],
                         "max_abs_loss_diff": dloss,
                         "parameters": {"pipewright": pw["parameters"], "peer": pt["parameters"],
                                        "tied": tied},
                         "stage_boundaries": pw["stage_boundaries"]})
        if not reps:
            continue
        pw_med = statistics.median(x["pipewright_samples_per_s"] for x in reps)
        pt_med = statistics.median(x["peer_samples_per_s"] for x in reps)
        rows.append({"pp": pp, "model": meta.get("model_name", "gpt-small"), "precision": precision,
                     "run": meta["labels"][str(pp)],
                     "pipewright_samples_per_s": pw_med, "peer_samples_per_s": pt_med,
                     "ratio": pw_med / pt_med,
                     "ratio_per_repeat": [x["ratio"] for x in reps],
                     "max_abs_loss_diff": max(x["max_abs_loss_diff"] for x in reps),
                     "parameters": reps[0]["parameters"],
                     "stage_boundaries": reps[0]["stage_boundaries"],
                     "repeats": reps})
    out = {"format": "pipewright.bench-peers/v1", "meta": meta, "peer_versions": versions,
           "loss_tolerance": tolerance, "rows": rows, "problems": problems}
    if as_json:
        print(json.dumps(out, indent=2))
        return 1 if problems or not rows else 0

    m = meta
    print(f"peer benchmark ({m['date']} to {m.get('date_end', '?')}): {m['model']}")
    print(f"  {m['micro_batches']} micro-batches x {m['micro_batch_size']} sequences (global batch "
          f"{m['micro_batches'] * m['micro_batch_size']}), AdamW (0.9, 0.95, eps 1e-8, wd 0.1 on "
          f"weights), clip 1.0, {precision}; same initial weights and synthetic data on both sides")
    print(f"  {m['steps']} steps per run, first {skip} excluded, samples/s = global batch / median "
          f"step time; {m['repeats']} repeat(s) alternating pipewright and PyTorch (order flipped each repeat), median shown")
    print(f"  threads: {m['threads']}")
    print(f"  PyTorch attention: {m['attention']}")
    print()
    w = max([len(r["run"]) for r in rows] + [3])
    wm = max([len(r["model"]) for r in rows] + [5])
    print(f"{'model':<{wm}}  {'prec':<4}  {'run':<{w}}  {'pipewright samples/s':>20}  {'peer samples/s':>14}"
          f"  {'ratio':>6}  per repeat")
    for r in rows:
        per = " ".join(f"{x:.2f}" for x in r["ratio_per_repeat"])
        pw_s, pt_s = (f"{x:.2f}" if x >= 1 else f"{x:.3f}"
                      for x in (r["pipewright_samples_per_s"], r["peer_samples_per_s"]))
        print(f"{r['model']:<{wm}}  {r['precision']:<4}  {r['run']:<{w}}  {pw_s:>20}  {pt_s:>14}"
              f"  {r['ratio']:>6.2f}  {per}")
    print("  ratio = pipewright / peer (above 1: pipewright is faster)")
    print()
    for r in rows:
        p = r["parameters"]
        same = "equal" if p["pipewright"] == p["peer"] else "DIFFERENT"
        if p.get("tied") and p["pipewright"] == p["peer"] + p["tied"]:
            same = f"equal: pipewright's summary counts the tied head's {p['tied']:,} again"
        print(f"pp={r['pp']}: parameters pipewright {p['pipewright']:,} / PyTorch {p['peer']:,} ({same}); "
              f"stage boundaries {r['stage_boundaries']}; max |loss difference| over steps "
              f"{r['max_abs_loss_diff']:.2e} (tolerance {tolerance:g}, {precision})")
    if ckpt_names is not None:
        print(f"tensor names and shapes: the PyTorch model loads all {len(ckpt_names)} tensors of "
              f"pipewright's initial checkpoint")
    v = versions or {}
    print(f"pipewright: tree {m['pipewright_commit']} ({m['pipewright_binary']}), kernels ISA {m['isa']}, "
          f"fp32 GEMM {m.get('gemm', 'OpenBLAS')}, OpenBLAS core {m['blas_core']}")
    print(f"PyTorch: {v.get('torch', '?')} (MKL {v.get('mkl', '?')}, oneDNN {v.get('onednn', '?')}, "
          f"CPU capability {v.get('cpu_capability', '?')}), Python {v.get('python', '?')}")
    print(f"CPU: {m['cpu_model']}, {m['cpu_cores']} cores; load average (1, 5, 15 min) at start {m['load_average']}, "
          f"at end {m.get('load_average_end', '?')}")
    for c in m["commands"]:
        print(f"  $ {c}")
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
