"""The CLI's sampling flags and config keys: values reach SamplingParams, bad values are one-line usage
errors, flags that greedy decoding ignores warn, logprobs in --json."""

from __future__ import annotations

from pathlib import Path

import helpers
import pytest
from helpers import last_json

TINY = str(Path(__file__).parents[1] / "data" / "tiny-llama")
BASE = ["generate", "--model", TINY, "--backend", "naive", "--max-new-tokens", "3", "--ignore-eos"]


def run_cli(capsys, *argv):
    return helpers.run_cli(capsys, *BASE, *argv)


def test_logprobs_and_penalties_in_json(capsys):
    rc, out, err = run_cli(capsys, "--json", "--logprobs", "2", "--repetition-penalty", "1.3",
                           "--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--stop", "zz", "hello")
    assert rc == 0 and err == ""
    result = last_json(out)
    assert len(result["logprobs"]) == len(result["token_ids"]) == 3
    assert all(len(top) == 2 for top in result["top_logprobs"])


def test_greedy_ignores_sampling_flags_with_one_warning_line(capsys):
    rc, _, err = run_cli(capsys, "--top-p", "1e-46", "--min-p", "0.2", "hello")
    assert rc == 0
    assert err.strip().splitlines() == [
        "kvcore: warning: --top-p, --min-p have no effect at temperature 0 (greedy); set --temperature"]


def test_tiny_top_p_samples_the_top_token(capsys):
    rc, out, err = run_cli(capsys, "--json", "--temperature", "1", "--seed", "1", "--top-p", "1e-46", "hello")
    greedy = last_json(out)["token_ids"]
    assert rc == 0 and err == ""
    rc, out, _ = run_cli(capsys, "--json", "hello")
    assert last_json(out)["token_ids"] == greedy


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--presence-penalty", "3"], "presence_penalty must be in [-2, 2]"),
        (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
        (["--min-p", "1.5"], "min_p must be in [0, 1]"),
        (["--logprobs", "50"], "logprobs must be None (off) or an integer in [0, 20]"),
    ],
)
def test_bad_values_are_one_line_usage_errors(capsys, argv, message):
    rc, _, err = run_cli(capsys, *argv, "hello")
    assert rc == 2 and err.startswith(f"kvcore: error: {message}") and len(err.strip().splitlines()) == 1


def test_config_file_keys(tmp_path, capsys):
    cfg = tmp_path / "k.toml"
    cfg.write_text('stop = ["zz", "yy"]\nmin_p = 0.1\nrepetition_penalty = 1.2\nlogprobs = 1\n')
    rc, out, _ = run_cli(capsys, "--config", str(cfg), "--json", "hello")
    assert rc == 0 and len(last_json(out)["top_logprobs"][0]) == 1
    cfg.write_text('stop = "zz"\n')
    rc, _, err = run_cli(capsys, "--config", str(cfg), "hello")
    assert rc == 2 and "key 'stop' must be list" in err
