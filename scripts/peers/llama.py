#!/usr/bin/env python3
"""pipewright's Llama (docs/models.md, "Llama family") in PyTorch, trained the way
`pipewright train --model llama:...` trains it. Written independently of pipewright's layers and
of transformers' LlamaForCausalLM, in transformers' conventions.

Used by scripts/bench-peers (--model llama-small); runnable on its own, with gpt.py's command
line and JSON output (scripts/peers/common.py):

  llama.py --mode single ...   plain PyTorch loop (pp=1): gradient accumulation over M micro-batches
  llama.py --mode pipe ...     torch.distributed.pipelining: PipelineStage + Schedule1F1B, gloo,
                               one process per stage, split at --boundaries

The model:
  * embed: the token table embed.wte.weight [V, C]; no learned positions;
  * L blocks: h = x + o_proj(attn(rope(q), rope(k), v)) of input_layernorm(x), then
    out = h + down_proj(silu(gate) * up) of post_attention_layernorm(h). q | k | v are one
    bias-free product self_attn.qkv.weight [C + 2K, C] (K = kv_heads x head dim), gate | up one
    product mlp.gate_up.weight [2F, C], as pipewright fuses them; o_proj [C, C], down_proj [C, F];
  * RMSNorm: w * x / sqrt(mean(x^2) + eps), in fp32 (transformers' LlamaRMSNorm), eps 1e-5;
  * rotary embeddings, transformers' convention: rotate_half pairs (i, i + D/2) of each head,
    inv_freq = 1 / theta^(arange(0, D, 2) / D) in float, angle = position * inv_freq, cos and
    sin cast to the activations' dtype; positions 0..T-1 in every sequence;
  * grouped-query attention: F.scaled_dot_product_attention(q, k, v, is_causal=True,
    enable_gqa=True), query head h reading kv head h // (heads / kv_heads) (transformers'
    repeat_kv); --attention manual expands k and v and computes matmul, mask, softmax, matmul;
  * norm.weight, then lm_head.weight [V, C] without bias, or (--tied 1) the token table.
AdamW decays the 2-D weights (embed.wte, the four products, lm_head), not the norms.

The defaults are llama-small: pipewright
  --model llama:layers=6,hidden=256,heads=8,kv_heads=4,ffn=688,vocab=256,seq=128,tied=0
(gpt-small's size; ffn = 8/3 x 256 rounded up to a multiple of 16, the rule llama-tiny's 176
follows; 4 kv heads for 8 query heads, so grouped-query attention is exercised).
"""

import math
import zlib

import common


def add_model_args(p):
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--tied", type=int, choices=[0, 1], default=0,
                   help="1: the LM head is the token table; 0: its own lm_head.weight (default)")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--norm-eps", type=float, default=1e-5, help="RMSNorm epsilon")


