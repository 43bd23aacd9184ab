"""The prompts of benchmarks/studies/speculative.py: input-grounded (the answer should reuse a given text or code of
>= 500 prompt tokens) and free-form. Each is one user message, rendered with the model's chat template.

The texts are files of this repository, cut at fixed offsets, so a prompt is the same on every checkout of
one commit. Every prompt ever benchmarked stays here (results/speculative.md reports them all, with the
model's greedy answer), whether or not the model follows it.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = (ROOT / "kvcore" / "scheduling" / "block_pool.py").read_text()[:900]
TEXT = (ROOT / "docs" / "design.md").read_text()[:2600]
#: prose: the "How verification works" section of docs/speculative.md
PROSE = (ROOT / "docs" / "speculative.md").read_text().split("## How verification works")[1].split("## ")[0].strip()
#: small functions: the acceptance rules (kvcore/sampling/rejection.py from its first function on)
FUNCS = (ROOT / "kvcore" / "sampling" / "rejection.py").read_text()
FUNCS = FUNCS[FUNCS.index("#: seed offsets") :]
#: the held-out set's texts (speculative_replay.py): other documents and code of this repository
KV_DOC = (ROOT / "docs" / "kv-cache.md").read_text()[:2400]
PERF_DOC = (ROOT / "docs" / "performance.md").read_text()[3000:5400]
SCHED_CODE = (ROOT / "kvcore" / "scheduling" / "scheduler.py").read_text()[2000:3800]
NGRAM_CODE = (ROOT / "kvcore" / "speculative" / "ngram.py").read_text()[2400:4600]


def _with_typos(text: str, every: int = 29) -> str:
    """``text`` with the 2nd and 3rd letters of every ``every``-th longer word swapped (a known set of typos)."""
    words = text.split(" ")
    for i in range(every // 2, len(words), every):
        w = words[i]
        if len(w) > 4 and w.isalpha() and w[1] != w[2]:
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


PROMPTS = {
    # the first set (kept as they were; the model does not copy block_pool.py's code)
    "repeat-code": f"Repeat this Python code exactly, without any change:\n\n{CODE}",
    "edit-code": f"Rename the variable `block_id` to `bid` everywhere in this code and print the whole result:\n\n"
                 f"{CODE}",
    "repeat-text": f"Repeat the following text word for word:\n\n{TEXT}",
    # input-grounded tasks a user asks for: summarise, answer from a document, fix typos, edit code
    "summarise": f"Summarise the following text.\n\n{PROSE}",
    "answer-doc": f"Read this document and answer the question below it.\n\n{PROSE}\n\n"
                  f"Question: what does the scheduler do with the blocks of rejected drafts?",
    "fix-typos": f"{_with_typos(PROSE)}\n\nFix the spelling mistakes in the text above. Reply with the corrected "
                 f"text only.",
    "edit-value": f"```python\n{FUNCS}```\n\nChange ACCEPT_SALT to 0x1234 in the code above. Reply with the whole "
                  f"updated code.",
    "edit-rename": f"```python\n{FUNCS}```\n\nRename the function `num_matching` to `count_matching` in the code "
                   f"above. Reply with the whole updated code.",
    # free-form: the answer has little to copy
    "free-story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "free-explain": "Explain in simple words why the sky is blue and why sunsets are red.",
}
GROUNDED = ("repeat-code", "edit-code", "repeat-text", "summarise", "answer-doc", "fix-typos", "edit-value",
            "edit-rename")
#: prompts of the same kinds that no proposer setting was chosen on (benchmarks/studies/speculative_replay.py checks a
#: setting picked on PROMPTS against them)
HELD_OUT = {
    "held-summarise-kv": f"Summarise the following text.\n\n{KV_DOC}",
    "held-summarise-perf": f"Summarise the following text in a few sentences.\n\n{PERF_DOC}",
    "held-answer-kv": f"Read this document and answer the question below it.\n\n{KV_DOC}\n\n"
                      f"Question: what happens to a block when a sequence finishes?",
    "held-fix-typos": f"{_with_typos(PERF_DOC)}\n\nFix the spelling mistakes in the text above. Reply with the "
                      f"corrected text only.",
    "held-docstrings": f"```python\n{SCHED_CODE}```\n\nAdd a docstring to every function in the code above. Reply "
                       f"with the whole updated code.",
    "held-rename": f"```python\n{NGRAM_CODE}```\n\nRename `state` to `st` in the code above. Reply with the whole "
                   f"updated code.",
    "held-free-recipe": "Give me a simple recipe for pancakes and explain each step.",
    "held-free-history": "Tell me about the history of the printing press in a few paragraphs.",
}
HELD_OUT_GROUNDED = tuple(name for name in HELD_OUT if not name.startswith("held-free"))
