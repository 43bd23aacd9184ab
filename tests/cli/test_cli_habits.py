"""CLI habits: constrained `kvcore generate` (--json-schema, --regex, --grammar), piped standard input (alone or
before a prompt argument, as llm does), and `kvcore chat` on a real terminal (tmux): line editing, history
kept across sessions, multi-line input, Ctrl-C clearing the line, /help, Ctrl-D ending."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from helpers import last_json, run_cli

TINY = str(Path(__file__).parents[1] / "data" / "tiny-llama")
BASE = ["--model", TINY, "--backend", "sdpa", "--max-new-tokens", "60", "--json"]


@pytest.fixture(scope="module")
def tokenizer():
    from kvcore.loaders import load_model

    return load_model(TINY).tokenizer


def test_generate_constrained_flags(capsys, tmp_path):
    schema = {"type": "object", "properties": {"v": {"enum": ["up", "down"]}, "n": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 9}},
              "required": ["v", "n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    rc, out, _ = run_cli(capsys, "generate", *BASE, "--json-schema", str(path), "Answer:")
    assert rc == 0
    jsonschema.validate(json.loads(last_json(out)["text"]), schema)
    rc, out, _ = run_cli(capsys, "generate", *BASE, "--regex", "[0-9]{3}-[a-z]{2}", "Code:")
    assert rc == 0 and re.fullmatch("[0-9]{3}-[a-z]{2}", last_json(out)["text"])
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "(" [xy]+ ")"\n')
    rc, out, _ = run_cli(capsys, "generate", *BASE, "--grammar", str(grammar), "Pair:")
    text = last_json(out)["text"]
    assert rc == 0 and (re.fullmatch(r"\([xy]+\)", text) or re.fullmatch(r"\([xy]+", text)), text


@pytest.mark.parametrize("argv, needle", [
    (["--json-schema", "SCHEMA"], "json schema"),
    (["--regex", "(oops"], "regex"),
    (["--json-schema", "/nonexistent.json"], "cannot read --json-schema file"),
])
def test_generate_malformed_constraint_is_one_line_exit_2(capsys, tmp_path, argv, needle):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}')
    argv = [str(bad) if a == "SCHEMA" else a for a in argv]
    rc, _, err = run_cli(capsys, "generate", *BASE, *argv, "x")
    assert rc == 2 and needle in err and err.count("\n") == 1, err



def test_a_library_deprecation_is_not_printed(capsys, monkeypatch, tmp_path):
    """The constraint compiler's first import pulls in torch modules that raise DeprecationWarnings, and whether
    a run sees them depends on what the process imported before (pytest shows every warning): the CLI prints
    kvcore's own warnings only, so a malformed schema is still one line."""
    import warnings

    from kvcore.sampling import structured

    original = structured._llguidance

    def deprecated_import():
        warnings.warn("a library's deprecated API", DeprecationWarning, stacklevel=1)
        return original()

    monkeypatch.setattr(structured, "_llguidance", deprecated_import)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "objekt"}')
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        rc, _, err = run_cli(capsys, "generate", *BASE, "--json-schema", str(bad), "x")
    assert rc == 2 and err == "kvcore: error: json schema: Invalid type: objekt\n", err

def _generate(capsys, monkeypatch, *argv, stdin: str | None) -> dict:
    """``kvcore generate`` in this process with standard input a real pipe holding ``stdin`` (None: /dev/null)."""
    if stdin is None:
        stream = open(os.devnull)  # noqa: SIM115 - closed below
    else:
        read_fd, write_fd = os.pipe()
        os.write(write_fd, stdin.encode())
        os.close(write_fd)
        stream = os.fdopen(read_fd)
    monkeypatch.setattr(sys, "stdin", stream)
    try:
        rc, out, err = run_cli(capsys, "generate", *BASE[:4], "--max-new-tokens", "2", "--json", *argv)
    finally:
        stream.close()
    assert rc == 0, err
    return last_json(out)


