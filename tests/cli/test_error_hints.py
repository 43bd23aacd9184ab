"""Issue #54: a user error names what was wrong and its fix (a did-you-mean suggestion, the options a plugin
takes, the setting to raise), in the API as in the CLI."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvcore.engine.config import EngineConfig
from kvcore.errors import ConfigError
from kvcore.interfaces.sampler import SamplingParams


def test_unknown_engine_config_field_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown field 'backendd'; did you mean 'backend'"):
        EngineConfig(backendd="sdpa")


def test_unknown_sampling_field_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown field 'temprature'; did you mean 'temperature'\?"):
        SamplingParams(temprature=0.5)
    with pytest.raises(ConfigError, match=r"'zzz' \(its fields: max_new_tokens, .*max_tokens\)"):
        SamplingParams(zzz=1)


def test_strict_keywords_keep_the_dataclass_behaviour():
    assert SamplingParams(max_tokens=5).max_new_tokens == 5  # the InitVar is still a keyword
    assert dataclasses.replace(EngineConfig(), backend="sdpa").backend == "sdpa"
    assert EngineConfig("sdpa").backend == "sdpa"  # positional, as the dataclass takes it
    assert SamplingParams(temperature=0.5) == SamplingParams(temperature=0.5)
    with pytest.raises(TypeError):  # too many positional arguments: still the dataclass's own TypeError
        SamplingParams(*range(30))


@pytest.mark.parametrize(("toml", "expected"), [
    ('backend = "sdpa"\n\n[kv_cache.paged]\nblock_size = 32\n',
     r"'CFG', line 3: unknown section \[kv_cache.paged\]; did you mean 'kv_caches'\?$"),
    ('backend = "sdpa"\n[sdpa]\nx = 1\n', r"'CFG', line 2: unknown section \[sdpa\] \(sections: \[backends.<name>\], "),
    ('backend = "sdpa"\nmax_num_seqs = "x"\n', r"'CFG', line 2: key 'max_num_seqs' must be int, got 'x'$"),
    ('max_num_seqs = \n', r"'CFG' is not valid TOML: .*line 1"),
    ('dtype = "float32"\n# sampling\nmax_new_tokns = 8\n',
     r"'CFG', line 3: unknown key 'max_new_tokns' \(known: .*\); did you mean 'max_new_tokens'"),
    ('backend = "sdpa"\nmax_new_tokens = 0\n', r"'CFG', line 2: max_new_tokens must be a positive integer, got 0$"),
    ('temperature = 0.7\n  top_p = 3.0  # nucleus\n', r"'CFG', line 2: top_p must be in \(0, 1\], got 3.0$"),
    ('weights = "int3"\n', r"'CFG', line 1: weights must be one of: auto, .*; got 'int3'; did you mean 'int8'"),
    ('backends = "sdpa"\n', r"'CFG', line 1: 'backends' must hold tables like \[backends.<name>\]$"),
])
def test_config_file_errors_name_the_file_line_and_fix(tmp_path, toml, expected):
    from kvcore.engine.file_config import load_config

    path = tmp_path / "kvcore.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=expected.replace("CFG", re.escape(str(path)))):
        load_config(path)


@pytest.mark.parametrize(("toml", "line", "expected"), [
    # an option the plugin's constructor does not take: what it takes, and the closest
    ('backend = "paged"\n\n[kv_caches.paged]\nblok_size = 32\n', 4,
     r"KV cache 'paged' got unknown options: blok_size in \[kv_caches.paged\] \(it takes: block_size\); did you "
     r"mean 'block_size'\?"),
    ('backend = "sdpa"\n[backends.sdpa]\n# none\nblok_size = 16\n', 4,
     r"backend 'sdpa' got unknown options: blok_size in \[backends.sdpa\] \(it takes none\)"),
    ('backend = "sdpa"\nbackends.sdpa.blok_size = 16\n', 2, r"backend 'sdpa' got unknown options: blok_size"),
    ('backend = "sdpa"\nbackends = { sdpa = { blok_size = 16 } }\n', 2, r"backend 'sdpa' got unknown options"),
    # an option's value the plugin rejects
    ('backend = "paged"\n[kv_caches.paged]\nblock_size = -16\n', 3,
     r"cache: block_size must be a positive integer, got -16$"),
    # a section whose name no plugin of its kind has
    ('backend = "sdpa"\n[backends.pagd]\nx = 1\n', 2,
     r"\[backends.pagd\] names no registered backend \(registered: .*\); did you mean 'paged'\?"),
    ('backend = "sdpa"\n[samplers.defualt]\n', 2, r"\[samplers.defualt\] names no registered sampler .*did you mean "
                                                   r"'default'\?"),
])
def test_plugin_option_errors_name_the_config_file_and_line(capsys, tmp_path, toml, line, expected):
    """The CLI and the API (``load_settings`` → ``Engine.from_settings``) name the same file and line."""
    from pathlib import Path

    from helpers import run_cli

    from kvcore.engine.core import Engine
    from kvcore.engine.settings import load_settings

    tiny = Path(__file__).parents[1] / "data" / "tiny-llama"
    config = tmp_path / "kvcore.toml"
    config.write_text(toml)
    located = rf"config file '{re.escape(str(config))}', line {line}: {expected}"
    rc, _, err = run_cli(capsys, "generate", "--config", str(config), "--model", str(tiny), "--max-new-tokens", "2",
                         "--no-model-cache", "hi")
    assert rc == 2 and err.count("\n") == 1 and re.match(rf"kvcore: error: {located}", err), err
    with pytest.raises(ConfigError, match=rf"^{located}"):
        Engine.from_settings(load_settings(config, model=str(tiny)), model_cache=False)


def test_plugin_option_errors_name_no_file_without_one():
    """Options given to the API directly (no config file): the same message, no file, no line."""
    from pathlib import Path

    from kvcore.engine.core import Engine

    tiny = Path(__file__).parents[1] / "data" / "tiny-llama"
    config = EngineConfig(backend="paged", kv_cache_options={"paged": {"blok_size": 32}})
    with pytest.raises(ConfigError, match=r"^KV cache 'paged' got unknown options: blok_size in \[kv_caches.paged\]"):
        Engine.from_pretrained(str(tiny), config, model_cache=False)


def test_unknown_plugin_option_lists_what_it_takes_and_suggests():
    from kvcore.interfaces.attention import AttentionBackend

    class Windowed(AttentionBackend):  # options reach the base class through **options
        name = "windowed"

        def __init__(self, window: int = 4, **options):
            super().__init__(**options)

        def forward(self, *args, **kwargs):
            raise NotImplementedError

    with pytest.raises(ConfigError, match=r"^backend 'windowed' got unknown options: windw in "
                                          r"\[backends.windowed\] \(it takes: window\); did you mean 'window'\?$"):
        Windowed(windw=3)


def test_unknown_option_of_a_named_parameter_constructor_suggests():
    from kvcore.plugins.registry import get_registry

    with pytest.raises(ConfigError, match=r"^proposer 'ngram' got unknown options: max_m in \[proposers.ngram\] "
                                          r"\(it takes: max_n, min_n, misses, cooldown\); did you mean 'max_n'\?$"):
        get_registry().create_proposer("ngram", {"max_m": 2})
    with pytest.raises(ConfigError, match=r"^backend 'sdpa' got unknown options: blok_size in \[backends.sdpa\] "
                                          r"\(it takes none\)$"):
        get_registry().create("sdpa", {"blok_size": 2})


def test_context_limit_error_names_the_prompt_and_the_setting_to_raise():
    from helpers import make_random_model

    from kvcore.engine.core import Engine
    from kvcore.errors import ContextLengthError

    engine = Engine(make_random_model(max_positions=64), None, EngineConfig(backend="sdpa", max_model_len=32))
    params = SamplingParams(max_new_tokens=5)
    with pytest.raises(ContextLengthError, match=r"^prompts\[1\] \(of 3\): prompt \(40 tokens\) \+ max_new_tokens "
                                                 r"\(5\) = 45 exceeds the context limit of 32 tokens; .* raise "
                                                 r"max_model_len \(--max-model-len\) up to the model's context "
                                                 r"window of 64 tokens$"):
        engine.generate([[1, 2], list(range(1, 41)), [3]], params)
    assert not engine.has_unfinished()  # the batch's first request was dropped with it
    with pytest.raises(ContextLengthError, match=r"^prompt \(40 tokens\)"):  # one prompt: no index
        engine.generate([list(range(1, 41))], params)
    at_window = Engine(make_random_model(max_positions=32), None, EngineConfig(backend="sdpa"))
    with pytest.raises(ContextLengthError, match=r"32 tokens is the model's whole context window\)$"):
        at_window.generate(list(range(1, 41)), params)


def test_default_cap_is_not_mistaken_for_the_model_window():
    from helpers import make_random_model

    from kvcore.engine.core import Engine
    from kvcore.errors import ContextLengthError

    engine = Engine(make_random_model(max_positions=8192), None, EngineConfig(backend="sdpa", max_num_seqs=1))
    assert engine.max_model_len == 4096
    with pytest.raises(ContextLengthError, match=r"up to the model's context window of 8192 tokens \(4096 is "
                                                 r"kvcore's default cap, not the model's\)$"):
        engine.add_request([1] * 4096, SamplingParams(max_new_tokens=1))


def test_context_limit_names_the_files_window_not_the_loaded_tables():
    """A loaded model's RoPE tables stop at max_model_len; the fix still names the file's own window."""
    from pathlib import Path

    from kvcore.engine.core import Engine
    from kvcore.errors import ContextLengthError

    tiny = Path(__file__).parents[1] / "data" / "tiny-llama"
    engine = Engine.from_pretrained(str(tiny), EngineConfig(backend="sdpa", max_model_len=32), model_cache=False)
    window = engine.model.context_window
    assert engine.model.config.max_position_embeddings == 32 < window
    with pytest.raises(ContextLengthError, match=rf"raise max_model_len \(--max-model-len\) up to the model's "
                                                 rf"context window of {window} tokens$"):
        engine.generate([1] * 40, SamplingParams(max_new_tokens=1))


@pytest.fixture
def torch_threads():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield torch
    finally:
        torch.set_num_threads(before)


def test_from_settings_applies_threads_as_the_cli_does(tmp_path, torch_threads):
    from pathlib import Path

    from kvcore.engine.core import Engine
    from kvcore.engine.settings import load_settings

    tiny = Path(__file__).parents[1] / "data" / "tiny-llama"
    config = tmp_path / "kvcore.toml"
    config.write_text(f'model = "{tiny}"\nbackend = "sdpa"\nmax_model_len = 64\n')
    # unset, a library leaves torch's process-wide count alone (the CLI picks one from the load instead)
    Engine.from_settings(load_settings(config), model_cache=False)
    assert torch_threads.get_num_threads() == 2
    Engine.from_settings(load_settings(config, threads=1), model_cache=False)
    assert torch_threads.get_num_threads() == 1
    with pytest.raises(ConfigError, match="threads must be an integer from 1 to"):
        Engine.from_settings(load_settings(config, threads=0), model_cache=False)


def test_greedy_warns_only_for_sampling_flags_given_now(capsys, tmp_path):
    from pathlib import Path

    from helpers import run_cli

    tiny = Path(__file__).parents[1] / "data" / "tiny-llama"
    config = tmp_path / "kvcore.toml"
    config.write_text("seed = 0\ntop_p = 0.9\n")  # a shipped config's standing defaults: no warning
    base = ["generate", "--config", str(config), "--model", str(tiny), "--backend", "sdpa", "--max-new-tokens", "2"]
    rc, _, err = run_cli(capsys, *base, "hello")
    assert rc == 0 and err == ""
    rc, _, err = run_cli(capsys, *base, "--seed", "5", "hello")
    assert rc == 0 and err.strip().splitlines() == [
        "kvcore: warning: --seed has no effect at temperature 0 (greedy); set --temperature"]


def test_chat_seed_is_no_greedy_warning(capsys):
    """chat samples by default (its defaults fill in the temperature): a --seed is used, no warning; with
    --temperature 0 it is not, and the warning says so."""
    from pathlib import Path

    from helpers import run_cli

    tiny = Path(__file__).parents[1] / "data" / "tiny-llama"
    base = ["chat", "--model", str(tiny), "--backend", "sdpa", "--max-new-tokens", "2", "--seed", "4"]
    rc, _, err = run_cli(capsys, *base, "hi")
    assert rc == 0 and err == ""
    rc, _, err = run_cli(capsys, *base, "--temperature", "0", "hi")
    assert rc == 0 and err.strip() == ("kvcore: warning: --seed has no effect at temperature 0 (greedy); "
                                       "set --temperature")


def test_pytest_plugin_hides_only_torchs_script_method_deprecation():
    import warnings

    message = "`torch.jit.script_method` is deprecated. Please switch to `torch.compile` or `torch.export`."
    with warnings.catch_warnings(record=True) as caught:  # keeps the filters pytest and its plugins set
        warnings.warn_explicit(message, DeprecationWarning, "torch/jit/_script.py", 365, module="torch.jit._script")
        warnings.warn_explicit("another deprecation", DeprecationWarning, "torch/jit/_script.py", 1,
                               module="torch.jit._script")
        warnings.warn_explicit(message, DeprecationWarning, "kvcore/x.py", 1, module="kvcore.x")
    assert [(str(w.message), w.filename) for w in caught] == [
        ("another deprecation", "torch/jit/_script.py"), (message, "kvcore/x.py")]
