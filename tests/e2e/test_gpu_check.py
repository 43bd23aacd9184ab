"""scripts/gpu_check.py, the GPU machine's check, run here in its ``--emulate`` mode: the same stages and
driver code on the CPU against tests/kernel_emulation.py. A change of a backend's plan or cache API, of
the CLI it calls, or of the layout kvcore is imported from breaks these tests, not the GPU's few minutes."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def test_emulated_run_passes_every_stage_within_the_file_limit(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPT), "--emulate", "--out", str(out)], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)  # not the repo root: the tree shim must serve
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    table = (out / "summary.txt").read_text().splitlines()
    status = {line.split()[0]: line.split()[1] for line in table[1:-1]}
    assert status == {"setup": "PASS", "xformers": "PASS", "flash_shim": "PASS", "flex": "PASS", "conformance": "PASS",
                      "nccl": "PASS", "flash_build": "SKIP", "flash_real": "SKIP"}
    assert "EMULATED" in table[-1] and run.stdout.rstrip().endswith(table[-1])  # the table comes last
    files = list(out.iterdir())
    assert len(files) <= 8 and {f.name for f in files} <= set(gpu_check.FILES)
    assert "kvcore from the working tree" in (out / "setup.log").read_text()
    assert "operators {'emulated': " in (out / "xformers.log").read_text()  # each call's operator is logged


def _broken_plan(monkeypatch):
    from kvcore.backends.xformers import XFormersBackend

    # a plan type the harness does not know: the kind of change that used to rot the check unseen
    monkeypatch.setattr(XFormersBackend, "plan", lambda self, meta, cache: meta)


def _broken_cache_read(monkeypatch):
    from kvcore.scheduling.kv_manager import KVCacheManager

    monkeypatch.delattr(KVCacheManager, "read")


def _wrong_cache_write(monkeypatch):
    from kvcore.backends.flash_attn2 import FlashKVCache

    real = FlashKVCache.write
    monkeypatch.setattr(FlashKVCache, "write", lambda self, layer, k, v, meta: real(self, layer, k, -v, meta))


@pytest.mark.parametrize(
    "stage, breaks",
    [("xformers", _broken_plan), ("flash_shim", _broken_cache_read), ("xformers", _wrong_cache_write)],
    ids=["plan-api", "cache-api", "cache-contents"],
)
def test_stage_fails_when_the_backend_api_changes_under_it(monkeypatch, capsys, stage, breaks):
    breaks(monkeypatch)
    assert gpu_check.run_child(stage, emulate=True) == 1
    assert 'RESULT {"status": "FAIL"' in capsys.readouterr().out


def test_source_tree_maps_the_packages_as_pyproject_does(tmp_path):
    root = gpu_check.source_tree(tmp_path)
    assert (root / "kvcore" / "backends").resolve() == REPO / "backends"
    assert (root / "kvcore" / "conformance").resolve() == REPO / "conformance"
    assert (root / "kvcore" / "__init__.py").resolve() == REPO / "kvcore" / "__init__.py"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"kvcore.backends" = "backends", "kvcore.conformance" = "conformance"' in pyproject


DOC = (REPO / "docs" / "gpu-backends.md").read_text()


def _doc_block(tag: str) -> str:
    """The fenced block right after ``<!-- docs-test: TAG -->`` in docs/gpu-backends.md."""
    m = re.search(rf"<!-- docs-test: {tag} -->\n```sh\n(.*?)^```$", DOC, re.S | re.M)
    assert m, f"docs/gpu-backends.md has no '{tag}' block"
    return m.group(1)


def test_documented_gpu_command_fits_and_uses_what_the_carry_recipe_fetches():
    command = _doc_block("gpu-command").strip()
    assert len(command) <= 2000 and "\n" not in command  # the device machine takes one line of 2,000 chars
    argv = shlex.split(command.replace('"$OUT"', "/out"))
    assert argv[:2] == ["python3", "scripts/gpu_check.py"]
    args = gpu_check.make_parser().parse_args(argv[2:])
    carry = _doc_block("carry")
    downloads = [shlex.split(c.replace("\\\n", " ")) for c in re.split(r"\n(?=\S)", carry) if "pip download" in c]
    assert len(downloads) == 2
    wheels, sdist = downloads
    assert wheels[wheels.index("-d") + 1] == str(args.wheels)
    assert f"{sdist[sdist.index('-d') + 1]}/flash_attn-2.8.3.tar.gz" == str(args.flash_sdist)
    for flag in ("--no-deps", "--only-binary=:all:", "--platform"):
        assert flag in wheels
    assert wheels[wheels.index("--python-version") + 1] == "3.12" and "xformers==0.0.35" in wheels
    assert "flash-attn==2.8.3" in sdist and "--no-binary" in sdist
    for line in re.findall(r"^python3 scripts/gpu_check\.py .*$", DOC, re.M):  # every documented call parses
        gpu_check.make_parser().parse_args(shlex.split(line.split("#")[0].replace('"$OUT"', "/out"))[2:])


def test_carried_dependencies_match_pyproject():
    """setup reports every runtime dependency of pyproject.toml; the recipe pins a version of each that
    the GPU image lacks, and that version satisfies pyproject's bound."""
    from packaging.requirements import Requirement

    deps = {Requirement(d).name: Requirement(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())
            ["project"]["dependencies"]}
    assert set(gpu_check.KVCORE_DEPS) == set(deps)
    pins = dict(re.findall(r"\b([a-z]+)==([0-9.]+)\b", _doc_block("carry")))
    for name in ("gguf", "starlette", "uvicorn"):
        assert deps[name].specifier.contains(pins[name]), f"{name}=={pins[name]} breaks pyproject's {deps[name]}"


