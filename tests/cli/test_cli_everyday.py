"""Everyday CLI use: --version, --threads, prompts from standard input or a file, the chat REPL, --max-model-len,
typed errors with their exit codes for bad devices, sizes and config files, and a closed standard output."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import last_json, run_cli

from kvcore.cli import main
from kvcore.engine import threads as settings
from kvcore.engine.threads import busy_cpus, default_threads

TINY = str(Path(__file__).parents[1] / "data" / "tiny-llama")
FAST = ["--model", TINY, "--backend", "sdpa", "--max-new-tokens", "4", "--ignore-eos"]


def cli_process(*argv, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCORE_LOAD_PLUGINS": ""}
    return subprocess.run([sys.executable, "-m", "kvcore.cli", *argv], capture_output=True, text=True, timeout=120,
                          env=env, **kwargs)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("KVCORE_BACKEND", "KVCORE_MODEL", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == "kvcore 0.1.0"


def test_threads_flag_and_default(capsys, monkeypatch):
    rc, out, _ = run_cli(capsys, "generate", *FAST, "--threads", "1", "--json", "hi")
    assert rc == 0 and last_json(out)["threads"] == 1
    rc, _, err = run_cli(capsys, "generate", *FAST, "--threads", "0", "hi")
    assert rc == 2 and "threads must be an integer from 1 to 64 (4 × the CPU count, or 64), got 0" in err
    rc, _, err = run_cli(capsys, "generate", *FAST, "--threads", str(10**9), "hi")  # libgomp would abort
    assert rc == 2 and "got 1000000000" in err
    # the default: cores this process may use minus those busy now (the run queue), at least 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(settings, "busy_cpus", lambda: 2)
    assert default_threads() == 2
    monkeypatch.setattr(settings, "busy_cpus", lambda: 9)
    assert default_threads() == 1
    rc, out, _ = run_cli(capsys, "generate", *FAST, "--json", "hi")
    assert last_json(out)["threads"] == 1


def test_busy_cpus_reads_the_run_queue_not_the_load_average(monkeypatch, tmp_path):
    """A load average left by a job that has ended does not count; what runs now does, less this process."""
    import builtins

    readings = iter(["9.80 7.00 5.00 3/200 77\n", "9.80 7.00 5.00 1/200 77\n", "9.80 7.00 5.00 3/200 77\n",
                     "9.80 7.00 5.00 4/200 77\n", "9.80 7.00 5.00 1/200 77\n"])
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/loadavg":
            file = tmp_path / "loadavg"
            file.write_text(next(readings))
            return real_open(file, *args, **kwargs)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(settings, "_SAMPLE_PAUSE", 0.0)
    assert busy_cpus() == 2  # the median reading, 3 running, one of them this process
    monkeypatch.setattr(builtins, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    monkeypatch.setattr(os, "getloadavg", lambda: (1.6, 0.0, 0.0))
    assert busy_cpus() == 2  # elsewhere: the load average, rounded


def test_prompt_from_stdin_and_file(capsys, monkeypatch, tmp_path):
    rc, out, _ = run_cli(capsys, "generate", *FAST, "--json", "hello world")
    want = last_json(out)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello world\n"))  # `echo` adds the newline: not part of it
    rc, out, _ = run_cli(capsys, "generate", *FAST, "--json", "-")
    assert rc == 0 and last_json(out)["token_ids"] == want["token_ids"]
    assert last_json(out)["prompt_token_ids"] == want["prompt_token_ids"]
    path = tmp_path / "prompt.txt"
    path.write_text("hello world\n", encoding="utf-8")
    rc, out, _ = run_cli(capsys, "generate", *FAST, "--json", "--prompt-file", str(path))
    assert rc == 0 and last_json(out)["prompt_token_ids"] == want["prompt_token_ids"]


@pytest.mark.parametrize("argv, message", [
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file '/nonexistent/prompt.txt'"),
    (["--prompt-file", "PROMPT", "also-an-argument"], "either as an argument or with --prompt-file, not both"),
    ([], "no prompt: give it as an argument, '-' for standard input, or --prompt-file"),
])
def test_prompt_errors(capsys, tmp_path, argv, message):
    path = tmp_path / "p.txt"
    path.write_text("x")
    argv = [str(path) if a == "PROMPT" else a for a in argv]
    rc, _, err = run_cli(capsys, "generate", *FAST, *argv)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_chat_repl_keeps_history_and_resets(capsys, monkeypatch):
    turns = "hello\nhow are you\n/reset\nhow are you\n/exit\nnever read\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(turns))
    rc, out, err = run_cli(capsys, "chat", *FAST, "--seed", "7", "--json")  # chat samples: a seed repeats a reply
    assert rc == 0 and "conversation cleared" in err
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == 3
    first, second, after_reset = results
    # the second turn's prompt holds the first turn and its reply, through the chat template
    from kvcore.loaders import load_model

    tok = load_model(TINY).tokenizer
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": "how are you"}]
    want = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True), add_bos=False)
    assert second["prompt_token_ids"] == want
    # after /reset, the same message is a fresh conversation: exactly the one-shot `chat`
    rc, out, _ = run_cli(capsys, "chat", *FAST, "--seed", "7", "--json", "how are you")
    assert last_json(out)["prompt_token_ids"] == after_reset["prompt_token_ids"]
    assert last_json(out)["token_ids"] == after_reset["token_ids"]


def test_chat_repl_unknown_command_and_end_of_input(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("/frobnicate\n\nhi"))  # no newline at the end, then EOF
    rc, out, err = run_cli(capsys, "chat", *FAST, "--json")
    assert rc == 0 and "unknown command '/frobnicate'" in err
    assert len([line for line in out.splitlines() if line.startswith("{")]) == 1


def test_chat_repl_error_ends_a_piped_session_with_its_code(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n" + "word " * 300 + "\n"))
    rc, _, err = run_cli(capsys, "chat", *FAST, "--max-model-len", "64")
    assert rc == 2 and "exceeds the context limit of 64 tokens" in err


def test_max_model_len_flag_and_window(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "generate", *FAST, "--max-model-len", "100000", "hi")
    assert rc == 2 and "max_model_len 100000 exceeds the model's context window of 256 tokens" in err
    config = tmp_path / "k.toml"
    config.write_text("max_model_len = 300\n")
    rc, _, err = run_cli(capsys, "generate", *FAST, "--config", str(config), "hi")
    assert rc == 2 and "max_model_len 300 exceeds the model's context window of 256 tokens" in err
    rc, _, err = run_cli(capsys, "generate", *FAST, "--max-model-len", "8", "--max-new-tokens", "7", "hi there")
    assert rc == 2 and "exceeds the context limit of 8 tokens" in err


@pytest.mark.parametrize("argv, message", [
    (["--device", "mps"], "device 'mps' is not available with this torch build or machine"),
    (["--device", "xla"], "device 'xla' is not available with this torch build or machine"),
    (["--device", "banana"], "unknown device 'banana'"),
    (["--temperature", "1", "--seed", str(2**64 + 5)], None),  # any integer seed: taken mod 2^64
    (["--temperature", "1", "--seed", "-3"], None),
])
def test_device_and_seed(capsys, argv, message):
    rc, out, err = run_cli(capsys, "generate", *FAST, *argv, "hi")
    if message is None:
        assert rc == 0, err
    else:
        assert rc == 2 and f"kvcore: error: {message}" in err and err.count("\n") == 1


def test_seed_is_taken_mod_2_64(capsys):
    runs = [run_cli(capsys, "generate", *FAST, "--temperature", "1", "--seed", s, "--json", "hi")[1]
            for s in (str(2**64 + 5), "5")]
    assert last_json(runs[0])["token_ids"] == last_json(runs[1])["token_ids"]


@pytest.mark.parametrize("toml, message", [
    # one-shot generate sizes each slot to its request (prompt + 128 new tokens), not to the 256-token window
    ("max_num_seqs = 100000000000\n", "KV cache (100,000,000,000 sequence slots of 130 tokens) would take"),
    ("backend = 'paged'\nnum_blocks = 100000000000\n", "'paged' KV cache (100,000,000,000 blocks of 16 tokens)"),
    ("backend = 'paged'\nkv_cache_bytes = 100000000000000000\n", "lower num_blocks, kv_cache_bytes or block_size"),
    ("backend = 'paged'\nblock_size = 100000000000\n", "blocks of 100,000,000,000 tokens) would take"),
    ("a = " + "[" * 2000 + "]" * 2000 + "\n", "is not valid TOML: values nested too deeply"),
    ("x = {" * 3 + "\n", "is not valid TOML"),
])
def test_config_errors_are_typed(capsys, tmp_path, toml, message):
    path = tmp_path / "k.toml"
    path.write_text(toml)
    rc, _, err = run_cli(capsys, "generate", "--model", TINY, "--config", str(path), "hi")  # the file's backend
    assert rc == 2 and message in err and err.startswith("kvcore: error: ") and err.count("\n") == 1


def test_unreadable_config(capsys, tmp_path, monkeypatch):
    path = tmp_path / "k.toml"
    path.write_text("backend = 'sdpa'\n")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)  # chmod 000 does not stop root, who runs CI here
    rc, _, err = run_cli(capsys, "generate", *FAST, "--config", str(path), "hi")
    assert rc == 2 and f"cannot read config file '{path}': Permission denied" in err


def test_closed_stdout_is_a_quiet_exit():
    proc = subprocess.run([sys.executable, "-m", "kvcore.cli", "generate", *FAST, "hi"], stdout=None,
                          stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1),
                          env={**os.environ, "KVCORE_LOAD_PLUGINS": ""})
    assert proc.returncode == 141 and proc.stderr == ""


@pytest.mark.slow
def test_reader_going_away_is_a_quiet_exit():
    # `kvcore generate ... | head -c1`: the reader takes one byte and closes the pipe; SmolLM2's 200 tokens take
    # long enough that the writer is still writing then (the tiny model could finish into the pipe's buffer)
    proc = subprocess.Popen([sys.executable, "-m", "kvcore.cli", "generate", "--threads", "1", "--max-new-tokens",
                             "200", "--ignore-eos", "Once upon a time"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "KVCORE_LOAD_PLUGINS": ""})
    assert proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


def test_readme_exit_code_table_lists_every_error():
    import re

    import kvcore.errors as errors

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\d+) \| (.*) \|$", readme, re.M))
    for name in errors.__all__:
        cls = getattr(errors, name)
        if cls in (errors.KVCoreError, errors.BackendError, errors.RequestAbortedError):
            continue  # the base classes, and an aborted request's result (Python API, never a CLI exit)
        assert f"`{name}`" in rows.get(str(cls.exit_code), ""), f"{name} (exit {cls.exit_code}) not in README's table"
    from kvcore.cli.app import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OUTPUT_CLOSED

    assert {str(EXIT_INTERNAL), str(EXIT_INTERRUPTED), str(EXIT_OUTPUT_CLOSED)} <= set(rows)


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_port_out_of_range_is_a_usage_error(capsys, port):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", TINY, "--port", port])
    assert exc.value.code == 2 and "argument --port" in capsys.readouterr().err


def test_unwritable_stdout_is_an_output_error():
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "kvcore.cli", "generate", *FAST, "hi"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "KVCORE_LOAD_PLUGINS": ""})
    assert proc.returncode == 74
    assert proc.stderr == "kvcore: error: cannot write to standard output: No space left on device\n"
