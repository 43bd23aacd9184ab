"""The ``kvcore`` pytest plugin (registered through the ``pytest11`` entry point).

* ``pytest --kvcore-backend NAME`` with no test paths runs the bundled suite
  (:mod:`kvcore.conformance.suite`) against ``NAME``; with paths, it runs those (your own
  subclasses of :mod:`kvcore.conformance.base` pick the backend up from the option), and
  ``--pyargs kvcore.conformance.suite`` adds the bundled suite explicitly.
* ``--kvcore-kv-cache``, ``--kvcore-sampler``, ``--kvcore-proposer NAME`` certify a KV cache, a sampler or a
  speculative-decoding proposer (the proposer's cases join the speculative tier; named alone, as
  ``kvcore conformance --proposer``, the bundled suite runs that tier only, on the best available backend).
* ``--kvcore-backend-option``, ``--kvcore-kv-cache-option``, ``--kvcore-sampler-option KEY=VALUE``
  (repeatable) are constructor options, as the CLI's ``--backend-option`` and friends;
* ``--kvcore-quick``, ``--kvcore-dtype``, ``--kvcore-device``, ``--kvcore-model`` tune the run;
  ``--kvcore-threads`` (default 1) sets torch's CPU threads while conformance test classes run.

Without ``--kvcore-backend`` the plugin only registers its options: it never adds tests to a
normal pytest run. Disable it with ``-p no:kvcore``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SUITE_MODULE = "kvcore.conformance.suite"
SUITE_PATH = Path(__file__).with_name("suite.py")
#: the options that name what a run certifies: (option, its word in the report header, its prefix in test ids)
TARGET_OPTIONS = (("kvcore_backend", "backend", ""), ("kvcore_kv_cache", "KV cache", "kv_cache="),
                  ("kvcore_sampler", "sampler", "sampler="), ("kvcore_proposer", "proposer", "proposer="))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcore", "kvcore conformance suite")
    group.addoption("--kvcore-backend", metavar="NAME", default=None,
                    help="attention backend to run the kvcore conformance suite against (name or module:Class)")
    group.addoption("--kvcore-kv-cache", metavar="NAME", default=None,
                    help="KV cache to certify (alone: a backend that reads its layout is chosen)")
    group.addoption("--kvcore-sampler", metavar="NAME", default=None, help="sampler to certify")
    group.addoption("--kvcore-proposer", metavar="NAME", default=None,
                    help="speculative-decoding proposer to certify (its cases join the speculative tier)")
    for kind, flag in (("backend", "--kvcore-backend-option"), ("KV cache", "--kvcore-kv-cache-option"),
                       ("sampler", "--kvcore-sampler-option")):
        group.addoption(flag, metavar="KEY=VALUE", action="append", default=None,
                        help=f"constructor option for the {kind} under test (VALUE parsed as JSON when it can be); "
                        "repeatable")
    group.addoption("--kvcore-quick", action="store_true", default=None, help="CI-sized conformance case set")
    group.addoption("--kvcore-dtype", metavar="DTYPE", default=None,
                    help="certify only this dtype: float32, bfloat16 or float16 "
                    "(default: float32 and every reduced precision)")
    group.addoption("--kvcore-device", metavar="DEVICE", default=None, help="torch device (default cpu)")
    group.addoption("--kvcore-model", metavar="SPEC", action="append", default=None,
                    help="model for the model-level tiers (tiny, smollm2, a path); repeatable")
    group.addoption("--kvcore-threads", metavar="N", type=int, default=None,
                    help="torch CPU threads while conformance tests run (default 1; 0 = leave torch's setting)")


#: the one third-party warning the plugin hides (pytest's filterwarnings syntax: message regex, category, module)
TORCH_MKLDNN_WARNING = r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning:torch\.jit\._script"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvcore_conformance: a kvcore backend conformance test")
    # torch.compile (compiled decode cases) imports torch/utils/mkldnn.py, whose class bodies call torch's own
    # deprecated torch.jit.script_method: once per process, nothing kvcore or a backend author can change
    config.addinivalue_line("filterwarnings", TORCH_MKLDNN_WARNING)
    named = [option for option, _, _ in TARGET_OPTIONS if config.getoption(option)]
    if not named:
        return
    # No explicit test paths: run the bundled suite instead of the project's own tests (a proposer alone:
    # the tiers that judge one, as the CLI runs).
    if getattr(config, "args_source", None) != pytest.Config.ArgsSource.ARGS:
        tests = [""]
        if named == ["kvcore_proposer"]:
            # imported here, not at the top: every pytest run loads this plugin, and only a conformance run
            # needs torch and kvcore
            from kvcore.conformance.settings import PROPOSER_TIERS

            tests = [f"::TestConformance::test_{tier}" for tier in PROPOSER_TIERS]
        config.args = [f"{SUITE_PATH}{test}" for test in tests]


#: the bundled suite's node id when it lies outside the rootdir (installed, or run from another project)
SUITE_NODEID = "kvcore/conformance/suite.py"


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """The bundled suite under a readable node id. Given as a path outside the rootdir, pytest names a file
    relative to the path it was given, i.e. itself: every test id then began with an empty path
    (``::TestConformance::test_op[...]``)."""
    if module_path.resolve() != SUITE_PATH.resolve():
        return None
    module = pytest.Module.from_parent(parent, path=module_path)
    if module.nodeid and not module.nodeid.startswith(("/", "::")):
        return module
    return pytest.Module.from_parent(parent, path=module_path, nodeid=SUITE_NODEID)


def pytest_report_header(config: pytest.Config) -> str | None:
    named = [f"{what} {config.getoption(option)}" for option, what, _ in TARGET_OPTIONS if config.getoption(option)]
    if not named:
        return None
    quick = " (quick)" if config.getoption("kvcore_quick") else ""
    return f"kvcore conformance: {', '.join(named)}{quick}"
