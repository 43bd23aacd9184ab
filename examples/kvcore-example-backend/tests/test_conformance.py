"""The kvcore conformance suite for this package, by subclassing its base classes."""

import pytest
from kvcore_example_backend import ChunkedAttentionBackend

from kvcore.conformance.base import BaseConformanceTests


class TestExampleChunked(BaseConformanceTests):
    conformance_quick = True  # CI-sized; run `kvcore conformance --backend example_chunked` before a release
    conformance_models = ("tiny",)

    @pytest.fixture
    def backend(self):
        return ChunkedAttentionBackend
