"""Issue #54: a user error names what was wrong and its fix (a did-you-mean suggestion, the options a plugin
takes, the setting to raise), in the API as in the CLI."""

from __future__ import annotations

import dataclasses

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
