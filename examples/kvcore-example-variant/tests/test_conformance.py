"""kvcore's conformance suite with this package's variants selected, by subclassing its base classes: the
token-stream tier certifies naive (the reference evaluates variants as code) with both variants on every
engine, the reference's included. The op tier runs through ``kvcore conformance`` (test_variants.py)."""

import pytest

from kvcore.conformance.base import BaseTokenStreamTests
from kvcore.conformance.target import resolve_target


class TestNaiveWithTheVariants(BaseTokenStreamTests):
    conformance_quick = True
    conformance_dtype = "float32"
    conformance_models = ("tiny",)
    conformance_attention_variants = ("alibi", "local_global")  # installed: cases are made at collection

    @pytest.fixture
    def backend(self, registry):
        return resolve_target("naive", registry)
