#!/usr/bin/env python3
"""The GPT of docs/checkpoint.md in PyTorch, trained the way `pipewright train` trains it.

Used by scripts/bench-peers; runnable on its own:

  gpt.py --mode single ...   plain PyTorch loop (pp=1): gradient accumulation over M micro-batches
  gpt.py --mode pipe ...     torch.distributed.pipelining: PipelineStage + Schedule1F1B, gloo,
                             one process per stage (torch.multiprocessing), split at --boundaries
  gpt.py --mode single --profile ...   also prints the last step's ops by self CPU time
                             (torch.profiler) to stderr: where PyTorch's step goes

The model follows pipewright: embed (wte [V,C] + learned wpe [S,C]), L pre-LN blocks (ln_1,
attn.qkv [3C,C] + bias, causal softmax attention, attn.proj, ln_2, mlp.fc [4C,C], GELU tanh
approximation, mlp.proj), ln_f, lm_head [V,C] without bias (untied by default, as gpt-small;
--tied 1 multiplies by wte instead, as gpt2-124m), LayerNorm eps 1e-5, no dropout; parameter
names and shapes are those of pipewright's checkpoints (model.safetensors). The defaults are
gpt-small's shape; gpt2-124m is --layers 12 --hidden 768 --heads 12 --seq 1024 --vocab 50304
--tied 1.

The loss, optimizer, clipping, data, precision and the two modes are scripts/peers/common.py's
(shared with llama.py). --init-from DIR loads a pipewright checkpoint's model.safetensors, so
both sides start from the same weights and their losses can be compared step by step
(scripts/bench-peers).

Output: one JSON object on stdout (per-step times, losses, grad norms, samples/s = G / median
step time over the steps after --skip, parameter count, versions).
"""

import math
import zlib

import common


def add_model_args(p):
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--tied", type=int, choices=[0, 1], default=0,
                   help="1: the LM head is the token table (gpt2-124m); 0: its own lm_head.weight")


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
            has_embed, has_head, self.head_on_embed, head_is_copy = common.head_parts(a, begin, end)
            self.precision = a.precision
            self.embed = Embed(a.vocab, a.seq, a.hidden) if has_embed else None
            self.blocks = nn.ModuleDict({
                str(i): Block(a.hidden, a.heads, a.attention == "manual")
                for i in range(L) if begin <= i + 1 < end
            })
            self.ln_f = nn.LayerNorm(a.hidden, eps=1e-5) if begin <= L + 1 < end else None
            make_head = has_head and not self.head_on_embed
            self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False) if make_head else None
            self.tied_copy = "lm_head.weight" if head_is_copy else None

        def forward(self, x):
            with common.autocast(torch, self.precision):
                if self.embed is not None:
                    x = self.embed(x)
                for blk in self.blocks.values():
                    x = blk(x)
                if self.ln_f is not None:
                    x = self.ln_f(x)
                if self.head_on_embed:
                    x = F.linear(x, self.embed.wte.weight)
                elif self.lm_head is not None:
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
            name = common.OWNER if name == model.tied_copy else name  # a tied copy starts equal
            g = torch.Generator().manual_seed((a.seed * 1000003 + zlib.crc32(name.encode())) & ((1 << 63) - 1))
            if name.endswith(".bias") or "ln_" in name:
                p.fill_(1.0 if ("ln_" in name and name.endswith(".weight")) else 0.0)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                p.normal_(0.0, resid_std, generator=g)
            elif name == "embed.wpe.weight":
                p.normal_(0.0, 0.01, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)


if __name__ == "__main__":
    common.main("gpt", "gpt", __doc__)
