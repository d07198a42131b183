#!/usr/bin/env python3
"""The GPT of docs/checkpoint.md in PyTorch, trained the way `pipewright train` trains it.

Used by scripts/bench-peers; runnable on its own:

  gpt.py --mode single ...   plain PyTorch loop (pp=1): gradient accumulation over M micro-batches
  gpt.py --mode pipe ...     torch.distributed.pipelining: PipelineStage + Schedule1F1B, gloo,
                             one process per stage (torch.multiprocessing), split at --boundaries
  gpt.py --mode single --profile ...   also prints the last step's ops by self CPU time
                             (torch.profiler) to stderr: where PyTorch's step goes

Everything that decides the compute follows pipewright:
  * model: embed (wte [V,C] + learned wpe [S,C]), L pre-LN blocks (ln_1, attn.qkv [3C,C] + bias,
    causal softmax attention, attn.proj, ln_2, mlp.fc [4C,C], GELU tanh approximation,
    mlp.proj), ln_f, untied lm_head [V,C] without bias, LayerNorm eps 1e-5, no dropout; parameter
    names and shapes are those of pipewright's checkpoints (model.safetensors);
  * loss: mean token cross-entropy per micro-batch, step loss = mean over micro-batches
    (the gradient of the mean over the whole global batch);
  * optimizer: AdamW (betas 0.9/0.95, eps 1e-8, decoupled weight decay 0.1 on Linear weights,
    lm_head and wte only), linear LR warm-up then cosine decay to min_lr_ratio x peak over
    --steps, gradient clipping to a global norm of 1.0 (over both stages with pp=2);
  * data: pipewright's synthetic task (docs/data.md), bit for bit: step s uses samples
    [s*G, (s+1)*G), micro-batch j holds samples s*G + j*B + b.

--init-from DIR loads a pipewright checkpoint's model.safetensors, so both sides start from the
same weights and their losses can be compared step by step (scripts/bench-peers --check).

Output: one JSON object on stdout (per-step times, losses, grad norms, samples/s = G / median
step time over the steps after --skip, parameter count, versions).
"""

import argparse
import json
import math
import os
import statistics
import struct
import sys
import time
import zlib


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["single", "pipe"], default="single")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (also the LR schedule's length)")
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the timing (warm-up)")
    p.add_argument("--boundaries", default="",
                   help="pipewright layer-graph stage boundaries, e.g. 0,4,10 (layer 0 = embed, "
                        "1..L = blocks, L+1 = ln_f, L+2 = lm_head, L+3 = loss); --mode pipe")
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


# ---------------------------------------------------------------- model


def build_classes(torch):
    nn = torch.nn
    F = torch.nn.functional

    class Embed(nn.Module):
        def __init__(self, vocab, seq, dim):
            super().__init__()
            self.wte = nn.Embedding(vocab, dim)
            self.wpe = nn.Embedding(seq, dim)

        def forward(self, idx):
            T = idx.shape[1]
            pos = torch.arange(T, device=idx.device)
            return self.wte(idx) + self.wpe(pos)

    class Attention(nn.Module):
        def __init__(self, dim, heads, manual):
            super().__init__()
            self.heads, self.manual = heads, manual
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            B, T, C = x.shape
            H = self.heads
            D = C // H
            q, k, v = self.qkv(x).split(C, dim=2)
            q, k, v = (z.view(B, T, H, D).transpose(1, 2) for z in (q, k, v))
            if self.manual:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
                y = att @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, C))

    class MLP(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.fc = nn.Linear(dim, 4 * dim)
            self.proj = nn.Linear(4 * dim, dim)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, dim, heads, manual):
            super().__init__()
            self.ln_1 = nn.LayerNorm(dim, eps=1e-5)
            self.attn = Attention(dim, heads, manual)
            self.ln_2 = nn.LayerNorm(dim, eps=1e-5)
            self.mlp = MLP(dim)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPTPart(nn.Module):
        """pipewright layer-graph nodes [begin, end) (the loss node is the schedule's loss_fn)."""

        def __init__(self, a, begin, end):
            super().__init__()
            L = a.layers
            self.embed = Embed(a.vocab, a.seq, a.hidden) if begin <= 0 < end else None
            self.blocks = nn.ModuleDict({
                str(i): Block(a.hidden, a.heads, a.attention == "manual")
                for i in range(L) if begin <= i + 1 < end
            })
            self.ln_f = nn.LayerNorm(a.hidden, eps=1e-5) if begin <= L + 1 < end else None
            self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False) if begin <= L + 2 < end else None

        def forward(self, x):
            if self.embed is not None:
                x = self.embed(x)
            for blk in self.blocks.values():
                x = blk(x)
            if self.ln_f is not None:
                x = self.ln_f(x)
            if self.lm_head is not None:
                x = self.lm_head(x)
            return x

    return GPTPart


def decays(name):
    """docs/checkpoint.md: AdamW decays Linear weights, lm_head.weight and wte only."""
    if name == "embed.wte.weight" or name == "lm_head.weight":
        return True
    if not name.endswith(".weight"):
        return False
    return any(f".{m}.weight" in f".{name}" for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))


