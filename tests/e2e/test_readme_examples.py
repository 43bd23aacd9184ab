"""The documentation's examples run as written: in README.md, every page of docs/ and benchmarks/README.md,
every fenced ``bash``, ``sh``, ``python`` and ``toml`` block is run (bash and sh: each ``kvcore ...`` line
through ``main()`` with the tiny checkpoint as KVCORE_MODEL; python: executed; toml: parsed, and a config
example drives ``kvcore generate``) with the tiny checkpoint standing in for SmolLM2, unless the line
before it says ``<!-- readme-test: skip: REASON -->`` with a reason a reader can see in the page source.

An example that prints shows what it prints: the ``text`` block after it, marked ``<!-- readme-test: output
-->``. The slow tier runs each such example on the default model itself and checks what it printed (a command's
standard error, then its standard output) against that block, where ``…`` stands for any text (a timing, a
machine's table) and a line of ``…`` alone for one or more lines."""

from __future__ import annotations

import io
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from kvcore.cli import main

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
TINY = Path(__file__).parents[1] / "data" / "tiny-llama"
FENCE = re.compile(r"(?:^<!-- readme-test: skip: (?P<reason>[^>]*?) -->\n|^<!-- docs-test: (?P<tag>[\w-]+) -->\n)?"
                   r"^```(?P<lang>\w+)\n(?P<body>.*?)^```$"
                   r"(?:\n+^<!-- readme-test: output -->\n^```text\n(?P<output>.*?)^```$)?", re.S | re.M)
#: the examples this file runs
RUNNABLE = ("bash", "sh", "python", "toml")
#: pages whose ``<!-- docs-test: TAG -->`` blocks a test of their own checks
DOCS_TESTS = {"docs/gpu-backends.md": "tests/e2e/test_gpu_check.py"}


