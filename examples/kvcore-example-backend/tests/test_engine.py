"""The three plugins together in kvcore's engine, selected by ``EngineConfig`` and by the package's kvcore.toml."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.errors import ConfigError
from kvcore.plugins.registry import PluginRegistry

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
ALL_THREE = dict(backend="example_chunked", kv_cache="example_fp16", sampler="example_repetition_penalty")


def tiny_model_and_prompts(make_model):
    """kvcore's conformance model ``tiny`` (random weights, clear top-1 gaps) and its ragged prompts."""
    try:
        from kvcore.conformance.models import get_model
    except ImportError:  # the conformance package is not importable: a random model of our own
        model = make_model(vocab_size=256)
        return model, [[11, 40, 7], [99, 3, 64, 200, 17, 5, 8, 150, 23], [42]]
    tiny = get_model("tiny", torch.float32, "cpu")
    return tiny.model, tiny.prompts


def test_engine_runs_all_three_plugins(registry, make_model):
    model, prompts = tiny_model_and_prompts(make_model)
    config = EngineConfig(**ALL_THREE, block_size=4, max_num_seqs=4, max_model_len=64,
                          sampler_options={"example_repetition_penalty": {"penalty": 1.5}})
    engine = Engine(model, None, config, registry=registry)
    assert engine.prefill_backend.name == engine.decode_backend.name == "example_chunked"
    assert engine.cache.name == "example_fp16" and engine.sampler.name == "example_repetition_penalty"
    assert engine.sampler.penalty == 1.5
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert all(r.error is None and len(r.token_ids) == 12 for r in results)
    assert engine.kv.blocks.num_tokens_in_use == 0  # every block given back

    # The built-in paged backend reading the same float16 cache picks the same tokens.
    reference = Engine(model, None, dataclasses.replace(config, backend="paged"), registry=registry)
    assert reference.cache.name == "example_fp16"
    assert [r.token_ids for r in reference.generate(prompts, params)] == [r.token_ids for r in results]


def looping_model(make_model, a: int = 10, b: int = 11):
    """A model whose greedy stream is provably ``a a a ...`` whatever the context.

    The last RMSNorm keeps only hidden dimension 0; every token embeds 1 there and no layer writes to it
    (row 0 of each output projection is zero), so the final hidden state is ``c · e_0`` with ``c > 0`` at
    every position, and the logits are ``c · lm_head[:, 0]``: a fixed ranking, ``a`` (1.0) first, ``b``
    (0.95) second, every other token negative. With a repetition penalty of 1.2, once ``a`` is in the
    history its logit ``c / 1.2`` falls below ``b``'s ``0.95 c``; once both are, ``a`` leads again.
    """
    model = make_model(vocab_size=64, seed=1)
    with torch.no_grad():
        model.norm.zero_()[0] = 1.0
        model.embed_tokens[:, 0] = 1.0
        for layer in range(model.config.num_hidden_layers):
            model.o_proj[layer][0] = 0.0
            model.down_proj[layer][0] = 0.0
        column = -1.0 - torch.rand(64, generator=torch.Generator().manual_seed(0))
        column[a], column[b] = 1.0, 0.95
        model.lm_head[:, 0] = column
    return model


def test_repetition_penalty_breaks_a_greedy_loop(registry, make_model):
    model = looping_model(make_model)
    prompt, params = [20, 30, 40, 30], SamplingParams(max_new_tokens=8)
    plain = Engine(model, None, EngineConfig(backend="example_chunked", kv_cache="example_fp16"), registry=registry)
    assert plain.generate([prompt], params)[0].token_ids == [10] * 8
    engine = Engine(model, None, EngineConfig(**ALL_THREE), registry=registry)
    assert engine.generate([prompt], params)[0].token_ids == [10, 11] + [10] * 6


@pytest.mark.parametrize("penalty", [1.0, 0.9])
def test_a_penalty_that_does_not_penalise_is_refused(registry, make_model, penalty):
    config = EngineConfig(**ALL_THREE, sampler_options={"example_repetition_penalty": {"penalty": penalty}})
    with pytest.raises(ConfigError, match="penalty must be a number > 1"):
        Engine(make_model(), None, config, registry=registry)


def load_generate_script():
    """generate.py, imported from its path (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("kvcore_example_generate", PACKAGE_ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_kvcore_toml_selects_the_three_plugins(registry, make_model):
    generate = load_generate_script()
    settings = generate.load_settings(PACKAGE_ROOT / "kvcore.toml", max_new_tokens=5)
    config = settings.engine
    assert (config.backend, config.kv_cache, config.sampler) == tuple(ALL_THREE.values())
    assert settings.model == "smollm2" and settings.sampling.max_new_tokens == 5
    assert set(config.sampler_options["example_repetition_penalty"]) == {"penalty", "base"}
    # The same settings on a small model (generate.py itself loads SmolLM2: seconds, so not here).
    engine = Engine(make_model(), None, config, registry=registry)
    assert (engine.prefill_backend.name, engine.cache.name, engine.sampler.name) == tuple(ALL_THREE.values())
    assert engine.cache.block_size == config.kv_cache_options["example_fp16"]["block_size"]
    assert len(engine.generate([[5, 6, 7]], settings.sampling)[0].token_ids) == 5


def test_the_entry_point_registers_all_three(monkeypatch):
    declared = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["kvcore"]
    assert declared == {"example_chunked": "kvcore_example_backend.plugin"}
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="kvcore")}
    if installed.get("example_chunked") != declared["example_chunked"]:
        pytest.skip("the package is not installed: pip install -e examples/kvcore-example-backend")
    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "example_chunked")
    registry = PluginRegistry()
    assert registry.backends["example_chunked"].plugin == "example_chunked"
    assert registry.kv_caches["example_fp16"].plugin == "example_chunked"
    assert registry.samplers["example_repetition_penalty"].plugin == "example_chunked"
    assert not registry.load_warnings