def init_params(torch, model, a):
    """docs/checkpoint.md's distributions; each parameter from (seed, name), so a stage's
    parameters do not depend on the split (values differ from pipewright's generator)."""
    resid_std = 0.02 / math.sqrt(2 * a.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed((a.seed * 1000003 + zlib.crc32(name.encode())) & ((1 << 63) - 1))
            if name.endswith(".bias") or "ln_" in name:
                p.fill_(1.0 if ("ln_" in name and name.endswith(".weight")) else 0.0)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                p.normal_(0.0, resid_std, generator=g)
            elif name == "embed.wpe.weight":
                p.normal_(0.0, 0.01, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)


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


def load_checkpoint(torch, model, ckpt_dir, whole):
    """Copies the checkpoint's tensors into `model`; names and shapes must match exactly (and,
    for the whole model, the checkpoint may hold no other tensor)."""
    if not os.path.exists(os.path.join(ckpt_dir, "manifest.json")):  # a checkpoint directory
        with open(os.path.join(ckpt_dir, "latest")) as f:
            ckpt_dir = os.path.join(ckpt_dir, f.read().strip())
    tensors = read_safetensors(torch, os.path.join(ckpt_dir, "model.safetensors"))
    own = dict(model.named_parameters())
    if whole and sorted(tensors) != sorted(own):
        extra = sorted(set(tensors) - set(own))
        raise SystemExit(f"{ckpt_dir}: tensors the PyTorch model lacks: {extra}")
    for name, p in own.items():
        if name not in tensors:
            raise SystemExit(f"{ckpt_dir}: no tensor {name}")
        if list(tensors[name].shape) != list(p.shape):
            raise SystemExit(f"{ckpt_dir}: {name} is {list(tensors[name].shape)}, model has {list(p.shape)}")
        with torch.no_grad():
            p.copy_(tensors[name])
    return sorted(tensors), sorted(own)


def make_optimizer(torch, model, a):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if decays(name) else no_decay).append(p)
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
    return opt, sched, sum(len(g) for g in (decay, no_decay)), len(decay)


def clip_global(torch, params, max_norm, group=None):
    """Global-norm clipping; with a process group the squared norms of all stages are summed."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.double().pow(2).sum()
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(sq, group=group)
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


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
        "attention": a.attention,
    }
    out.update(extra)
    return out


# ---------------------------------------------------------------- pp = 1


def run_single(a):
    torch = setup_torch(a)
    F = torch.nn.functional
    GPTPart = build_classes(torch)
    torch.manual_seed(a.seed)
    model = GPTPart(a, 0, a.layers + 4)
    init_params(torch, model, a)
    names = None
    if a.init_from:
        names, _ = load_checkpoint(torch, model, a.init_from, whole=True)
    params = list(model.parameters())
    opt, sched, _, n_decay = make_optimizer(torch, model, a)
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
            loss = F.cross_entropy(logits.reshape(-1, V), y[j * B:(j + 1) * B].reshape(-1))
            (loss / M).backward()
            total += loss.item() / M
        norms.append(clip_global(torch, params, a.clip))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        losses.append(total)
        if prof is not None:
            prof.stop()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20),
                  file=sys.stderr)
    extra = {"parameters": sum(p.numel() for p in params), "decayed_tensors": n_decay,
             "tensors": len(params), "versions": versions(torch),
             "parameter_names": sorted(n for n, _ in model.named_parameters())}
    if names is not None:
        extra["checkpoint_tensors"] = len(names)
    return summarize(a, step_times, losses, norms, extra)


# ---------------------------------------------------------------- pp = 2, torch.distributed.pipelining


def pipe_worker(rank, a, port, queue):
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch = setup_torch(a)
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        F = torch.nn.functional
        world = len(a.bounds) - 1
        dist.init_process_group("gloo", rank=rank, world_size=world)
        GPTPart = build_classes(torch)
        torch.manual_seed(a.seed)
        part = GPTPart(a, a.bounds[rank], a.bounds[rank + 1])
        init_params(torch, part, a)
        if a.init_from:
            load_checkpoint(torch, part, a.init_from, whole=False)
        params = list(part.parameters())
        opt, sched, n_tensors, n_decay = make_optimizer(torch, part, a)
        V = a.vocab

        def loss_fn(logits, target):
            return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))

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
            norms.append(clip_global(torch, params, a.clip, group=dist.group.WORLD))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - t0)
            if last:
                losses.append(sum(float(v.detach()) for v in mb_losses) / len(mb_losses))
        queue.put({"rank": rank, "step_time_s": step_times, "loss": losses, "grad_norm": norms,
                   "parameters": sum(p.numel() for p in params), "tensors": n_tensors,
                   "decayed_tensors": n_decay,
                   "parameter_names": sorted(n for n, _ in part.named_parameters()),
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


def run_pipe(a):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    world = len(a.bounds) - 1
    port = a.port or free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=pipe_worker, args=(r, a, port, queue)) for r in range(world)]
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
             "tensors": sum(r["tensors"] for r in ranks),
             "decayed_tensors": sum(r["decayed_tensors"] for r in ranks),
             "stage_boundaries": a.bounds,
             "stage_parameters": [r["parameters"] for r in ranks],
             "parameter_names": sorted(n for r in ranks for n in r["parameter_names"]),
             "schedule": "torch.distributed.pipelining.Schedule1F1B (gloo, one process per stage)",
             "versions": ranks[0]["versions"]}
    return summarize(a, step_times, ranks[-1]["loss"], ranks[0]["grad_norm"], extra)


def main():
    a = parse_args()
    L = a.layers
    if a.mode == "pipe":
        if not a.boundaries:
            raise SystemExit("--mode pipe needs --boundaries (pipewright's stage_boundaries, e.g. 0,4,10)")
        a.bounds = [int(v) for v in a.boundaries.split(",")]
        if a.bounds[0] != 0 or a.bounds[-1] != L + 4 or any(x >= y for x, y in zip(a.bounds, a.bounds[1:])):
            raise SystemExit(f"--boundaries {a.boundaries}: must rise from 0 to {L + 4}")
        if a.bounds[-2] >= L + 3:
            raise SystemExit("--boundaries: the last stage must hold more than the loss")
        out = run_pipe(a)
    else:
        a.bounds = [0, L + 4]
        out = run_single(a)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