def blocks(with_output: bool = False):
    """``(page, lang, body, skip reason, shown output)`` of every runnable block (``with_output``: of those
    that show their output), as pytest params."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        for m in FENCE.finditer(text):
            if m["lang"] in RUNNABLE and (m["output"] is not None or not with_output):
                line = text[: m.start("lang")].count("\n") + 1
                reason = m["reason"]
                if m["tag"]:
                    reason = f"checked by {DOCS_TESTS[name]} (docs-test: {m['tag']})"
                found.append(pytest.param(name, m["lang"], m["body"], reason, m["output"],
                                          id=f"{name}-{m['lang']}-line{line}"))
    return found


def test_every_skip_says_why():
    total = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        markers = re.findall(r"<!-- readme-test: skip: ?(.*?) -->", text)
        assert all(len(reason.split()) >= 3 for reason in markers), (page.name, markers)
        # no misspelt marker goes unnoticed, and each output block follows the example it belongs to
        outputs = [m for m in FENCE.finditer(text) if m["output"] is not None and m["lang"] in RUNNABLE]
        assert len(re.findall(r"<!-- readme-test", text)) == len(markers) + len(outputs), page.name
        assert not any(m["reason"] for m in outputs), f"{page.name}: a skipped example shows an output"
        total += len(markers)
    assert total


def matches_shown(shown: str, printed: str) -> bool:
    """Whether ``printed`` is the ``shown`` output, ``…`` standing for any text and a line of ``…`` for one or more
    lines (trailing spaces and blank lines at either end do not count)."""
    def tidy(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())

    pattern = re.escape(tidy(shown)).replace(re.escape("…"), ".*?")
    return re.fullmatch(pattern, tidy(printed), re.S) is not None


def test_shown_output_wildcards():
    """The comparison itself: a changed word fails, ``…`` absorbs a timing or lines."""
    assert matches_shown("Paris is the capital.\n", "Paris is the capital.  \n\n")
    assert not matches_shown("Paris is the capital.", "Paris is a capital.")
    assert matches_shown("took … s\n…\nend", "took 0.25 s\nline a\nline b\nend")
    assert not matches_shown("took … s\nend", "took 1 s\nmore\nends")


def test_every_fence_is_seen():
    """A block the fence pattern does not see (a typo in its language, a stray space) would go untested."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fences = re.findall(r"^```(\w*)$", text, re.M)
        opened = fences[0::2]
        assert len(fences) % 2 == 0, f"{page.name}: an unclosed code fence"
        counted = [lang for m in FENCE.finditer(text) for lang in (m["lang"], "text")[: 1 + (m["output"] is not None)]]
        assert sorted(lang for lang in opened if lang) == sorted(counted), page.name


@pytest.mark.parametrize("page, lang, body, reason, shown", blocks())
def test_doc_block_runs(page, lang, body, reason, shown, monkeypatch, capsys, tmp_path):
    if reason:
        pytest.skip(reason)
    # The tiny checkpoint stands in for SmolLM2 (seconds instead of minutes on two busy cores; the commands and
    # code run as written): flag > KVCORE_MODEL > config file for the CLI, the name "smollm2" for the API.
    monkeypatch.setenv("KVCORE_MODEL", str(TINY))
    import kvcore.engine.core
    import kvcore.loaders.model_cache

    load_model, file_facts = kvcore.loaders.load_model, kvcore.engine.core.file_facts
    stand_in = lambda spec: str(TINY) if spec == "smollm2" else spec  # noqa: E731
    # where the model cache and the default choice read the model file
    monkeypatch.setattr(kvcore.loaders.model_cache, "load_model", lambda spec, **kw: load_model(stand_in(spec), **kw))
    monkeypatch.setattr(kvcore.engine.core, "file_facts", lambda spec: file_facts(stand_in(spec)))
    monkeypatch.delenv("KVCORE_BACKEND", raising=False)
    if lang != "toml":
        printed = run_example(page, lang, body, monkeypatch, capsys, tmp_path)
        assert shown is not None or not printed.strip(), f"{page}: an example that prints shows no output"
    else:
        data = tomllib.loads(body)
        if "project" in data:  # a plugin package's pyproject.toml
            assert data["project"]["entry-points"]["kvcore"]
            return
        path = tmp_path / "kvcore.toml"
        path.write_text(body, encoding="utf-8")
        rc = main(["generate", "--config", str(path), "--max-new-tokens", "4", "--json", "Hello"])
        out, err = capsys.readouterr()
        assert rc == 0, err


def run_example(page: str, lang: str, body: str, monkeypatch, capsys, tmp_path) -> str:
    """Run a bash, sh or python example as the page gives it; what it printed (a command's standard error, then
    its standard output)."""
    printed = []
    if lang in ("bash", "sh"):
        commands = [shlex.split(line, comments=True) for line in body.splitlines()]
        for argv in filter(None, commands):
            stdin = ""
            if argv[0] in ("echo", "printf") and "|" in argv:  # `echo TEXT | kvcore ...`
                pipe = argv.index("|")
                text = " ".join(argv[1:pipe])
                stdin = text + "\n" if argv[0] == "echo" else text.encode().decode("unicode_escape")
                argv = argv[pipe + 1 :]
            assert argv[0] == "kvcore", f"runs only `kvcore` lines; skip this block with a reason: {argv}"
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
            try:
                rc = main(argv[1:])
            except SystemExit as exc:  # --version, --help
                rc = exc.code
            out, err = capsys.readouterr()
            assert rc == 0 and out.strip(), (argv, err)
            printed.append(err + out)  # a terminal shows both; what kvcore writes on stderr comes first
    else:
        monkeypatch.chdir(tmp_path)
        exec(compile(body, page, "exec"), {"__name__": "doc_example"})
        printed.append(capsys.readouterr().out)
    return "".join(printed)


@pytest.mark.slow
@pytest.mark.parametrize("page, lang, body, reason, shown", blocks(with_output=True))
def test_doc_example_prints_what_it_shows(page, lang, body, reason, shown, monkeypatch, capsys, tmp_path):
    """Each example that shows its output, on the default model (SmolLM2, the automatic settings) as a reader
    runs it: what it prints is what the page shows."""
    monkeypatch.delenv("KVCORE_MODEL", raising=False)
    monkeypatch.delenv("KVCORE_BACKEND", raising=False)
    printed = run_example(page, lang, body, monkeypatch, capsys, tmp_path)
    assert matches_shown(shown, printed), f"{page} shows:\n{shown}\nbut the example printed:\n{printed}"


@pytest.mark.slow
def test_structured_output_example_is_valid_on_smollm2(monkeypatch, tmp_path):
    """docs/python-api.md's JSON-schema example on the real default model (the docs run above uses the tiny
    stand-in): the reply is complete JSON valid against the page's schema (an unbounded integer made SmolLM2
    write digits until the length limit)."""
    jsonschema = pytest.importorskip("jsonschema")
    text = (ROOT / "docs" / "python-api.md").read_text(encoding="utf-8")
    (body,) = [m["body"] for m in FENCE.finditer(text) if "StructuredOutput(json=schema)" in m["body"]]
    body = body.split("\n(answer,)")[0]  # the JSON part; choice and regex run in the docs test
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "doc_example"}
    exec(compile(body, "docs/python-api.md", "exec"), namespace)
    result, schema = namespace["result"], namespace["schema"]
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), schema)
