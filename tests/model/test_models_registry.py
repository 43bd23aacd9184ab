"""The architecture registry: built-ins through the public hook, a third-party architecture added by a
throwaway plugin (and gone again after), and ``kvcore models`` generated from the declarations."""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import save_file
from tiny_checkpoints import build_hf, greedy_reference, save_hf

from kvcore import Engine, EngineConfig, SamplingParams, hookimpl
from kvcore.errors import ModelLoadError
from kvcore.loaders import build_model, load_model
from kvcore.model.architectures import Architecture
from kvcore.plugins.registry import ARCHITECTURE, get_registry

pytest.importorskip("transformers")

PROMPTS = [[5, 71, 200, 9, 33], [250, 3, 64, 11]]


class FusedQwen(Architecture):
    """A made-up family: Qwen2's decoder, its checkpoints storing Q/K/V (weights and biases) fused."""

    name = "fused-qwen"
    description = "Qwen2 with fused qkv_proj tensors"
    hf_architectures = ("FusedQwenForCausalLM",)
    options = {"attention_bias": True}
    hf_fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}


def _plugin() -> types.ModuleType:
    module = types.ModuleType("fused_qwen_plugin")

    @hookimpl
    def kvcore_register_architectures(register):
        register(FusedQwen)

    module.kvcore_register_architectures = kvcore_register_architectures
    return module


def test_builtins_register_through_the_hook():
    entries = get_registry().entries(ARCHITECTURE)
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2"} <= set(entries)
    assert {entries[n].plugin for n in ("llama", "gemma2")} == {"kvcore.model.families"}


def test_third_party_architecture(tmp_path):
    reference = build_hf("qwen2")
    want = greedy_reference(reference, PROMPTS, 6)
    path = save_hf(reference, tmp_path / "fused")
    state = {k: v.clone() for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # tied
    for i in range(reference.config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            state[p + f"qkv_proj.{kind}"] = torch.cat([state.pop(p + f"{n}_proj.{kind}") for n in "qkv"])
    (path / "model.safetensors").unlink()
    save_file(state, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["FusedQwenForCausalLM"],
                                                  "model_type": "fused-qwen"}))
    registry = get_registry()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'FusedQwenForCausalLM'"):
        load_model(str(path))
    registry.register_plugin(_plugin(), name="fused-qwen-plugin")
    try:
        loaded = load_model(str(path))
        assert loaded.config.architecture == "fused-qwen" and loaded.config.attention_bias
        model = build_model(loaded)
        engine = Engine(model, loaded.tokenizer, EngineConfig(backend="sdpa"))
        got = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))]
        assert got == want
        rows = _models_json()
        assert {"architecture": "fused-qwen", "plugin": "fused-qwen-plugin"}.items() <= next(
            r for r in rows if r["architecture"] == "fused-qwen").items()
    finally:
        registry.unregister_plugin("fused-qwen-plugin")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'FusedQwenForCausalLM'"):
        load_model(str(path))
    assert "fused-qwen" not in {r["architecture"] for r in _models_json()}


def _models_json() -> list[dict]:
    import contextlib
    import io

    from kvcore.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["models", "--json"]) == 0
    return json.loads(out.getvalue())


def test_kvcore_models_lists_families_and_serving_backends(capsys):
    from kvcore.cli import main

    rows = {r["architecture"]: r for r in _models_json()}
    assert rows["qwen2"]["hugging_face"] == "Qwen2ForCausalLM" and rows["qwen2"]["gguf"] == "qwen2"
    assert rows["mistral"]["gguf"] == "-"  # llama.cpp writes Mistral as "llama"
    assert {"naive", "sdpa", "paged"} <= set(rows["llama"]["backends"].split(","))
    assert {"naive", "sdpa", "paged", "cpu_decode"} <= set(rows["gemma2"]["backends"].split(","))
    assert "qk_norm=True" in rows["qwen3"]["options"]
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split()[:3] == ["architecture", "plugin", "hugging_face"]
    assert all(name in text for name in rows)


