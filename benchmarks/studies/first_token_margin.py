"""The first reply token of ``kvcore chat "What is the capital of France?"`` on the embedded SmolLM2, per weight
format: the top candidates' logits (float32 products of each format's final hidden state with the head, so that
bfloat16 logit rounding does not hide the order), and each format's greedy reply.

The float32 reference puts "The" (then "The capital of France is Paris.") only a tenth of a logit above "L"
(then a French reply): a perturbation of that size, from any format's rounding, changes the answer.

    python benchmarks/studies/first_token_margin.py [--tokens 10]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kvcore.loaders import build_model, load_model

FORMATS = {"float32": (torch.float32, "float"), "bf16": (torch.bfloat16, "float"), "int4": (torch.bfloat16, "int4"),
           "int4a8": (torch.bfloat16, "int4a8")}


def full_attention(layer, q, k, v):
    """Causal attention over the whole call in float32 (one sequence, no cache)."""
    rep = q.shape[1] // k.shape[1]
    dtype = q.dtype
    q, k, v = (t.transpose(0, 1).float() for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2", keep_quantized=True)
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True)
    prompt = torch.tensor(tok.encode(text, add_bos=False))
    head = loaded.weights["model.embed_tokens.weight"].float()  # tied embeddings
    for name, (dtype, weights) in FORMATS.items():
        model = build_model(loaded, dtype, max_model_len=128, weights=weights)
        ids, reply = prompt, []
        with torch.no_grad():
            for step in range(args.tokens):
                hidden = model(ids, torch.arange(len(ids)), full_attention)[-1:]
                if step == 0:
                    logits = hidden.float() @ head.to(dtype).float().t()
                    top = logits[0].topk(4)
                    print(f"{name:8s} first token: " + ", ".join(
                        f"{tok.decode([i])!r} {v:.3f}" for v, i in zip(top.values.tolist(), top.indices.tolist())))
                nxt = model.compute_logits(hidden).argmax(-1)
                reply.append(int(nxt))
                ids = torch.cat([ids, nxt])
        print(f"{name:8s} greedy reply: {tok.decode(reply)!r}")


if __name__ == "__main__":
    main()
