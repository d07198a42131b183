"""What scripts/peers/gpt.py and scripts/peers/llama.py share: the command line, pipewright's
synthetic data, its checkpoints, its optimizer, and the two ways of training (a plain loop, and
torch.distributed.pipelining).

A model file supplies a *model definition* (a module with these names):

  build_classes(torch)          -> Part class: Part(a, begin, end) is the nn.Module of pipewright's
                                   layer-graph nodes [begin, end) (0 = embed, 1..L = blocks,
                                   L+1 = final norm, L+2 = lm_head; L+3, the loss, is the
                                   schedule's loss_fn). A Part has `tied_copy`: the local name of
                                   a parameter that copies embed.wte.weight (a tied head on
                                   another stage than the embedding), else None.
  decays(name) -> bool          AdamW's weight decay (pipewright's Parameter::weight_decay)
  init_params(torch, model, a)  weights when no checkpoint is loaded
  add_model_args(parser)        the model's shape flags (--layers ... --vocab, --tied)

Everything that decides the compute outside the model follows pipewright:
  * loss: mean token cross-entropy per micro-batch (on fp32 logits), step loss = mean over
    micro-batches (the gradient of the mean over the whole global batch);
  * optimizer: AdamW (betas 0.9/0.95, eps 1e-8, decoupled weight decay 0.1 on what decays()
    says), linear LR warm-up then cosine decay to min_lr_ratio x peak over --steps, gradient
    clipping to a global norm of 1.0 (over all stages with pp > 1);
  * tied head (--tied 1): on one stage the head multiplies by embed.wte.weight itself; across
    stages the last stage holds a copy, loaded from the checkpoint's embed.wte.weight, whose
    gradient and the embedding's are summed by an all-reduce of the two ranks before clipping
    (docs/runtime.md, "Tied embeddings"), counted once in the norm and the parameter count;
  * precision: fp32, or bf16 = the model's forward under torch.autocast("cpu", bfloat16)
    (what a PyTorch user writes), fp32 master weights, gradients and AdamW state;
  * data: pipewright's synthetic task (docs/data.md), bit for bit: step s uses samples
    [s*G, (s+1)*G), micro-batch j holds samples s*G + j*B + b.
"""

import argparse
import contextlib
import importlib
import json
import math
import os
import statistics
import struct
import sys
import time

OWNER = "embed.wte.weight"  # what a tied head's weight is


