"""Faulty plugins are caught, named and skipped; everything else keeps working."""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest
import torch
from helpers import make_plugin, registered

from kvcore import BackendCapabilities, hookimpl
from kvcore.backends.sdpa import SDPABackend
from kvcore.plugins import kinds as plugin_kinds
from kvcore.plugins.registry import BACKEND, PluginRegistry

CAPS = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), kv_layouts=("contiguous",))


@pytest.fixture
def registry():
    reg = PluginRegistry(load_entrypoints=False)
    reg.backends  # noqa: B018 - load built-ins
    return reg


def test_raising_configure_is_named_and_the_plugin_skipped(registry):
    module = types.ModuleType("grumpy")

    @hookimpl
    def kvcore_configure(options):
        raise ValueError("cannot take these options")

    module.kvcore_configure = kvcore_configure
    registry.register_plugin(module, name="grumpy")
    with pytest.warns(RuntimeWarning, match="plugin 'grumpy' raised in kvcore_configure and was skipped: ValueError"):
        registry.configure({"grumpy": {"x": 1}})
    assert registry.pm.get_plugin("grumpy") is None
    assert "sdpa" in registry.backends  # the others keep working


@pytest.mark.parametrize("bad_caps", [{"devices": ["cpu"]}, None, "cpu"])
def test_capabilities_of_the_wrong_type_are_rejected_at_registration(registry, bad_caps):
    bad = type("Bad", (SDPABackend,), {"name": "bad_caps", "capabilities": bad_caps})
    with registered(registry, make_plugin(backends=[bad]), "bad-caps-plugin"):
        with pytest.warns(RuntimeWarning, match="capabilities must be a BackendCapabilities"):
            backends = registry.backends
        assert "bad_caps" not in backends and "sdpa" in backends


def test_backend_reading_an_unknown_layout_is_unavailable_with_the_reason(registry):
    odd = type("Odd", (SDPABackend,), {"name": "odd", "capabilities": dataclasses.replace(CAPS, kv_layouts=("nope",))})
    with registered(registry, make_plugin(backends=[odd]), "odd-plugin"):
        reason = registry.backends["odd"].availability()
    assert "reads KV layouts nope, which no registered KV cache provides" in reason


def test_hung_availability_check_is_reported_not_waited_for(registry, monkeypatch):
    release = threading.Event()

    class Hangs(SDPABackend):
        name = "hangs"

        @classmethod
        def availability(cls):
            release.wait(30)  # never returns within the limit
            return None

    monkeypatch.setattr(plugin_kinds, "AVAILABILITY_TIMEOUT_S", 0.2)
    try:
        with registered(registry, make_plugin(backends=[Hangs]), "hangs-plugin"):
            assert "did not return within 0.2 s" in registry.get("hangs", BACKEND).availability()
            # asked again, it is not called again (no second stuck thread)
            assert "did not return" in registry.get("hangs", BACKEND).availability()
            assert registry.get("sdpa", BACKEND).availability() is None
    finally:
        release.set()


def test_raising_availability_is_a_one_line_reason(registry):
    class Raises(SDPABackend):
        name = "raises"

        @classmethod
        def availability(cls):
            raise RuntimeError("driver exploded\nsecond line")

    with registered(registry, make_plugin(backends=[Raises]), "raises-plugin"):
        reason = registry.get("raises", BACKEND).availability()
    assert reason == "availability check raised RuntimeError: driver exploded"
