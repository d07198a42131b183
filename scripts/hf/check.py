"""Loads a `pipewright export --format hf` directory with transformers and checks it against
pipewright: the loss of the model (GPT2LMHeadModel or LlamaForCausalLM, as config.json says) on the tokens `pipewright eval --dump` evaluated must equal
pipewright's eval loss within --tol. Prints one JSON line; exit 1 when it does not match.

Run by scripts/hf-check (which makes the export and the dump); usable alone:
  python scripts/hf/check.py --model OUT --dump dump.json [--tol 1e-5]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="directory written by pipewright export")
    ap.add_argument("--dump", required=True, help="JSON written by pipewright eval --dump")
    ap.add_argument("--tol", type=float, default=1e-5, help="largest |loss difference| allowed")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    model.eval()
    with open(a.dump) as f:
        d = json.load(f)
    x = torch.tensor(d["inputs"], dtype=torch.long)
    y = torch.tensor(d["targets"], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    tied = (model.get_output_embeddings().weight.data_ptr()
            == model.get_input_embeddings().weight.data_ptr())
    out = {
        "transformers_loss": loss,
        "pipewright_loss": d["loss"],
        "abs_diff": abs(loss - d["loss"]),
        "tol": a.tol,
        "model_type": model.config.model_type,
        "tie_word_embeddings": model.config.tie_word_embeddings,
        "lm_head_is_wte": tied,
        "parameters": sum(p.numel() for p in model.parameters()),
        "sequences": int(x.shape[0]),
    }
    ok = out["abs_diff"] <= a.tol and tied == bool(model.config.tie_word_embeddings)
    out["ok"] = ok
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
