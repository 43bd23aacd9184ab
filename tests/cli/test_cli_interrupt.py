"""Ctrl-C at any moment (imports, model load, generation): exit 130, one line on stderr, no traceback; with
--json, still a JSON result object with finish_reason "interrupted" and what was generated so far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = str(Path(__file__).parents[1] / "data" / "tiny-llama")
ARGS = ["generate", "--model", TINY, "--backend", "sdpa", "--max-new-tokens", "240", "--ignore-eos", "--json"]
# Mid-generation cases need a generation that cannot end before the signal: the tiny model can write its 240
# tokens in well under a second on a quiet machine, SmolLM2 takes tens of seconds for 200.
LONG = ["generate", "--model", "smollm2", "--threads", "1", "--max-new-tokens", "200", "--ignore-eos", "--json"]


def default_sigint() -> None:
    """In the child before exec: Ctrl-C's default action, as a process started from a terminal has it. A test
    run started as a shell's background job inherits SIGINT ignored (POSIX), and so would every CLI it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "KVCORE_LOAD_PLUGINS": "", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "kvcore.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, preexec_fn=default_sigint)


def interrupted(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    err = err.decode()
    assert err == "kvcore: interrupted\n", err  # one line, no traceback
    return out.decode(), err


def wait_for_mapping(proc: subprocess.Popen, needle: str, timeout_s: float = 120) -> None:
    """Wait until the process has mapped a file whose path contains ``needle`` (Linux /proc): a moment of
    its start-up observed from outside, whatever the machine's load."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if needle in Path(f"/proc/{proc.pid}/maps").read_text():
                return
        except OSError:
            pass
        time.sleep(0.005)
    raise AssertionError(f"the process never mapped {needle!r}")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to observe start-up")
@pytest.mark.parametrize("moment", ["libtorch", pytest.param(".gguf", marks=pytest.mark.slow)])
def test_ctrl_c_during_start_up(moment):
    # libtorch: torch is being imported (the tiny model); .gguf: SmolLM2's file is mapped while the model is
    # loaded (a second or more; the tiny model's safetensors were mapped for so short a time that the 5 ms poll
    # could miss them and see the process finish instead)
    proc = start(*(ARGS if moment == "libtorch" else LONG), "hello")
    wait_for_mapping(proc, moment)
    out, _ = interrupted(proc)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["finish_reason"] == "interrupted"
    assert result["token_ids"] == [] or moment == ".gguf"  # generation may just have begun


@pytest.mark.slow
def test_ctrl_c_mid_generation_prints_what_was_generated():
    proc = start(*LONG, "The history of the printing press begins")
    first = proc.stdout.read(1)  # generation has begun
    assert first
    time.sleep(0.2)
    out, _ = interrupted(proc)
    out = first.decode(errors="replace") + out
    lines = out.rstrip("\n").split("\n")
    result = json.loads(lines[-1])
    assert result["finish_reason"] == "interrupted"
    assert 0 < len(result["token_ids"]) < 200 and result["text"] and result["prompt_token_ids"]
    assert out.startswith(result["text"][:1])


@pytest.mark.slow
def test_ctrl_c_without_json_is_one_line():
    proc = start(*[a for a in LONG if a != "--json"], "The history of the printing press begins")
    assert proc.stdout.read(1)
    out, _ = interrupted(proc)
    assert "{" not in out or "finish_reason" not in out


def test_ctrl_c_in_a_piped_chat_session():
    proc = subprocess.Popen([sys.executable, "-m", "kvcore.cli", "chat", "--model", TINY, "--json",
                             "--max-new-tokens", "8"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "KVCORE_LOAD_PLUGINS": ""}, preexec_fn=default_sigint)
    proc.stdin.write(b"hello\n")
    proc.stdin.flush()
    line = proc.stdout.readline()  # the first reply, then its JSON line; the session waits for the next turn
    while not line.startswith(b'{"prompt_token_ids"'):
        assert line
        line = proc.stdout.readline()
    assert json.loads(line)["finish_reason"] in ("stop", "length")
    out, _ = interrupted(proc)
    assert json.loads(out.strip().splitlines()[-1])["finish_reason"] == "interrupted"


def _read_until(fd: int, marker: bytes, timeout_s: float = 120) -> bytes:
    import select

    seen, deadline = b"", time.monotonic() + timeout_s
    while marker not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no {marker!r} within {timeout_s} s; got {seen[-500:]!r}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    return seen


@pytest.mark.slow
def test_ctrl_c_on_a_terminal_stops_the_reply_and_the_conversation_goes_on():
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: a chat REPL on a terminal
        default_sigint()
        os.environ["KVCORE_LOAD_PLUGINS"] = ""
        os.execv(sys.executable, [sys.executable, "-m", "kvcore.cli", "chat", "--model", "smollm2", "--threads", "1",
                                  "--max-new-tokens", "200", "--ignore-eos"])  # a reply that outlasts the signal
    try:
        assert b"/reset clears the conversation" in _read_until(fd, b">>> ")
        os.write(fd, b"hello\n")
        echo = _read_until(fd, b"hello\r\n")  # the terminal's echo; then the reply streams
        if not echo.split(b"hello\r\n", 1)[1]:
            os.read(fd, 1)  # its first bytes: the reply has begun
        os.kill(pid, signal.SIGINT)
        out = _read_until(fd, b">>> ")  # the reply stopped, the next prompt
        assert b"kvcore: reply stopped" in out and b"Traceback" not in out
        os.write(fd, b"/exit\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
