#!/usr/bin/env python
"""Write a tiny random-weights Llama as a Hugging Face directory (dev-only).

Output (default ``tests/data/tiny-llama/``, well under 2 MB):

- ``config.json``            LlamaForCausalLM: hidden 64, intermediate 128,
                             2 layers, 4 heads / 2 KV heads, head_dim 16,
                             vocab 384, max_position_embeddings 256,
                             rope_theta 10000 (written both as top-level
                             ``rope_theta`` and as transformers-5
                             ``rope_parameters``), untied embeddings,
                             rms_norm_eps 1e-5, bos 0 ``<s>``, eos 1 ``</s>``.
- ``model.safetensors``      float32 weights, seeded normal init with
                             std ``--init-std`` (default 0.15, not 0.02) and
                             lm_head std ``--lm-head-std`` (default 0.5) so
                             logits are spread out (no near-ties) and greedy
                             streams are not degenerate; RMSNorm weights are
                             ``1 + N(0, 0.1)`` so norms are exercised.
- ``tokenizer.json``         byte-level BPE trained with ``tokenizers`` on a
                             built-in English text; specials ``<s>``=0,
                             ``</s>``=1; ByteLevel(add_prefix_space=False)
                             pre-tokenizer and decoder; no post-processor
                             (nothing is added automatically, no BOS).
- ``tokenizer_config.json``  bos/eos tokens and a small jinja chat template.
- ``generation_config.json`` bos/eos ids, greedy.

Deterministic: fixed seeds; the BPE trainer is run single-threaded and its
result is checked for byte-identical output on a second training run.

Usage
-----
    . .venv/bin/activate
    python scripts/make_tiny_model.py                 # -> tests/data/tiny-llama/
    python scripts/make_tiny_model.py --out /tmp/tiny --seed 0
    python scripts/make_golden.py --model tiny        # then regenerate golden_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "data" / "tiny-llama"

VOCAB_SIZE = 384
BOS, EOS = "<s>", "</s>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun and the
fox runs into the forest. One two three four five six seven eight nine ten.
1 2 3 4 5 6 7 8 9 10 11 12 100 2024. Hello, how are you? I am fine, thank you.
The history of the printing press begins in the fifteenth century, when a
goldsmith in the city of Mainz combined movable metal type, oil based ink and
a wooden press. Books became cheaper, and reading spread across the land.
A small language model predicts the next token from the tokens that came
before it. It reads the prompt, stores keys and values in a cache, and then
generates one token at a time. The model has layers of attention and a
feed forward network; each layer is followed by a normalization step.
Rivers run to the sea, and the sea returns the rain to the mountains.
The cat sat on the mat. The man and the woman walked to the market to buy
bread, milk, apples, and cheese for the evening meal.
def add(a, b):
    return a + b
for i in range(10):
    print(i)
Question: what is the capital of France? Answer: the capital of France is Paris.
The weather today is warm and bright, with a light wind from the west.
"""


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


def build_model(seed: int, init_std: float, lm_head_std: float):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=0,
        eos_token_id=1, initializer_range=init_std, hidden_act="silu",
        attention_bias=False, mlp_bias=False, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(lm_head_std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    model.eval()
    return model, cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=2,
                    help="seed 2 chosen: smallest greedy top-2 gap in golden_tiny is > 0.03")
    ap.add_argument("--init-std", type=float, default=0.15)
    ap.add_argument("--lm-head-std", type=float, default=0.5,
                    help="larger lm_head init spreads the logits (bigger top-2 gaps)")
    args = ap.parse_args(argv)
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    # --- tokenizer -------------------------------------------------------
    tok = build_tokenizer()
    tok_json = tok.to_str(pretty=True)
    if build_tokenizer().to_str(pretty=True) != tok_json:
        raise SystemExit("BPE training is not deterministic")
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer vocab {tok.get_vocab_size()} != {VOCAB_SIZE}")
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1
    (out / "tokenizer.json").write_text(tok_json + "\n", encoding="utf-8")

    # --- model -----------------------------------------------------------
    model, cfg = build_model(args.seed, args.init_std, args.lm_head_std)
    model.save_pretrained(out, safe_serialization=True)
    # Rewrite config.json: stable key order, and also expose rope_theta at top
    # level (transformers < 5 style) next to rope_parameters (transformers 5).
    conf = json.loads((out / "config.json").read_text())
    conf.pop("transformers_version", None)
    conf["architectures"] = ["LlamaForCausalLM"]
    conf["rope_theta"] = 10000.0
    conf["rope_scaling"] = None
    conf["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    gen_conf = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    (out / "generation_config.json").write_text(
        json.dumps(gen_conf, indent=2, sort_keys=True) + "\n")

    tok_conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_conf, indent=2, sort_keys=True) + "\n")
    # Older transformers also writes special_tokens_map.json; not needed.

    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    for p in sorted(out.iterdir()):
        print(f"{p.stat().st_size:>9}  {p}")
    print(f"total {total} bytes")
    if total >= 2 * 1024 * 1024:
        raise SystemExit("tiny model directory is >= 2 MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