def test_models_say_which_variant_no_backend_serves():
    from types import SimpleNamespace

    import torch

    from kvcore.interfaces.attention import BackendCapabilities
    from kvcore.model.families import Gemma2, Llama
    from kvcore.plugins.model_support import serving_backends

    def backend(prefill, decode):
        caps = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                                   kv_layouts=("contiguous",), prefill_variants=frozenset(prefill),
                                   decode_variants=frozenset(decode))
        return SimpleNamespace(cls=SimpleNamespace(capabilities=caps))

    registry = SimpleNamespace(backends={"a": backend({"sliding_window", "softcap"}, {"sliding_window"}),
                                         "b": backend({"sliding_window"}, {"sliding_window", "softcap"})})
    assert serving_backends(registry, Gemma2) == ([], ["soft-capping"])  # each lacks it in one phase
    assert serving_backends(registry, Llama) == (["a", "b"], [])
    registry.backends["c"] = backend({"sliding_window", "softcap"}, {"sliding_window", "softcap"})
    assert serving_backends(registry, Gemma2) == (["c"], [])


def test_readme_models_table_is_generated():
    from pathlib import Path

    from kvcore.plugins.model_support import architecture_rows, markdown_rows
    from kvcore.plugins.registry import PluginRegistry

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = markdown_rows(architecture_rows(PluginRegistry(load_entrypoints=False)))
    assert table in readme, "README's models table is stale: paste `KVCORE_LOAD_PLUGINS= kvcore models --markdown`"


def test_models_name_the_variant_each_left_out_backend_lacks(capsys):
    """A backend missing from a family's row is named with what it lacks, in --json and in the text table."""
    from types import SimpleNamespace

    import torch

    from kvcore.cli import main
    from kvcore.hookspecs import hookimpl
    from kvcore.interfaces.attention import AttentionBackend, BackendCapabilities
    from kvcore.model.families import Gemma2, Llama, Mistral
    from kvcore.plugins.model_support import unserved_reasons
    from kvcore.plugins.registry import get_registry

    def backend(prefill, decode):
        caps = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                                   kv_layouts=("contiguous",), prefill_variants=frozenset(prefill),
                                   decode_variants=frozenset(decode))
        return SimpleNamespace(cls=SimpleNamespace(capabilities=caps))

    window = {"sliding_window"}
    registry = SimpleNamespace(backends={"plain": backend((), ()), "win": backend(window, window),
                                         "half": backend(window | {"softcap"}, window)})
    assert unserved_reasons(registry, Llama) == {}
    assert unserved_reasons(registry, Mistral) == {"plain": "no sliding windows"}
    assert unserved_reasons(registry, Gemma2) == {"plain": "no sliding windows, no soft-capping",
                                                  "win": "no soft-capping", "half": "decode: no soft-capping"}

    class NoVariants(AttentionBackend):
        name = "no_variants_backend"
        capabilities = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                                           kv_layouts=("contiguous",))

        def forward(self, layer_idx, q, k, v, cache, plan):
            raise NotImplementedError

    class Plugin:
        @hookimpl
        def kvcore_register_backends(self, register):
            register(NoVariants)

    name = get_registry().register_plugin(Plugin(), name="no-variants-plugin")
    try:
        rows = {r["architecture"]: r for r in _models_json()}
        assert rows["qwen2"]["unserved_by"]["no_variants_backend"] == "no sliding windows"
        assert "no_variants_backend" not in rows["llama"]["unserved_by"]
        assert "no_variants_backend" in rows["llama"]["backends"].split(",")
        assert main(["models"]) == 0
        lines = capsys.readouterr().out.splitlines()
        qwen2 = next(i for i, line in enumerate(lines) if line.startswith("qwen2 "))
        assert lines[qwen2 + 1].strip().startswith("not served by: ")
        assert "no_variants_backend (no sliding windows)" in lines[qwen2 + 1]
    finally:
        get_registry().unregister_plugin(name)
