"""Commands that need no model answer before torch loads, and a mistyped flag or key names its fix."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from helpers import run_cli

from kvcore.errors import did_you_mean

# runs kvcore's main in a fresh interpreter and reports its exit code and whether torch was imported
_PROBE = """
import json, sys
from kvcore.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def probe(*argv: str, cwd=None, env: dict[str, str] | None = None) -> tuple[int, bool, str, str]:
    """``(exit code, torch imported, stdout, stderr without the probe's line)`` of ``kvcore *argv``, with ``env``
    as the only KVCORE_ variables."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)
    *err, last = proc.stderr.strip().splitlines()
    report = json.loads(last)
    return report["rc"], report["torch"], proc.stdout, "\n".join(err)


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--version"], 0, ""),
        (["generate", "--help"], 0, ""),
        (["serve", "--help"], 0, ""),
        (["generate", "--temprature", "1", "hi"], 2, "unknown flag --temprature; did you mean '--temperature'?"),
        (["chat", "--max_new_tokens", "3", "hi"], 2, "unknown flag --max_new_tokens; did you mean '--max-new-tokens'?"),
        (["serve", "--prot", "80"], 2, "unknown flag --prot; did you mean '--port'"),
        (["generate", "--max-new-tokens", "many", "hi"], 2, "invalid int value: 'many'"),
    ],
)
def test_answers_without_importing_torch(argv, code, message):
    rc, torch_loaded, out, err = probe(*argv)
    assert rc == code and message in err, err
    assert not torch_loaded, f"kvcore {' '.join(argv)} imported torch"
    if argv == ["--version"]:
        assert out.startswith("kvcore ")


def test_config_file_errors_answer_before_torch_loads(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("temprature = 0.7\n")
    rc, torch_loaded, _, err = probe("generate", "--config", str(cfg), "hi")
    assert rc == 2 and "unknown key 'temprature'" in err and "did you mean 'temperature'?" in err, err
    assert not torch_loaded


def test_help_lists_plugin_commands_without_importing_torch():
    """``kvcore --help`` imports the third-party plugins to list their commands, not kvcore's built-ins: with only
    kvcore-bench's (which imports nothing heavy at load), torch stays out."""
    installed = {ep.name for ep in importlib.metadata.entry_points(group="kvcore")}
    light = "bench" if "bench" in installed else ""
    rc, torch_loaded, out, err = probe("--help", env={"KVCORE_LOAD_PLUGINS": light})
    assert rc == 0 and not err and not torch_loaded
    commands = out.split("{", 1)[1].split("}", 1)[0].split(",")
    assert {"generate", "chat", "serve", "models", "plugins", "backends", "kernels"} <= set(commands)
    assert ("bench" in commands) == bool(light)


def test_built_in_and_plugin_commands_are_listed_and_run(capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, "--help")
    assert exc.value.code == 0 and "models" in capsys.readouterr().out
    rc, out, _ = run_cli(capsys, "models")
    assert rc == 0 and "llama" in out
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, "modles")
    assert exc.value.code == 2 and "invalid choice: 'modles'" in capsys.readouterr().err


def test_did_you_mean():
    assert did_you_mean("temprature", ["temperature", "top_p"]) == "; did you mean 'temperature'?"
    assert did_you_mean("zzz", ["temperature", "top_p"]) == ""
    assert "'--port' or '--host'" in did_you_mean("--prot", ["--port", "--host", "--api-key"])
