"""The documentation's examples run as written: in README.md, every page of docs/ and benchmarks/README.md,
every fenced ``bash``, ``sh``, ``python`` and ``toml`` block is run (bash and sh: each ``kvcore ...`` line
through ``main()`` with the tiny checkpoint as KVCORE_MODEL; python: executed; toml: parsed, and a config
example drives ``kvcore generate``) with the tiny checkpoint standing in for SmolLM2, unless the line
before it says ``<!-- readme-test: skip: REASON -->`` with a reason a reader can see in the page source."""

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

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
TINY = Path(__file__).parent / "data" / "tiny-llama"
FENCE = re.compile(r"(?:^<!-- readme-test: skip: (?P<reason>[^>]*?) -->\n|^<!-- docs-test: (?P<tag>[\w-]+) -->\n)?"
                   r"^```(?P<lang>\w+)\n(?P<body>.*?)^```$", re.S | re.M)
#: pages whose ``<!-- docs-test: TAG -->`` blocks a test of their own checks
DOCS_TESTS = {"docs/gpu-backends.md": "tests/test_gpu_check.py"}


def blocks():
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        for m in FENCE.finditer(text):
            if m["lang"] in ("bash", "sh", "python", "toml"):
                line = text[: m.start("lang")].count("\n") + 1
                reason = m["reason"]
                if m["tag"]:
                    reason = f"checked by {DOCS_TESTS[name]} (docs-test: {m['tag']})"
                found.append(pytest.param(name, m["lang"], m["body"], reason, id=f"{name}-{m['lang']}-line{line}"))
    return found


def test_every_skip_says_why():
    total = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        markers = re.findall(r"<!-- readme-test: skip: ?(.*?) -->", text)
        assert all(len(reason.split()) >= 3 for reason in markers), (page.name, markers)
        # no misspelt marker goes unnoticed
        assert len(re.findall(r"<!-- readme-test", text)) == len(markers), page.name
        total += len(markers)
    assert total


def test_every_fence_is_seen():
    """A block the fence pattern does not see (a typo in its language, a stray space) would go untested."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fences = re.findall(r"^```(\w*)$", text, re.M)
        opened = fences[0::2]
        assert len(fences) % 2 == 0, f"{page.name}: an unclosed code fence"
        counted = [m["lang"] for m in FENCE.finditer(text)]
        assert sorted(lang for lang in opened if lang) == sorted(counted), page.name


@pytest.mark.parametrize("page, lang, body, reason", blocks())
def test_doc_block_runs(page, lang, body, reason, monkeypatch, capsys, tmp_path):
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
    elif lang == "python":
        monkeypatch.chdir(tmp_path)
        exec(compile(body, page, "exec"), {"__name__": "doc_example"})
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
