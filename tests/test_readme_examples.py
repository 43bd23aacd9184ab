"""The README's examples run as written: every fenced ``bash``, ``python`` and ``toml`` block is run (bash:
each ``kvcore ...`` line through ``main()`` with the tiny checkpoint as KVCORE_MODEL; python: executed;
toml: parsed, and the config example drives ``kvcore generate``) with the tiny checkpoint standing in for
SmolLM2, unless the line before it says
``<!-- readme-test: skip: REASON -->`` with a reason a reader can see in the README source."""

from __future__ import annotations

import io
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from kvcore.cli import main

README = Path(__file__).parent.parent / "README.md"
#: the pages whose blocks run like the README's
DOCUMENTS = [README, README.parent / "docs" / "python-api.md"]
TINY = Path(__file__).parent / "data" / "tiny-llama"
FENCE = re.compile(r"(?:^<!-- readme-test: skip: (?P<reason>[^>]*?) -->\n)?^```(?P<lang>\w+)\n(?P<body>.*?)^```$",
                   re.S | re.M)


def blocks():
    found = []
    for doc in DOCUMENTS:
        text = doc.read_text(encoding="utf-8")
        prefix = "" if doc == README else f"{doc.stem}-"
        for m in FENCE.finditer(text):
            if m["lang"] in ("bash", "python", "toml"):
                line = text[: m.start("lang")].count("\n") + 1
                found.append(pytest.param(m["lang"], m["body"], m["reason"], id=f"{prefix}{m['lang']}-line{line}"))
    return found


def test_every_skip_says_why():
    text = README.read_text(encoding="utf-8")
    markers = re.findall(r"<!-- readme-test: skip: ?(.*?) -->", text)
    assert markers and all(len(reason.split()) >= 3 for reason in markers), markers
    assert len(re.findall(r"<!-- readme-test", text)) == len(markers)  # no misspelt marker goes unnoticed


@pytest.mark.parametrize("lang, body, reason", blocks())
def test_readme_block_runs(lang, body, reason, monkeypatch, capsys, tmp_path):
    if reason:
        pytest.skip(reason)
    # The tiny checkpoint stands in for SmolLM2 (seconds instead of minutes on two busy cores; the commands and
    # code run as written): flag > KVCORE_MODEL > config file for the CLI, the name "smollm2" for the API.
    monkeypatch.setenv("KVCORE_MODEL", str(TINY))
    import kvcore.loaders

    load_model = kvcore.loaders.load_model
    monkeypatch.setattr(kvcore.loaders, "load_model", lambda spec: load_model(str(TINY) if spec == "smollm2" else spec))
    monkeypatch.delenv("KVCORE_BACKEND", raising=False)
    if lang == "bash":
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
        exec(compile(body, "README.md", "exec"), {"__name__": "readme_example"})
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
