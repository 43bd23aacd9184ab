"""One source for every setting: the dataclasses (EngineConfig, SamplingParams, and the run keys) declare them;
the TOML keys and CLI flags are derived from the declarations, the HTTP fields checked against them here, and
load_settings() splits a file into what the Python API takes."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, fields

import pytest
from helpers import subcommands

from kvcore import EngineConfig, SamplingParams, Settings, load_settings
from kvcore.cli.parser import build_parser, parse_args
from kvcore.cli.settings import resolve_settings
from kvcore.engine.fields import SETTINGS, EngineFields, RunFields
from kvcore.engine.file_config import OPTION_TABLES, FileConfig, file_keys, load_config
from kvcore.engine.settings import settings_from
from kvcore.errors import ConfigError
from kvcore.interfaces.setting import declared, setting
from kvcore.kernels.quant import WEIGHT_FORMATS
from kvcore.model.lm_head import LM_HEAD_FORMATS
from kvcore.serving import protocol

FILE = {f.name for f in fields(FileConfig)}
ENGINE = {f.name for f in fields(EngineConfig)}
SAMPLING = {f.name for f in fields(SamplingParams)}
#: settings only the Python API takes, and why they are not config-file keys
API_ONLY = {
    "n": "per request (HTTP and API)",
    "cache_salt": "per request or tenant (HTTP and API)",
    "structured_output": "per request (HTTP fields, --json-schema / --regex / --grammar)",
    "logit_bias": "per request: token ids are the model's, TOML keys are strings",
    "stop_token_ids": "per request (HTTP and API)",
}
#: flags that are about one command, not a run setting
_RUN = {"json", "config", "no_model_cache", "debug", "verbose"}
#: a request's structured-output constraint, read from a file or given once (SamplingParams.structured_output)
_STRUCTURED = {"json_schema", "regex", "grammar"}
COMMAND_ONLY = {
    "generate": {"prompt", "prompt_file"} | _RUN | _STRUCTURED,
    "chat": {"prompt", "prompt_file", "interactive", "system"} | _RUN | _STRUCTURED,
    "serve": {"config", "no_model_cache", "debug", "verbose", "host", "port", "api_key", "served_model_name",
              "log_level", "max_queue_len", "step_watchdog_s", "strict"},
}


def test_every_file_key_is_a_dataclass_field_or_a_run_key():
    tables = set(OPTION_TABLES)
    assert FILE - tables - ENGINE - SAMPLING == {"model", "threads", "plugins"}
    assert {d.setting.table or d.name for d in declared(RunFields)} == {"model", "threads", "plugins"}
    assert {OPTION_TABLES[t] for t in tables} <= ENGINE


def test_every_dataclass_field_is_a_file_key_or_documented_api_only():
    options = set(OPTION_TABLES.values())
    assert (ENGINE | SAMPLING) - FILE - options == set(API_ONLY)


@pytest.mark.parametrize("command", sorted(COMMAND_ONLY))
def test_cli_flags_are_settings(command):
    parser = subcommands()[command]
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    assert dests - FILE == COMMAND_ONLY[command]
    # a setting's flag defaults to None, so the environment, the config file and the dataclass default apply
    defaults = {a.dest: a.default for a in parser._actions if a.dest in FILE and a.default is not None}
    assert defaults == {}


def test_flag_choices_are_the_formats_the_engine_takes():
    """The flags' choices are written where torch is not imported; they must be the formats the checks accept."""
    choices = {d.name: d.setting.choices for d in declared(EngineFields)}
    assert (set(choices["weights"]), set(choices["lm_head"])) == (set(WEIGHT_FORMATS), set(LM_HEAD_FORMATS))


@dataclass
class _Extended(EngineConfig):
    """EngineConfig with two settings more, declared the one way a setting is: as a field."""

    draft_depth: int = setting(4, min=1, metavar="D", help="how deep drafts go (default {default})")
    variants: tuple[str, ...] = setting((), flag="--variant", metavar="NAME", help="allow NAME; repeat for several")
    eager: bool = setting(True, help="run eagerly")  # on by default: --eager / --no-eager


