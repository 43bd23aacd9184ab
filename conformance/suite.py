"""The bundled conformance suite, collected by ``pytest --kvcore-backend NAME`` (see
:mod:`kvcore.conformance.pytest_plugin`) or ``pytest --kvcore-backend NAME --pyargs kvcore.conformance.suite``."""

from __future__ import annotations

import pytest

from kvcore.conformance.base import BaseConformanceTests

pytestmark = pytest.mark.kvcore_conformance


class TestConformance(BaseConformanceTests):
    """Every tier against the backend named by ``--kvcore-backend``."""