def parse_args(model, description, argv=None):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["single", "pipe"], default="single")
    model.add_model_args(p)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (also the LR schedule's length)")
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the timing (warm-up)")
    p.add_argument("--boundaries", default="",
                   help="pipewright layer-graph stage boundaries, e.g. 0,4,10 (layer 0 = embed, "
                        "1..L = blocks, L+1 = final norm, L+2 = lm_head, L+3 = loss); --mode pipe")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: the forward under torch.autocast('cpu', dtype=torch.bfloat16)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-warmup", type=int, default=5)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--attention", choices=["sdpa", "manual"], default="sdpa",
                   help="sdpa: F.scaled_dot_product_attention(is_causal=True); manual: matmul, mask, softmax, matmul")
    p.add_argument("--init-from", default="", help="pipewright checkpoint directory to load weights from")
    p.add_argument("--port", type=int, default=0, help="gloo rendezvous port (0: pick a free one)")
    p.add_argument("--profile", action="store_true",
                   help="single mode: run the last step under torch.profiler and print its ops by "
                        "self CPU time to stderr (that step's time includes the profiler)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- data: pipewright's synthetic task

M64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def hash_combine(a, b):
    return splitmix64(a ^ splitmix64(b))


def synthetic_tokens(seed, index, seq_len):
    """runtime/data.cc, class Synthetic: seq_len + 1 tokens of sample `index`."""
    key = hash_combine(seed ^ 0x73796E00, index)
    period = 2 + splitmix64(key) % 7
    pattern = [ord("a") + hash_combine(key, i + 1) % 16 for i in range(period)]
    return [pattern[t % period] for t in range(seq_len + 1)]


def make_batches(torch, args):
    """(inputs, targets) per step, [G, T] int64 each, samples in pipewright's order."""
    G = args.micro_batches * args.micro_batch_size
    out = []
    for s in range(args.steps):
        rows = [synthetic_tokens(args.seed, s * G + i, args.seq) for i in range(G)]
        t = torch.tensor(rows, dtype=torch.long)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


# ---------------------------------------------------------------- model helpers


def autocast(torch, precision):
    """The context a Part's forward runs in: bf16 autocast, or nothing."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def head_parts(a, begin, end):
    """(has_embed, has_head, head_on_embed, head_is_copy) of the part [begin, end)."""
    L = a.layers
    has_embed = begin <= 0 < end
    has_head = begin <= L + 2 < end
    tied = bool(a.tied)
    return has_embed, has_head, tied and has_head and has_embed, tied and has_head and not has_embed


def loss_of(F, logits, target, vocab):
    return F.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1))


# ---------------------------------------------------------------- checkpoints


def read_safetensors(torch, path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise SystemExit(f"{path}: {name} is {info['dtype']}, expected F32")
        b, e = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[b:e]), dtype=torch.float32).reshape(info["shape"])
    return out


def own_names(model):
    """The checkpoint names of the part's parameters (a tied copy is its owner's, listed once)."""
    copy = getattr(model, "tied_copy", None)
    return sorted(n for n, _ in model.named_parameters() if n != copy)


def load_checkpoint(torch, model, ckpt_dir, whole):
    """Copies the checkpoint's tensors into `model`; names and shapes must match exactly (and,
    for the whole model, the checkpoint may hold no other tensor). A tied copy loads the
    owner's tensor."""
    if not os.path.exists(os.path.join(ckpt_dir, "manifest.json")):  # a checkpoint directory
        with open(os.path.join(ckpt_dir, "latest")) as f:
            ckpt_dir = os.path.join(ckpt_dir, f.read().strip())
    tensors = read_safetensors(torch, os.path.join(ckpt_dir, "model.safetensors"))
    own = dict(model.named_parameters())
    copy = getattr(model, "tied_copy", None)
    if whole and sorted(tensors) != own_names(model):
        extra = sorted(set(tensors) - set(own))
        missing = sorted(set(own_names(model)) - set(tensors))
        raise SystemExit(f"{ckpt_dir}: tensors the PyTorch model lacks: {extra}; "
                         f"tensors the checkpoint lacks: {missing}")
    for name, p in own.items():
        src = OWNER if name == copy else name
        if src not in tensors:
            raise SystemExit(f"{ckpt_dir}: no tensor {src}")
        if list(tensors[src].shape) != list(p.shape):
            raise SystemExit(f"{ckpt_dir}: {src} is {list(tensors[src].shape)}, model has {list(p.shape)}")
        with torch.no_grad():
            p.copy_(tensors[src])
    return sorted(tensors), sorted(own)


# ---------------------------------------------------------------- optimizer