def test_piped_stdin_is_the_prompt_or_comes_before_it(capsys, monkeypatch, tokenizer):
    run = functools.partial(_generate, capsys, monkeypatch)
    assert run(stdin="hello world\n")["prompt_token_ids"] == tokenizer.encode("hello world")
    assert run("summarise", stdin="hello world\n")["prompt_token_ids"] == tokenizer.encode("hello world\nsummarise")
    alone = run("summarise", stdin=None)  # /dev/null: nothing piped, the argument alone
    assert alone["prompt_token_ids"] == tokenizer.encode("summarise")


class Tmux:
    """One detached tmux session running a command; its raw output goes to a log file (pipe-pane)."""

    def __init__(self, tmp: Path, command: str, env: dict[str, str]) -> None:
        self.name = f"kvcore-test-{os.getpid()}-{time.monotonic_ns()}"
        self.log = tmp / "pane.log"
        self.socket = str(tmp / "tmux.sock")
        exports = " ".join(f"{k}={v!r}" for k, v in env.items())
        self.run("new-session", "-d", "-s", self.name, "-x", "200", "-y", "50", f"env {exports} {command}")
        self.run("pipe-pane", "-t", self.name, "-o", f"cat >> {self.log}")

    def run(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", self.name, *keys)

    def type(self, text: str) -> None:
        self.run("send-keys", "-t", self.name, "-l", text)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.output()
            if len(re.findall(pattern, out)) >= count:
                return out
            time.sleep(0.1)
        screen = self.run("capture-pane", "-p")
        raise AssertionError(f"no {count} x {pattern!r} within {timeout_s} s; screen:\n{screen}")

    def alive(self) -> bool:
        return subprocess.run(["tmux", "-S", self.socket, "has-session", "-t", self.name],
                              capture_output=True).returncode == 0

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


def _results(out: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r'^(\{"prompt_token_ids".*\})\r?$', out, re.M)]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_chat_on_a_terminal_edits_keeps_history_and_survives_ctrl_c(tmp_path, tokenizer):
    state = tmp_path / "state"
    cmd = f"{sys.executable} -m kvcore.cli chat --model {TINY} --backend sdpa --max-new-tokens 2 --json"
    env = {"KVCORE_LOAD_PLUGINS": "", "XDG_STATE_HOME": str(state), "TERM": "xterm"}
    tmux = Tmux(tmp_path, cmd, env)
    try:
        tmux.wait_for(">>> ")
        tmux.type("helo")
        tmux.keys("Left", "l", "End", "!")  # line editing: the cursor moves, a character goes in mid-line
        tmux.keys("Enter")
        # the next prompt after the reply's JSON: readline is reading again (its redraws of the edited line also
        # print ">>> ", so counting prompts could send Ctrl-C while the reply still streams)
        tmux.wait_for(r'"finish_reason"(?:.|\n)*>>> ')
        tmux.type("half typed")
        tmux.keys("C-c")  # clears the line; the session and the conversation go on
        tmux.wait_for(r"\^C")
        tmux.type("/help")
        tmux.keys("Enter")
        tmux.wait_for("/reset +forget the conversation")
        tmux.keys("Up", "Up", "Enter")  # the history: "hello!" again, two entries back
        tmux.wait_for(">>> ", 5)
        tmux.type("one \\")
        tmux.keys("Enter")
        tmux.wait_for(r"\.\.\. ")
        tmux.type("two")
        tmux.keys("Enter")
        out = tmux.wait_for(">>> ", 6)
        first, recalled, multi = (tokenizer.decode(r["prompt_token_ids"], skip_special_tokens=False)
                                  for r in _results(out))
        chat = [{"role": "user", "content": "hello!"}]
        assert first == tokenizer.decode(tokenizer.encode(tokenizer.apply_chat_template(chat), add_bos=False),
                                         skip_special_tokens=False)
        assert recalled.count("hello!") == 2  # the first turn in the conversation, and asked again
        assert "one \ntwo" in multi and "half typed" not in multi
        tmux.keys("C-d")
        deadline = time.monotonic() + 30
        while tmux.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tmux.alive() and "Traceback" not in tmux.output()
    finally:
        tmux.close()
    history = (state / "kvcore" / "chat_history").read_text()
    assert "hello!" in history and "/help" in history