FLASH_SWITCH = """#define HEADDIM_SWITCH(HEADDIM, ...)   \\
  [&] {                                    \\
    if (HEADDIM <= 32) {                   \\
      constexpr static int kHeadDim = 32;  \\
      return __VA_ARGS__();                \\
    } else if (HEADDIM <= 64) {            \\
      constexpr static int kHeadDim = 64;  \\
      return __VA_ARGS__();                \\
    } else if (HEADDIM <= 256) {           \\
      constexpr static int kHeadDim = 256; \\
      return __VA_ARGS__();                \\
    }                                      \\
  }()
"""


def _fake_flash_sdist(root: Path, kernels: list[str]) -> None:
    """The three files of a flash-attn 2.8.3 sdist the reduction patches, laid out as that sdist has them."""
    (root / "csrc/flash_attn/src").mkdir(parents=True)
    sources = "".join(f'\n                "csrc/flash_attn/src/{k}",' for k in kernels)
    (root / "setup.py").write_text(f'nvcc_flags = [\n    "--use_fast_math",\n    ]\n'
                                   f'compiler_c17_flag=["-O3", "-std=c++17"]\n'
                                   f'sources=[\n                "csrc/flash_attn/flash_api.cpp",{sources}\n]\n')
    (root / "csrc/flash_attn/src/static_switch.h").write_text(FLASH_SWITCH)
    (root / "csrc/flash_attn/flash_api.cpp").write_text(
        "void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {\n    FP16_SWITCH(x, [&] {\n"
        "        run_mha_bwd_<elem_type, kHeadDim, Is_causal>(params, stream);\n    });\n}\n\nint after;\n")


def test_reduced_flash_build_keeps_only_the_kernels_kvcore_calls(tmp_path):
    kept = ["flash_fwd_hdim64_bf16_sm80.cu", "flash_fwd_hdim128_fp16_causal_sm80.cu",
            "flash_fwd_split_hdim128_bf16_sm80.cu"]
    dropped = ["flash_fwd_hdim32_fp16_sm80.cu", "flash_bwd_hdim64_fp16_sm80.cu", "flash_fwd_split_hdim256_bf16_sm80.cu"]
    _fake_flash_sdist(tmp_path, kept + dropped)
    assert gpu_check.reduce_flash_sources(tmp_path) == len(dropped)
    setup = (tmp_path / "setup.py").read_text()
    assert all(k in setup for k in kept) and not any(d in setup for d in dropped) and "flash_api.cpp" in setup
    assert setup.count("-DFLASHATTENTION_DISABLE_BACKWARD") == 2  # nvcc and the C++ compiler
    switch = (tmp_path / "csrc/flash_attn/src/static_switch.h").read_text().splitlines()
    assert all(line.endswith("\\") for line in switch[:-1]) and switch[-1].strip() == "}()"  # one macro
    assert re.findall(r"kHeadDim = (\d+)", "\n".join(switch)) == ["64", "128"]
    api = (tmp_path / "csrc/flash_attn/flash_api.cpp").read_text()
    assert "run_mha_bwd_<" not in api and "no backward kernels" in api and "int after;" in api
    (tmp_path / "csrc/flash_attn/flash_api.cpp").write_text("// another layout\n")
    with pytest.raises(RuntimeError, match="does not have the expected layout"):
        gpu_check.reduce_flash_sources(tmp_path)
