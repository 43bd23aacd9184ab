"""Shared fixtures: a random-weights tiny Llama built in memory, and the embedded SmolLM2 (slow).

Tiers (docs/testing.md): unmarked tests are fast; ``@pytest.mark.slow`` ones load SmolLM2 or a real GGUF and run
in ``make test`` too; ``@pytest.mark.full`` ones are the long oracle runs (every golden token of every prompt)
whose bounded form ``make test`` runs, and are skipped unless pytest gets ``--full`` (``make test-full``). A new
test that takes more than about 30 s on a quiet 2-core machine is ``full``, with a bounded form beside it that
still fails on a wrong token.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_random_model

from kvcore import LlamaModel
from kvcore.conformance.pytest_plugin import TARGET_OPTIONS
from kvcore.plugins.registry import reset_registry

DATA = Path(__file__).parent / "data"

# Plugin-loading warnings are asserted explicitly where they matter.
warnings.filterwarnings("ignore", message="kvcore: built-in plugin", category=RuntimeWarning)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the full tier (@pytest.mark.full: the long oracle runs; make test-full)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("full"):
        return
    skip = pytest.mark.skip(reason="full tier: run with --full (make test-full)")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # an xdist worker (`make test`: pytest -n 2)
        # each worker takes its share of the cores, it and the processes it starts (kvcore's CLI reads
        # OMP_NUM_THREADS): more compute threads than cores make every parallel region wait for the slowest
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // int(workers))))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # The repo's own tests see third-party plugins only where a test asks for them. A run of the bundled
    # conformance suite (`pytest --kvcore-backend NAME` from the repo root loads this file too) certifies
    # exactly such a plugin, so it keeps the environment's plugins.
    if any(config.getoption(option, None) for option, _, _ in TARGET_OPTIONS):
        return
    os.environ.setdefault("KVCORE_LOAD_PLUGINS", "")
    # Tests never write prepared models under the user's cache folder (tests/loaders/test_model_cache.py turns the
    # cache on in a temporary one).
    os.environ.setdefault("KVCORE_MODEL_CACHE", "0")


@pytest.fixture
def bench_plugin(monkeypatch):
    """Allow the kvcore-bench entry point (this file loads no third-party plugin by default)."""
    monkeypatch.setenv("KVCORE_LOAD_PLUGINS", "bench")
    reset_registry()
    try:
        yield
    finally:
        reset_registry()  # the next test's registry is built without it again


@pytest.fixture(scope="session")
def random_model() -> LlamaModel:
    return make_random_model()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct, loaded once per test session (fp32 weights + tokenizer)."""
    from kvcore.loaders import load_model

    return load_model("smollm2")


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The CLI sets torch's thread count (--threads, or the free cores); a test calling ``main()`` in this
    process must not change it for the tests after it."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread_module():
    """torch on one thread for a whole module (``pytestmark = pytest.mark.usefixtures("one_thread_module")``): the
    conformance modules' many tiny forwards run faster without thread hand-offs, beside the other xdist worker."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