def make_optimizer(torch, model, a, decays):
    decay, no_decay = [], []
    copy = getattr(model, "tied_copy", None)
    for name, p in model.named_parameters():
        (decay if decays(OWNER if name == copy else name) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": a.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)

    def factor(step):  # runtime/optimizer.cc LrSchedule::At / peak
        if a.lr_warmup > 0 and step < a.lr_warmup:
            return (step + 1) / a.lr_warmup
        decay_steps = max(1, a.steps - a.lr_warmup)
        progress = min(1.0, (step - a.lr_warmup) / decay_steps)
        return a.min_lr_ratio + (1.0 - a.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    n_tensors = sum(len(g) for g in (decay, no_decay)) - (1 if copy else 0)
    n_decay = len(decay) - (1 if copy else 0)
    return opt, sched, n_tensors, n_decay


def clip_global(torch, model, max_norm, group=None):
    """Global-norm clipping; with a process group the squared norms of all stages are summed.
    A tied copy's gradient (equal to its owner's after the tie's all-reduce) counts once."""
    copy = getattr(model, "tied_copy", None)
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    grads = [g for _, g in named]
    sq = torch.zeros((), dtype=torch.float64)
    for n, g in named:
        if n != copy:
            sq += g.double().pow(2).sum()
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(sq, group=group)
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def param_count(model):
    copy = getattr(model, "tied_copy", None)
    return sum(p.numel() for n, p in model.named_parameters() if n != copy)


def tied_count(model, a):
    """The tied weight's elements when the part holds the embedding of a tied model, else 0:
    `pipewright train --json` counts them twice (its summary adds every layer's parameters,
    the head's copy included; `pipewright model` counts them once)."""
    own = dict(model.named_parameters())
    return own[OWNER].numel() if a.tied and OWNER in own else 0


# ---------------------------------------------------------------- run reports


def setup_torch(a):
    import torch
    torch.set_num_threads(a.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    return torch


def versions(torch):
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": sys.version.split()[0]}
    try:
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch
        pass
    cfg = torch.__config__.show()
    for line in cfg.splitlines():
        line = line.strip()
        if "Math Kernel Library Version" in line:
            info["mkl"] = line.split("Version")[1].split("-")[0].strip()
        elif line.startswith("- Intel(R) MKL-DNN") or line.startswith("- Intel(R) oneDNN"):
            info["onednn"] = line.split()[3] if len(line.split()) > 3 else line
    return info


def summarize(a, step_times, losses, norms, extra):
    G = a.micro_batches * a.micro_batch_size
    timed = step_times[a.skip:] if len(step_times) > a.skip else step_times
    med = statistics.median(timed) if timed else float("nan")
    out = {
        "mode": a.mode,
        "pp": 1 if a.mode == "single" else len(a.bounds) - 1,
        "steps": a.steps, "skipped": min(a.skip, len(step_times)),
        "global_batch": G, "micro_batches": a.micro_batches, "micro_batch_size": a.micro_batch_size,
        "median_step_time_s": med,
        "samples_per_s": G / med if med > 0 else 0.0,
        "step_time_s": step_times, "loss": losses, "grad_norm": norms,
        "attention": a.attention, "model": a.model_name, "precision": a.precision,
        "tied": bool(a.tied),
    }
    out.update(extra)
    return out


# ---------------------------------------------------------------- pp = 1


def build_model(torch, model_def, a, begin, end):
    Part = model_def.build_classes(torch)
    torch.manual_seed(a.seed)
    part = Part(a, begin, end)
    model_def.init_params(torch, part, a)
    return part


def run_single(model_def, a):
    torch = setup_torch(a)
    F = torch.nn.functional
    model = build_model(torch, model_def, a, 0, a.layers + 4)
    names = None
    if a.init_from:
        names, _ = load_checkpoint(torch, model, a.init_from, whole=True)
    opt, sched, n_tensors, n_decay = make_optimizer(torch, model, a, model_def.decays)
    batches = make_batches(torch, a)
    M, B, V = a.micro_batches, a.micro_batch_size, a.vocab
    step_times, losses, norms = [], [], []
    for s in range(a.steps):
        x, y = batches[s]
        prof = None
        if a.profile and s == a.steps - 1:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.start()
        t0 = time.perf_counter()
        total = 0.0
        for j in range(M):
            logits = model(x[j * B:(j + 1) * B])
            loss = loss_of(F, logits, y[j * B:(j + 1) * B], V)
            (loss / M).backward()
            total += loss.item() / M
        norms.append(clip_global(torch, model, a.clip))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        losses.append(total)
        if prof is not None:
            prof.stop()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
                  file=sys.stderr)
    extra = {"parameters": param_count(model), "tied_parameters": tied_count(model, a),
             "decayed_tensors": n_decay,
             "tensors": n_tensors, "versions": versions(torch),
             "parameter_names": own_names(model)}
    if names is not None:
        extra["checkpoint_tensors"] = len(names)
    return summarize(a, step_times, losses, norms, extra)


# ---------------------------------------------------------------- pp > 1, torch.distributed.pipelining


def pipe_worker(rank, module_name, a, port, queue):
    try:
        model_def = importlib.import_module(module_name)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch = setup_torch(a)
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        F = torch.nn.functional
        world = len(a.bounds) - 1
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # The tie across ranks: the embedding's rank (0) and the head's (the last) sum the two
        # gradients of the one weight. Every rank takes part in creating the group.
        tie_group = None
        if a.tied and world > 1:
            tie_group = dist.new_group([0, world - 1])
        part = build_model(torch, model_def, a, a.bounds[rank], a.bounds[rank + 1])
        if a.init_from:
            load_checkpoint(torch, part, a.init_from, whole=False)
        opt, sched, n_tensors, n_decay = make_optimizer(torch, part, a, model_def.decays)
        V = a.vocab
        tied_here = None
        if tie_group is not None and rank in (0, world - 1):
            own = dict(part.named_parameters())
            tied_here = own[part.tied_copy] if rank == world - 1 else own[OWNER]

        def loss_fn(logits, target):
            return loss_of(F, logits, target, V)

        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=a.micro_batches, loss_fn=loss_fn)
        batches = make_batches(torch, a)
        first, last = rank == 0, rank == world - 1
        step_times, losses, norms = [], [], []
        for s in range(a.steps):
            x, y = batches[s]
            t0 = time.perf_counter()
            mb_losses = []
            if first:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=mb_losses)
            else:
                schedule.step()
            if tied_here is not None:
                dist.all_reduce(tied_here.grad, group=tie_group)
            norms.append(clip_global(torch, part, a.clip, group=dist.group.WORLD))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - t0)
            if last:
                losses.append(sum(float(v.detach()) for v in mb_losses) / len(mb_losses))
        queue.put({"rank": rank, "step_time_s": step_times, "loss": losses, "grad_norm": norms,
                   "parameters": param_count(part), "tied_parameters": tied_count(part, a),
                   "tensors": n_tensors,
                   "decayed_tensors": n_decay, "parameter_names": own_names(part),
                   "versions": versions(torch) if first else None})
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # report, so the parent does not wait forever
        import traceback
        queue.put({"rank": rank, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        raise


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipe(module_name, a):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    world = len(a.bounds) - 1
    port = a.port or free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=pipe_worker, args=(r, module_name, a, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < world:
        try:
            r = queue.get(timeout=600)
        except Exception:  # noqa: BLE001
            break
        if "error" in r:
            for p in procs:
                p.terminate()
            raise SystemExit(f"pipe rank {r['rank']} failed:\n{r['error']}")
        results[r["rank"]] = r
    for p in procs:
        p.join(timeout=60)
    if len(results) < world:
        for p in procs:
            if p.is_alive():
                p.terminate()
        raise SystemExit(f"pipe: only {len(results)} of {world} ranks reported")
    ranks = [results[r] for r in range(world)]
    # A step ends when its slowest rank ends (the clipping all-reduce aligns the ranks).
    step_times = [max(r["step_time_s"][s] for r in ranks) for s in range(a.steps)]
    extra = {"parameters": sum(r["parameters"] for r in ranks),
             "tied_parameters": sum(r["tied_parameters"] for r in ranks),
             "tensors": sum(r["tensors"] for r in ranks),
             "decayed_tensors": sum(r["decayed_tensors"] for r in ranks),
             "stage_boundaries": a.bounds,
             "stage_parameters": [r["parameters"] for r in ranks],
             "parameter_names": sorted(n for r in ranks for n in r["parameter_names"]),
             "schedule": "torch.distributed.pipelining.Schedule1F1B (gloo, one process per stage)",
             "versions": ranks[0]["versions"]}
    return summarize(a, step_times, ranks[-1]["loss"], ranks[0]["grad_norm"], extra)


def main(module_name, model_name, description):
    """The command line of gpt.py and llama.py: `module_name` is the model definition's module."""
    model_def = importlib.import_module(module_name)
    a = parse_args(model_def, description)
    a.model_name = model_name
    L = a.layers
    if a.mode == "pipe":
        if not a.boundaries:
            raise SystemExit("--mode pipe needs --boundaries (pipewright's stage_boundaries, e.g. 0,4,10)")
        a.bounds = [int(v) for v in a.boundaries.split(",")]
        if a.bounds[0] != 0 or a.bounds[-1] != L + 4 or any(x >= y for x, y in zip(a.bounds, a.bounds[1:])):
            raise SystemExit(f"--boundaries {a.boundaries}: must rise from 0 to {L + 4}")
        if a.bounds[-2] >= L + 3:
            raise SystemExit("--boundaries: the last stage must hold more than the loss")
        out = run_pipe(module_name, a)
    else:
        a.bounds = [0, L + 4]
        out = run_single(model_def, a)
    print(json.dumps(out))
