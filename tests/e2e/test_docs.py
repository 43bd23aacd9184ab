"""The documentation stays navigable: a short README, links that lead somewhere, and recorded results that a
page cites (the examples themselves run in test_readme_examples.py)."""

from __future__ import annotations

import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import subcommands
from test_readme_examples import PAGES, README, ROOT

README_MAX_LINES = 300
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def without_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)  # a '# comment' in a block is no heading


def prose(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are code, not links."""
    return re.sub(r"`[^`\n]*`", "", without_blocks(text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.*)$", without_blocks(page.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material into docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for m in LINK.finditer(prose(page.read_text(encoding="utf-8"))):
            target = m["target"]
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title), [gone](missing.md), `[code](not-a-link.md)`\n", encoding="utf-8")
    targets = [m["target"] for m in LINK.finditer(prose(page.read_text(encoding="utf-8")))]
    assert targets == ["#title", "missing.md"] and anchors(page) == {"title"}


def test_every_recorded_result_is_cited():
    cited = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    results = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    uncited = [name for name in results if f"results/{name}" not in cited]
    assert results and not uncited, f"benchmarks/results/ files no page cites (cite or git rm them): {uncited}"


def test_plugin_page_documents_every_hook():
    from kvcore import hookspecs

    page = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    specs = {name: fn for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, "kvcore_spec")}
    assert specs
    signatures = [f"{name}({', '.join(inspect.signature(fn).parameters)})" for name, fn in sorted(specs.items())]
    missing = [sig for sig in signatures if f"`{sig}`" not in page]
    assert not missing, f"hooks not in docs/plugins.md's table (as `name(args)`): {', '.join(missing)}"


#: where each command's flags are documented (a flag may also appear on any page of its list)
FLAG_PAGES = {
    "generate": ["docs/cli.md"],
    "chat": ["docs/cli.md"],
    "serve": ["docs/cli.md", "docs/serving.md"],
    "conformance": ["docs/conformance.md"],
    "bench": ["benchmarks/README.md"],
}


def test_every_cli_flag_is_documented(bench_plugin):
    parsers = subcommands()
    assert set(FLAG_PAGES) <= set(parsers)  # kvcore-bench: installed by make setup
    missing = {}
    for command, pages in FLAG_PAGES.items():
        text = "".join((ROOT / page).read_text(encoding="utf-8") for page in pages)
        flags = {o for a in parsers[command]._actions if a.help != "==SUPPRESS==" for o in a.option_strings}
        undocumented = sorted(f for f in flags if f.startswith("--") and f != "--help"
                              and not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text))
        if undocumented:
            missing[command] = undocumented
    assert missing == {}


def _script(name: str):
    """scripts/<name>.py, imported from its path (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_are_current():
    """docs/cli.md's settings and docs/design.md's layers are generated from the fields and tests/layer_order.py."""
    gen = _script("gen_tables")
    for page, (name, render) in gen.TABLES.items():
        text = (ROOT / page).read_text(encoding="utf-8")
        assert gen.regenerate(text, name, render()) == text, f"{page}'s {name} table is stale: run `{gen.COMMAND}`"


def test_generated_tables_follow_their_sources(monkeypatch, tmp_path, capsys):
    """A new setting is a new row, a new rank a new line; --check sees a stale page, a run rewrites it."""
    from kvcore.engine.fields import EngineFields
    from kvcore.interfaces.setting import setting

    @dataclass
    class Extended(EngineFields):
        draft_depth: int = setting(4, min=1, help="how deep | far drafts go")

    gen = _script("gen_tables")
    monkeypatch.setitem(gen.SETTINGS, "engine", Extended)
    assert "| `draft_depth` | `--draft-depth` | int | `4` | how deep \\| far drafts go |" in gen.render_settings()
    monkeypatch.setattr(gen, "_layers", lambda: [(("kvcore.errors",), "errors"), (("kvcore.a", "kvcore.b"), "a, b")])
    assert gen.render_layers().splitlines()[2:] == ["| 0 | `errors` | errors |", "| 1 | `a`, `b` | a, b |"]
    (tmp_path / "docs").mkdir()
    for page in gen.TABLES:
        (tmp_path / page).write_text((ROOT / page).read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "docs/cli.md: the settings table is stale" in capsys.readouterr().err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    assert "`--draft-depth`" in (tmp_path / "docs/cli.md").read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="no '<!-- generated: layers"):
        gen.regenerate("a page without the table", "layers", "")


def _gen_reference():
    return _script("gen_reference")


def test_reference_page_is_generated_and_complete():
    gen = _gen_reference()
    text, problems = gen.render()
    assert not problems, ("interface fields without documentation (write a `#:` comment or docstring, then run "
                          f"`{gen.COMMAND}`):\n" + "\n".join(problems))
    assert gen.PAGE.read_text(encoding="utf-8") == text, f"docs/reference.md is stale: run `{gen.COMMAND}`"


def test_reference_check_sees_an_undocumented_field():
    import torch

    @dataclass(frozen=True)
    class Plan:
        rows: torch.Tensor  # [T] int64 rows of the call
        mask: torch.Tensor  # a mask, shape not given
        #: the window
        window: int = 0
        scale: float = 1.0

    text, problems = _gen_reference().section("Plan", Plan, "A plan.")
    assert "| `rows` | `torch.Tensor` | required | [T] int64 rows of the call |" in text
    assert "| `window` | `int` | `0` | the window |" in text
    assert problems == ["Plan.mask: a tensor whose comment gives no shape ([T, H, D])",
                        "Plan.scale: no comment (a `#:` line above it or a trailing `# ...`)"]


def test_plugin_page_skeleton_is_a_working_plugin():
    """docs/plugins.md's "one of each" block, registered as a plugin: `mine` generates what `sdpa` does, and
    `my_cache` (with `my_sampler`) what `paged` does, on the tiny checkpoint."""
    import types

    from test_readme_examples import TINY

    from kvcore import Engine, EngineConfig, SamplingParams
    from kvcore.plugins.registry import get_registry

    page = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    (body,) = re.findall(r"^```python\n(# my_plugin/plugin\.py\n.*?)^```$", page, re.S | re.M)
    plugin = types.ModuleType("my_plugin.plugin")
    exec(compile(body, "docs/plugins.md", "exec"), plugin.__dict__)
    registry = get_registry()
    name = registry.register_plugin(plugin, name="docs-skeleton")
    prompts = ["The capital of France is", "def fib(n):"]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def tokens(**config):
        engine = Engine.from_pretrained(str(TINY), EngineConfig(**config))
        return [r.token_ids for r in engine.generate(prompts, params)]

    try:
        assert tokens(backend="mine") == tokens(backend="sdpa")
        assert tokens(backend="paged", kv_cache="my_cache", sampler="my_sampler") == tokens(backend="paged")
    finally:
        registry.unregister_plugin(name)


def test_conformance_page_transcript_matches_the_suite():
    """docs/conformance.md's sample run (`kvcore conformance --backend sdpa --quick`) has the tiers and case
    counts the suite has now: a tier or case added to the code makes this fail until the transcript is redone."""
    from kvcore.conformance.runner import tier_cases
    from kvcore.conformance.settings import TIERS, SuiteConfig
    from kvcore.conformance.target import resolve_target

    page = (ROOT / "docs" / "conformance.md").read_text(encoding="utf-8")
    transcript = re.search(r"^```\n(kvcore conformance: backend 'sdpa'.*?)^```$", page, re.S | re.M)
    assert transcript is not None
    text = transcript.group(1)
    covers = dict(re.findall(r"^  (\w+): (\d+) cases;", text, re.M))
    # every case passes, or is skipped for a variant sdpa does not declare (the probe of variants as code)
    rows = re.findall(r"^(\w+) +PASS +(\d+) +0 +(\d+) ", text, re.M)
    table = {tier: str(int(ok) + int(skip)) for tier, ok, skip in rows}
    total = re.search(r"^RESULT: PASS \(exit 0\): (\d+) passed, 0 failed, (\d+) skipped", text, re.M)
    cfg = SuiteConfig(quick=True)
    target = resolve_target("sdpa")
    want = {tier: str(len(tier_cases(target, tier, cfg))) for tier in TIERS}
    redo = ("docs/conformance.md's sample output is stale: paste the output of "
            "`kvcore conformance --backend sdpa --quick --no-progress`")
    assert covers == want and table == want, redo
    assert total is not None and int(total.group(1)) + int(total.group(2)) == sum(map(int, want.values())), redo