def test_a_new_field_is_a_config_key_and_a_flag(monkeypatch, tmp_path, capsys):
    """Adding an engine setting is one field: with no other change it is a typed config-file key, a flag of
    every command that starts an engine (with its help; a tuple is a repeatable flag) and a checked value."""
    monkeypatch.setitem(SETTINGS, "engine", _Extended)
    assert {"draft_depth", "variants"} <= set(file_keys())
    path = tmp_path / "kvcore.toml"
    path.write_text('draft_depth = 2\nvariants = ["sliding", "softcap"]\n')
    cfg = load_config(path)
    assert (cfg.draft_depth, cfg.variants, cfg.backends) == (2, ["sliding", "softcap"], {})
    for bad, message in [('draft_depth = "x"', "key 'draft_depth' must be int"), ("variants = [1]", "must be list"),
                         ("draft_dept = 1", "did you mean 'draft_depth'?")]:
        path.write_text(bad + "\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    [sub] = [a for a in build_parser(plugin_commands=False)._actions if a.__class__.__name__ == "_SubParsersAction"]
    for command in ("generate", "chat", "serve"):
        helps = {o: a.help for a in sub.choices[command]._actions for o in a.option_strings}
        assert helps["--draft-depth"] == "how deep drafts go (default 4)"
        assert helps["--variant"] == "allow NAME; repeat for several"
    path.write_text("draft_depth = 2\n")
    args = parse_args(["generate", "--variant", "a", "--variant", "b", "--no-eager", "--config", str(path), "hi"])
    s = resolve_settings(args)
    assert (s["draft_depth"], s["variants"], s["eager"], s["max_new_tokens"]) == (2, ["a", "b"], False, None)
    config = _Extended(**{f.name: s[f.name] for f in fields(_Extended) if s.get(f.name) is not None})
    assert (config.draft_depth, config.variants, config.eager) == (2, ["a", "b"], False)
    with pytest.raises(ConfigError, match="draft_depth must be a positive integer, got 0"):
        _Extended(draft_depth=0)
    with pytest.raises(SystemExit):
        parse_args(["serve", "--draft-depht", "3"])
    assert "unknown flag --draft-depht; did you mean '--draft-depth'?" in capsys.readouterr().err


def test_a_setting_no_file_or_flag_can_give_is_refused():
    @dataclass
    class Ids:
        ids: tuple[int, ...] = setting((), help="token ids")

    @dataclass
    class Required:
        name: str = setting(help="no default")

    with pytest.raises(TypeError, match=r"Ids.ids: a setting is a bool, int, float, str, tuple\[str, ...\]"):
        declared(Ids)
    with pytest.raises(TypeError, match="Required.name: a setting needs a default"):
        declared(Required)


def test_http_sets_every_sampling_field():
    """The OpenAI endpoints build SamplingParams in one call that names every field (a new field must be
    wired to its HTTP name, or the server silently serves its default)."""
    tree = ast.parse(inspect.getsource(protocol._params))
    [call] = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "SamplingParams"]
    assert {k.arg for k in call.keywords} == SAMPLING


def test_load_settings_splits_a_file(tmp_path):
    path = tmp_path / "kvcore.toml"
    path.write_text(
        'model = "tiny"\nbackend = "paged"\nkv_cache = "int8"\nsampler = "default"\nthreads = 2\n'
        "temperature = 0.5\nmax_new_tokens = 7\nblock_size = 32\n"
        "[backends.paged]\n[kv_caches.int8]\nblock_size = 32\n[samplers.default]\n"
        "[plugins.someone]\nflag = true\n"
    )
    s = load_settings(path, max_new_tokens=3, top_k=None)
    assert isinstance(s, Settings)
    assert (s.model, s.threads) == ("tiny", 2)
    assert (s.engine.backend, s.engine.kv_cache, s.engine.sampler, s.engine.block_size) == ("paged", "int8",
                                                                                            "default", 32)
    assert s.engine.kv_cache_options == {"int8": {"block_size": 32}}
    assert s.engine.backend_options == {"paged": {}}
    assert (s.sampling.temperature, s.sampling.max_new_tokens, s.sampling.top_k) == (0.5, 3,
                                                                                     SamplingParams().top_k)
    assert s.plugin_options == {"someone": {"flag": True}}


def test_load_settings_defaults_and_errors(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text("")
    s = load_settings(path)
    assert s.engine == EngineConfig() and s.sampling == SamplingParams() and s.model == "smollm2"
    with pytest.raises(ConfigError, match="unknown setting 'temprature'"):
        load_settings(path, temprature=0.3)
    with pytest.raises(ConfigError, match="unknown setting"):
        settings_from({"kv_cache_options": {}})  # the EngineConfig name, not the file's table name
    bad = tmp_path / "bad.toml"
    bad.write_text("temperature = 'hot'\n")
    with pytest.raises(ConfigError, match="'temperature'"):
        load_settings(bad)
