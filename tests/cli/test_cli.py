"""The CLI as a new user meets it: output formats, precedence, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import last_json, run_cli

from kvcore.cli import main

TINY = Path(__file__).parents[1] / "data" / "tiny-llama"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("KVCORE_BACKEND", raising=False)
    monkeypatch.delenv("KVCORE_MODEL", raising=False)


def test_backends_table_lists_builtins_with_reasons(capsys):
    rc, out, _ = run_cli(capsys, "backends")
    assert rc == 0
    for name in ("naive", "sdpa", "paged", "flash_attn2", "xformers"):
        assert name in out
    rc, out, _ = run_cli(capsys, "backends", "--json")
    rows = {r["backend"]: r for r in json.loads(out)}
    assert rows["naive"]["available"] == "yes"
    assert rows["flash_attn2"]["available"].startswith("no: ")
    assert rows["paged"]["kv_layouts"] == "paged"


def test_generate_json_on_tiny_model(capsys):
    rc, out, _ = run_cli(capsys, "generate", "--model", str(TINY), "--backend", "naive", "--max-new-tokens", "8",
                         "--ignore-eos", "--json", "hello world")
    assert rc == 0
    result = last_json(out)
    assert len(result["token_ids"]) == 8 and result["backend"] == "naive"
    assert result["prompt_token_ids"] and set(result["metrics"]) >= {"ttft_s", "tpot_s", "tokens_per_s", "kv_bytes"}
    # the same ids through the Python API
    from kvcore import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(str(TINY), EngineConfig(backend="naive"))
    api = engine.generate(["hello world"], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert api.token_ids == result["token_ids"] and api.text == result["text"]


def test_backend_precedence_flag_env_config(capsys, tmp_path, monkeypatch):
    cfg = tmp_path / "k.toml"
    cfg.write_text('backend = "naive"\nmax_new_tokens = 3\nignore_eos = true\n')
    base = ["generate", "--model", str(TINY), "--config", str(cfg), "--json", "hi"]
    assert last_json(run_cli(capsys, *base)[1])["backend"] == "naive"
    monkeypatch.setenv("KVCORE_BACKEND", "paged")
    assert last_json(run_cli(capsys, *base)[1])["backend"] == "paged"
    out = run_cli(capsys, *base, "--backend", "sdpa")[1]
    assert last_json(out)["backend"] == "sdpa" and len(last_json(out)["token_ids"]) == 3


def test_per_phase_flags(capsys):
    rc, out, _ = run_cli(capsys, "generate", "--model", str(TINY), "--prefill-backend", "naive",
                         "--decode-backend", "sdpa", "--max-new-tokens", "3", "--json", "hi")
    assert rc == 0
    r = last_json(out)
    assert (r["prefill_backend"], r["decode_backend"]) == ("naive", "sdpa")


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--backend", "nope"], 4, "unknown backend 'nope'"),
        (["--backend", "sdpaa"], 4, "did you mean 'sdpa'"),
        (["--backend", "flash_attn2"], 5, "backend 'flash_attn2' is unavailable"),
        (["--backend", "xformers"], 5, "backend 'xformers' is unavailable"),
        (["--model", "/no/such/model.gguf"], 3, "not found"),
        (["--max-new-tokens", "0"], 2, "max_new_tokens must be a positive integer"),
        (["--temperature", "-1"], 2, "temperature must be >= 0"),
        (["--top-p", "0"], 2, "top_p must be in (0, 1]"),
        (["--top-p", "1.5"], 2, "top_p must be in (0, 1]"),
        (["--top-k", "-3"], 2, "top_k must be an integer >= 0"),
        (["--dtype", "float8"], 2, "unknown dtype 'float8'"),
        (["--device", "cuda"], 2, "device 'cuda' is not available"),
        (["--device", "tpu9"], 2, "unknown device 'tpu9'"),
        (["--max-new-tokens", "100000"], 2, "exceeds the context limit"),
        (["--prefill-backend", "naive", "--decode-backend", "paged"], 2, "share no KV-cache layout"),
        (["--config", "/no/such.toml"], 2, "config file '/no/such.toml' not found"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(capsys, argv, code, message):
    rc, _, err = run_cli(capsys, "generate", "--model", str(TINY), *argv, "hello")
    assert rc == code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcore: error: ") and message in lines[0], err


def test_empty_prompt(capsys):
    rc, _, err = run_cli(capsys, "generate", "--model", str(TINY), "")
    assert rc == 2 and "prompt is empty" in err


@pytest.mark.parametrize(
    "content, message",
    [
        ("backend = 'naive'\nbakcend = 'sdpa'\n", "unknown key 'bakcend'"),
        ("max_new_tokens = 'many'\n", "key 'max_new_tokens' must be int"),
        ("backend = [", "is not valid TOML"),
        ("[backends.paged]\nblock_size = -1\n", "block_size"),
    ],
)
def test_malformed_config_names_the_problem(capsys, tmp_path, content, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(content)
    rc, _, err = run_cli(capsys, "generate", "--model", str(TINY), "--backend", "paged", "--config", str(cfg), "hi")
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_errors_show_no_traceback_in_a_real_process():
    env = {**os.environ, "KVCORE_LOAD_PLUGINS": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "generate", "--backend", "nope", "hi"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 4
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "kvcore.cli", "generate", "--model", "/missing/dir", "hi"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 3 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_debug_shows_traceback(capsys):
    from kvcore.errors import UnknownBackendError

    with pytest.raises(UnknownBackendError):
        main(["--debug", "generate", "--model", str(TINY), "--backend", "nope", "hi"])


# -- commands added by plugins (kvcore_register_commands) ------------------------------------------------
def command_plugin(name: str, *, raises_after_adding: bool = False):
    """A throwaway plugin adding ``kvcore NAME [--code N]``, which exits with N."""
    import types

    from kvcore import hookimpl

    module = types.ModuleType(f"{name}_plugin")

    @hookimpl
    def kvcore_register_commands(subparsers):
        p = subparsers.add_parser(name, help=f"the {name} command")
        if raises_after_adding:
            raise RuntimeError("boom")
        p.add_argument("--code", type=int, default=0)
        p.set_defaults(func=lambda args: print(f"{name} ran") or args.code)

    module.kvcore_register_commands = kvcore_register_commands
    return module


@pytest.fixture
def with_command_plugins():
    """Register throwaway plugins where the command line finds plugin commands; always unregistered afterwards."""
    from kvcore.plugins.entry_points import command_plugins

    pm = command_plugins()
    names = []
    try:
        yield lambda plugin, name: names.append(pm.register(plugin, name=name))
    finally:
        for name in names:
            pm.unregister(name=name)


def test_plugin_adds_a_command_with_its_exit_code(capsys, with_command_plugins):
    with_command_plugins(command_plugin("hello"), "hello-plugin")
    rc, out, err = run_cli(capsys, "hello", "--code", "5")
    assert (rc, out, err) == (5, "hello ran\n", "")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "the hello command" in capsys.readouterr().out


@pytest.mark.parametrize("broken", [command_plugin("half", raises_after_adding=True), command_plugin("generate")])
def test_raising_command_hook_is_one_warning_line_and_the_cli_works(capsys, with_command_plugins, broken):
    with_command_plugins(broken, "broken")
    with_command_plugins(command_plugin("hello"), "hello-plugin")
    rc, out, err = run_cli(capsys, "hello")
    assert rc == 0 and out == "hello ran\n"
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("kvcore: warning: plugin 'broken' raised in kvcore_register_commands and was skipped")
    # what the broken hook added before raising is gone: no half-made command, no help line
    with pytest.raises(SystemExit):
        main(["half"])
    assert "invalid choice: 'half'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "the half command" not in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a plugin taking a built-in's name did not replace it
        main(["generate", "--help"])
    assert "--max-new-tokens" in capsys.readouterr().out