def build_classes(torch):
    nn = torch.nn
    F = torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            dtype = x.dtype
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * h.to(dtype)

    class Rotary(nn.Module):
        """cos and sin [T, D] of transformers' LlamaRotaryEmbedding (default rope type)."""

        def __init__(self, head_dim, theta):
            super().__init__()
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)

        def forward(self, T, dtype):
            with torch.autocast("cpu", enabled=False):
                pos = torch.arange(T, dtype=torch.float32)
                freqs = pos[:, None] * self.inv_freq[None, :]
                emb = torch.cat((freqs, freqs), dim=-1)
                return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class Attention(nn.Module):
        def __init__(self, a):
            super().__init__()
            self.heads, self.kv_heads = a.heads, a.kv_heads
            self.head_dim = a.hidden // a.heads
            self.manual = a.attention == "manual"
            self.qkv = nn.Linear(a.hidden, a.hidden + 2 * a.kv_heads * self.head_dim, bias=False)
            self.o_proj = nn.Linear(a.hidden, a.hidden, bias=False)
            self.rotary = Rotary(self.head_dim, a.rope_theta)

        def forward(self, x):
            B, T, C = x.shape
            H, KH, D = self.heads, self.kv_heads, self.head_dim
            q, k, v = self.qkv(x).split([C, KH * D, KH * D], dim=2)
            q = q.view(B, T, H, D).transpose(1, 2)
            k = k.view(B, T, KH, D).transpose(1, 2)
            v = v.view(B, T, KH, D).transpose(1, 2)
            cos, sin = self.rotary(T, q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if self.manual:
                k = k.repeat_interleave(H // KH, dim=1)
                v = v.repeat_interleave(H // KH, dim=1)
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
                y = att @ v
            else:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KH != H)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

    class MLP(nn.Module):
        def __init__(self, dim, ffn):
            super().__init__()
            self.ffn = ffn
            self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
            self.down_proj = nn.Linear(ffn, dim, bias=False)

        def forward(self, x):
            gate, up = self.gate_up(x).split(self.ffn, dim=-1)
            return self.down_proj(F.silu(gate) * up)

    class Block(nn.Module):
        def __init__(self, a):
            super().__init__()
            self.input_layernorm = RMSNorm(a.hidden, a.norm_eps)
            self.self_attn = Attention(a)
            self.post_attention_layernorm = RMSNorm(a.hidden, a.norm_eps)
            self.mlp = MLP(a.hidden, a.ffn)

        def forward(self, x):
            h = x + self.self_attn(self.input_layernorm(x))
            return h + self.mlp(self.post_attention_layernorm(h))

    class Embed(nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.wte = nn.Embedding(vocab, dim)

        def forward(self, idx):
            return self.wte(idx)

    class LlamaPart(nn.Module):
        """pipewright layer-graph nodes [begin, end): 0 embed, 1..L blocks, L+1 norm, L+2
        lm_head (L+3, the loss, is the schedule's loss_fn)."""

        def __init__(self, a, begin, end):
            super().__init__()
            L = a.layers
            if a.hidden % a.heads or (a.hidden // a.heads) % 2 or a.heads % a.kv_heads:
                raise SystemExit("llama: hidden must split into heads of an even size, and heads "
                                 "into kv_heads groups")
            has_embed, has_head, self.head_on_embed, head_is_copy = common.head_parts(a, begin, end)
            self.precision = a.precision
            self.embed = Embed(a.vocab, a.hidden) if has_embed else None
            self.blocks = nn.ModuleDict({str(i): Block(a) for i in range(L) if begin <= i + 1 < end})
            self.norm = RMSNorm(a.hidden, a.norm_eps) if begin <= L + 1 < end else None
            make_head = has_head and not self.head_on_embed
            self.lm_head = nn.Linear(a.hidden, a.vocab, bias=False) if make_head else None
            self.tied_copy = "lm_head.weight" if head_is_copy else None

        def forward(self, x):
            with common.autocast(torch, self.precision):
                if self.embed is not None:
                    x = self.embed(x)
                for blk in self.blocks.values():
                    x = blk(x)
                if self.norm is not None:
                    x = self.norm(x)
                if self.head_on_embed:
                    x = F.linear(x, self.embed.wte.weight)
                elif self.lm_head is not None:
                    x = self.lm_head(x)
            return x

    return LlamaPart


def decays(name):
    """pipewright's Parameter::weight_decay: the token table and every product's weight."""
    if name in ("embed.wte.weight", "lm_head.weight"):
        return True
    return any(name.endswith(f".{m}.weight") for m in ("self_attn.qkv", "self_attn.o_proj",
                                                        "mlp.gate_up", "mlp.down_proj"))


def init_params(torch, model, a):
    """pipewright's distributions (runtime/layers/llama.cc: norms 1, everything else N(0, 0.02));
    each parameter from (seed, name), values differ from pipewright's generator."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = common.OWNER if name == model.tied_copy else name  # a tied copy starts equal
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            g = torch.Generator().manual_seed((a.seed * 1000003 + zlib.crc32(name.encode())) & ((1 << 63) - 1))
            p.normal_(0.0, 0.02, generator=g)


if __name__ == "__main__":
    common.main("llama", "llama", __doc__)
