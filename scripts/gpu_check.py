#!/usr/bin/env python3
"""One short check of kvcore's GPU backends on a CUDA machine that has no network (see docs/gpu-backends.md).

    python3 scripts/gpu_check.py [--wheels DIR] [--flash-sdist FILE] [--out DIR] [--emulate]

Nothing is installed: kvcore runs from this working tree (a folder of links maps ``kvcore.backends`` to
``backends/`` and ``kvcore.conformance`` to ``conformance/``, as pyproject.toml does), and the wheels in
``--wheels`` are unpacked into a temporary folder on ``PYTHONPATH``. Each stage runs in its own process
under its own time limit; the summary table comes last.

Stages: ``setup`` (environment, available kernels, kvcore and xformers importable) → ``xformers`` (the real
kernels vs naive on both cache kinds × MHA/GQA/MQA × head_dim 64/128 × bf16/fp16/fp32, caches bit-identical,
the operator that served each call logged) → ``flash_shim`` (the flash_attn2 glue driven through torch's own
FlashAttention-2 kernel) → ``flex`` (FlexAttention vs naive on both cache layouts, eagerly on every case
and compiled on one) → ``conformance`` (engine greedy streams vs naive, then ``kvcore conformance
--device cuda --quick --model tiny`` for xformers, sdpa, paged and int8) → ``nccl`` (a one-rank NCCL
all-reduce; tensor parallelism over more GPUs than there are refused in one line) → ``flash_build`` (with
``--flash-sdist``: a reduced flash-attn build, sm90 and the kernels kvcore calls, in the background from
the start, under a time cap) → ``flash_real`` (the built flash-attn vs naive).

``--emulate`` runs the same stages on the CPU against tests/kernel_emulation.py (tests/e2e/test_gpu_check.py
runs it in the normal suite, so a change of a backend's plan or cache API breaks it there).

At most 8 files land in ``--out`` (default ``$OUT``, else /tmp/kvcore-gpu-check): one log per stage
(setup, xformers, flash_shim, conformance, nccl, flash_build, flash_real; flex writes into xformers') and
summary.txt.
Exit: 0 every stage passed or was skipped; 1 a stage failed or ran out of time; 3 nothing failed but a
backend was unavailable.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
EXIT = {"PASS": 0, "SKIP": 0, "UNAVAILABLE": 3, "FAIL": 1, "TIMEOUT": 1}
#: kvcore's runtime dependencies (pyproject.toml): reported in ``setup``, carried as wheels where missing
KVCORE_DEPS = ("torch", "pluggy", "numpy", "gguf", "tokenizers", "safetensors", "jinja2", "starlette", "uvicorn")
TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 2e-4}  # max |output - naive|
FLASH_BUILD_CAP_S = 330  # the background flash-attn build gives up after this long


@dataclass(frozen=True)
class Stage:
    name: str
    timeout_s: int
    log: str  # file under --out (stages may share one)


STAGES = (
    Stage("setup", 60, "setup.log"),
    Stage("xformers", 100, "xformers.log"),
    Stage("flash_shim", 70, "flash_shim.log"),
    Stage("flex", 150, "xformers.log"),  # one log with xformers: the tool brings back at most 8 files
    Stage("conformance", 170, "conformance.log"),
    Stage("nccl", 60, "nccl.log"),
    Stage("flash_real", 60, "flash_real.log"),
)
FILES = ("summary.txt", "flash_build.log", *dict.fromkeys(s.log for s in STAGES))


# -- the parent: lay out the tree, run every stage under its limit, print the table ----------------------
def source_tree(tmp: Path) -> Path:
    """A folder whose ``kvcore`` package is this working tree, laid out as pip would install it."""
    pkg = tmp / "tree" / "kvcore"
    pkg.mkdir(parents=True)
    for entry in (REPO / "kvcore").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "backends").symlink_to(REPO / "backends")
    (pkg / "conformance").symlink_to(REPO / "conformance")
    return pkg.parent


def unpack_wheels(wheels: Path, site: Path) -> list[str]:
    """Unpack every wheel in ``wheels`` into ``site`` (a wheel is a zip laid out for site-packages)."""
    names = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        names.append(wheel.name)
    return names


def run_stage(stage: Stage, out: Path, env: dict, emulate: bool) -> tuple[str, str, float]:
    """(status, detail, seconds) of one stage, run as ``--child NAME`` in its own process group."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", stage.name] + (["--emulate"] if emulate else [])
    start = time.monotonic()
    with open(out / stage.log, "a") as log:
        log.write(f"==== {stage.name} (limit {stage.timeout_s} s) ====\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            proc.wait(timeout=stage.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage and everything it started
            proc.wait()
            return "TIMEOUT", f"killed after {stage.timeout_s} s", time.monotonic() - start
    seconds = time.monotonic() - start
    lines = (out / stage.log).read_text(errors="replace").splitlines()
    results = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
    if not results:
        tail = next((line for line in reversed(lines) if line.strip()), "")
        return "FAIL", f"exit {proc.returncode} without a result: {tail[:160]}", seconds
    return results[-1]["status"], results[-1]["detail"], seconds


def start_flash_build(sdist: Path, tmp: Path, out: Path, env: dict) -> tuple[subprocess.Popen, Path]:
    """Start the reduced flash-attn build in the background; returns (process, its install folder)."""
    site = tmp / "flash-site"
    log = open(out / "flash_build.log", "w")  # noqa: SIM115 - the build outlives this function
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "flash_build"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env={**env, "GPU_CHECK_FLASH_SDIST": str(sdist), "GPU_CHECK_FLASH_SITE": str(site)})
    return proc, site


def finish_flash_build(proc: subprocess.Popen, started: float) -> tuple[str, str]:
    try:
        proc.wait(timeout=max(1.0, FLASH_BUILD_CAP_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "TIMEOUT", f"the build did not finish within {FLASH_BUILD_CAP_S} s"
    return ("PASS", "built and installed") if proc.returncode == 0 else ("FAIL", f"build exit {proc.returncode}")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", type=Path, help="folder of wheels to unpack onto PYTHONPATH (xformers, ...)")
    p.add_argument("--flash-sdist", type=Path, help="flash-attn 2.x sdist: build a reduced copy in the background")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/kvcore-gpu-check"))
    p.add_argument("--emulate", action="store_true", help="run on the CPU against the emulated kernels")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.child:
        return run_child(args.child, args.emulate)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        (out / name).unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvcore-gpu-check-"))
    paths = [str(source_tree(tmp))]
    wheels = unpack_wheels(args.wheels, tmp / "site") if args.wheels else []
    if wheels:
        paths.append(str(tmp / "site"))
    if args.emulate:
        paths.append(str(REPO / "tests"))  # kernel_emulation is a testing module
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPU_CHECK_WHEELS": " ".join(wheels),
           "PYTHONPATH": os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}

    started = time.monotonic()
    build = None
    if args.flash_sdist and not args.emulate:
        build, flash_site = start_flash_build(args.flash_sdist, tmp, out, env)
    rows = []
    for stage in STAGES:
        if stage.name == "flash_real":
            if build is None:
                rows.append(("flash_build", "SKIP", "no --flash-sdist" if not args.emulate else "not in --emulate",
                             0.0))
                rows.append(("flash_real", "SKIP", "no flash-attn build", 0.0))
                continue
            status, detail = finish_flash_build(build, started)
            rows.append(("flash_build", status, detail, time.monotonic() - started))
            if status != "PASS":
                rows.append(("flash_real", "SKIP", "the flash-attn build did not succeed", 0.0))
                continue
            env = {**env, "PYTHONPATH": os.pathsep.join([str(flash_site), env["PYTHONPATH"]])}
        status, detail, seconds = run_stage(stage, out, env, args.emulate)
        rows.append((stage.name, status, detail, seconds))
        print(f"{stage.name:<12} {status:<11} {seconds:6.1f} s  {detail}", flush=True)

    table = ["stage        status      seconds  detail"]
    table += [f"{n:<12} {s:<11} {t:7.1f}  {d}" for n, s, d, t in rows]
    total = f"total {time.monotonic() - started:.0f} s" + ("; EMULATED kernels on the CPU, not a GPU result"
                                                          if args.emulate else "")
    (out / "summary.txt").write_text("\n".join(table + [total]) + "\n")
    print("\n" + "\n".join(table + [total]))
    statuses = {s for _, s, _, _ in rows}
    return 1 if statuses & {"FAIL", "TIMEOUT"} else (3 if "UNAVAILABLE" in statuses else 0)


# -- the children: one function per stage -------------------------------------------------------------
def run_child(name: str, emulate: bool) -> int:
    try:
        status, detail = CHILDREN[name](emulate)
    except Exception as exc:  # a broken stage is a FAIL with its reason, never a silent pass
        import traceback

        traceback.print_exc()
        status, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    print("RESULT " + json.dumps({"status": status, "detail": detail}), flush=True)
    return EXIT[status]


def _device(emulate: bool):
    import torch

    return torch.device("cpu" if emulate else "cuda")


def stage_setup(emulate: bool) -> tuple[str, str]:
    import importlib.metadata as md
    import platform

    import torch

    print(f"python {platform.python_version()} ({platform.machine()}), torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}), wheels unpacked: {os.environ.get('GPU_CHECK_WHEELS') or 'none'}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            print(f"  cuda:{i} {torch.cuda.get_device_name(i)} sm{cc[0]}{cc[1]}")
        b = torch.backends.cuda
        print(f"torch SDPA kernels: flash={b.is_flash_attention_available()} "
              f"mem_efficient={b.mem_efficient_sdp_enabled()} cudnn={b.cudnn_sdp_enabled()}")
    else:
        print("no CUDA device")
    missing = []
    for dist in KVCORE_DEPS + ("xformers", "flash-attn", "triton"):
        try:
            print(f"  {dist:<12} {md.version(dist)}")
        except md.PackageNotFoundError:
            print(f"  {dist:<12} not installed")
            missing += [dist] if dist in KVCORE_DEPS else []
    import kvcore
    from kvcore.plugins.registry import PluginRegistry
    from kvcore.plugins.support import backend_rows

    where = Path(kvcore.__file__).resolve().parent
    print(f"kvcore {kvcore.__version__} from {where}")
    if where != REPO / "kvcore":
        return "FAIL", f"kvcore was imported from {where}, not from this working tree"
    importlib.import_module("kvcore.backends.xformers")
    importlib.import_module("kvcore.conformance.runner")
    cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    for row in backend_rows(PluginRegistry(load_entrypoints=False)):
        print(f"  backend {row['backend']:<12} {row['available']:<40} dtypes {row['dtypes']}")
    from kvcore.backends.flash_attn2 import FlashAttn2Backend
    from kvcore.backends.xformers import XFormersBackend

    if cc is not None:
        served = sorted(str(d).removeprefix("torch.") for d in XFormersBackend.capabilities.dtypes_on(cc))
        print(f"xformers dtypes served on sm{cc[0]}{cc[1]}: {', '.join(served)}")
    xf, fa = XFormersBackend.availability(), FlashAttn2Backend.availability()
    if missing:
        return "FAIL", f"kvcore's dependencies missing: {', '.join(missing)} (carry them as wheels)"
    return "PASS", f"kvcore from the working tree; xformers: {xf or 'available'}; flash_attn2: {fa or 'available'}"


# -- kernels vs naive ------------------------------------------------------------------------------------
STEPS = (  # (seq ids, new tokens each); a None entry frees sequence 1 and starts sequence 4 in its slot
    ([0, 1, 2, 3], [5, 1, 200, 3]),  # ragged fresh prefill
    ([0, 2], [40, 6]),  # continuing prefill
    ([3, 2, 1, 0], [1, 1, 1, 1]),  # decode, permuted slots
    None,
    ([4, 0], [7, 1]),  # mixed batch: a fresh prompt in a reused slot beside a one-token continuation
    *[([0, 2, 3, 4], [1, 1, 1, 1])] * 3,  # multi-step decode, non-consecutive slots
    ([0, 4], [1, 1]),  # decode on consecutive slots
)


def scenario(make_backend, kind, heads, kv_heads, head_dim, dtype, device) -> tuple[int, list[str], float]:
    """One (cache kind, heads, head_dim, dtype) case through :data:`STEPS`: (checks, failures, worst |err|)."""
    import torch

    from kvcore.backends.contiguous import ContiguousKVCache
    from kvcore.backends.naive import NaiveBackend
    from kvcore.interfaces.kv_cache import CacheSpec
    from kvcore.plugins.registry import get_registry
    from kvcore.scheduling.kv_manager import KVCacheManager

    name = str(dtype).removeprefix("torch.")
    spec = CacheSpec(2, kv_heads, head_dim, dtype, device, 6, 320)
    ref, ref_kv = NaiveBackend(), KVCacheManager(ContiguousKVCache(spec))
    backend, kv = make_backend(), KVCacheManager(get_registry().create_cache(kind, spec))
    gen = torch.Generator(device=device).manual_seed(0)
    checks, failures, worst = 0, [], 0.0
    for s in range(4):
        ref_kv.add_sequence(s), kv.add_sequence(s)
    for step in STEPS:
        if step is None:
            ref_kv.free_sequence(1), kv.free_sequence(1)
            ref_kv.add_sequence(4), kv.add_sequence(4)
            continue
        seq_ids, lens = step
        m_ref, m = ref_kv.prepare(seq_ids, lens, head_dim**-0.5), kv.prepare(seq_ids, lens, head_dim**-0.5)
        p_ref, p = ref.plan(m_ref, ref_kv.cache), backend.plan(m, kv.cache)
        t = sum(lens)
        for layer in range(2):
            q = torch.randn(t, heads, head_dim, device=device, generator=gen, dtype=dtype)
            k = torch.randn(t, kv_heads, head_dim, device=device, generator=gen, dtype=dtype)
            v = torch.randn(t, kv_heads, head_dim, device=device, generator=gen, dtype=dtype)
            want = ref.forward(layer, q, k, v, ref_kv.cache, p_ref).float()
            got = backend.forward(layer, q.clone(), k.clone(), v.clone(), kv.cache, p).float()
            err = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
            worst, checks = max(worst, err), checks + 1
            if not err <= TOLERANCE[name]:
                failures.append(f"{seq_ids} {lens} layer {layer}: max |err| {err:.3g} > {TOLERANCE[name]}")
    for s in ref_kv.blocks.seq_ids:
        for layer in range(2):
            if not all(torch.equal(a, b) for a, b in zip(kv.read(layer, s), ref_kv.read(layer, s))):
                failures.append(f"the cache of sequence {s}, layer {layer} differs from naive's")
    return checks, failures, worst


def compare(make_backend, kinds, dtypes, head_dims, device, ops: Counter | None = None,
            heads=((8, 8), (8, 2), (8, 1))):
    """:func:`scenario` on every (cache kind, ``heads`` (MHA/GQA/MQA), head_dim, dtype): (checks, failures, worst
    |err| per dtype, operators). ``ops`` is the counter the kernels record their operators in: printed per case,
    summed in the result."""
    import torch

    checks = failures = 0
    worst: dict[str, float] = {}
    operators: Counter = Counter()
    for kind, (num_heads, kv_heads), head_dim, dtype in itertools.product(kinds, heads, head_dims, dtypes):
        name = str(dtype).removeprefix("torch.")
        case = f"{kind} H={num_heads} H_kv={kv_heads} D={head_dim} {name}"
        n, failed, err = scenario(make_backend, kind, num_heads, kv_heads, head_dim, dtype, device)
        checks, failures, worst[name] = checks + n, failures + len(failed), max(worst.get(name, 0.0), err)
        for line in failed:
            print(f"FAIL {case}: {line}")
        print(f"done {case}: max |err| {err:.3g}" + (f", operators {dict(ops)}" if ops else ""))
        if ops is not None:
            operators.update(ops)
            ops.clear()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return checks, failures, worst, operators


def _verdict(checks: int, failures: int, worst: dict, operators: Counter, extra: str = "") -> tuple[str, str]:
    errs = ", ".join(f"{d} {e:.2g}" for d, e in worst.items())
    detail = f"{checks} output checks, {failures} failures, worst |err| {errs}{extra}"
    if operators:
        detail += f"; operators {dict(operators)}"
    return ("FAIL" if failures else "PASS"), detail


def xformers_kernels(emulate: bool, ops: Counter) -> SimpleNamespace:
    """The kernels the xformers backend calls, counting in ``ops`` the operator that served each call."""
    if emulate:
        from kernel_emulation import XFORMERS_KERNELS as base

        def operator(query, key, value, attn_bias, scale):
            return "emulated"
    else:
        from xformers.ops import fmha

        from kvcore.backends.xformers import _xformers_kernels

        base = _xformers_kernels()

        def operator(query, key, value, attn_bias, scale):
            inp = fmha.Inputs(query=query, key=key, value=value, attn_bias=attn_bias, p=0.0, scale=scale)
            return fmha.dispatch._dispatch_fw(inp, False).NAME

    def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
        ops[operator(query, key, value, attn_bias, scale)] += 1
        return base.memory_efficient_attention(query, key, value, attn_bias=attn_bias, p=p, scale=scale)

    return SimpleNamespace(
        memory_efficient_attention=memory_efficient_attention,
        BlockDiagonalCausalMask=base.BlockDiagonalCausalMask,
        BlockDiagonalCausalWithOffsetPaddedKeysMask=base.BlockDiagonalCausalWithOffsetPaddedKeysMask,
        BlockDiagonalCausalWithOffsetGappyKeysMask=base.BlockDiagonalCausalWithOffsetGappyKeysMask,
    )


def stage_xformers(emulate: bool) -> tuple[str, str]:
    import torch

    from kvcore.backends.xformers import XFormersBackend

    device, caps = _device(emulate), XFormersBackend.capabilities
    if emulate:
        dtypes, head_dims, refused = [torch.float32], (64,), []
    else:
        reason = XFormersBackend.availability()
        if reason:
            return "UNAVAILABLE", reason
        served = caps.dtypes_on(torch.cuda.get_device_capability())
        dtypes = [d for d in (torch.bfloat16, torch.float16, torch.float32) if d in served]
        refused = [d for d in caps.dtypes if d not in served]
        head_dims = (64, 128)
    ops: Counter = Counter()
    kernels = xformers_kernels(emulate, ops)
    checks, failures, worst, operators = compare(lambda: XFormersBackend(kernels=kernels), caps.kv_layouts, dtypes,
                                                 head_dims, device, ops)
    for d in refused:  # declared, but no operator on this GPU: must be refused with a reason
        reasons = XFormersBackend(kernels=kernels).validate(device=device, dtype=d, head_dim=64, num_heads=8,
                                                            num_kv_heads=2)
        print(f"{d} refused: {reasons}")
        failures += not any("not served" in r for r in reasons)
    return _verdict(checks, failures, worst, operators)


def torch_flash_kernels(varlen=None) -> SimpleNamespace:
    """flash-attn's two entry points over one varlen kernel: torch's own FlashAttention-2
    (``aten._flash_attention_forward``) by default. ``flash_attn_with_kvcache`` is composed from it: the
    in-place append at ``cache_seqlens`` of rows ``cache_batch_idx``, then each row's keys packed for varlen.
    A harness shim (it syncs to build the packing), never a kvcore fast path."""
    import torch

    from kvcore.interfaces.metadata import cu_seqlens

    if varlen is None:
        def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
            if softcap:
                raise NotImplementedError("torch's FlashAttention-2 kernel has no soft-cap argument")
            left, right = window_size
            window = {} if (left, right) == (-1, -1) else {"window_size_left": left, "window_size_right": right}
            return torch.ops.aten._flash_attention_forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal, False,
                scale=softmax_scale, **window,
            )[0]

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
        batch, seqlen_q, heads, head_dim = q.shape
        rows = torch.arange(batch, device=q.device) if cache_batch_idx is None else cache_batch_idx.long()
        before = cache_seqlens.long()
        new = 0 if k is None else k.shape[1]
        for j in range(new):  # the append flash-attn does in place
            k_cache[rows, before + j] = k[:, j]
            v_cache[rows, before + j] = v[:, j]
        lens = (before + new).tolist()
        row_of = torch.repeat_interleave(rows, torch.tensor(lens, device=q.device))
        pos = torch.cat([torch.arange(n, device=q.device) for n in lens])
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        out = varlen(q.reshape(batch * seqlen_q, heads, head_dim), k_cache[row_of, pos], v_cache[row_of, pos],
                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_seqlens(lens, q.device), max_seqlen_q=seqlen_q,
                     max_seqlen_k=max(lens), softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                     softcap=softcap)
        return out.view(q.shape)

    return SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=flash_attn_with_kvcache)


def stage_flash_shim(emulate: bool) -> tuple[str, str]:
    import torch

    from kvcore.backends.flash_attn2 import FlashAttn2Backend

    if emulate:
        from kernel_emulation import emulated_flash_attn_varlen_func

        kernels, dtypes, head_dims = torch_flash_kernels(emulated_flash_attn_varlen_func), [torch.float32], (64,)
    else:
        if not torch.backends.cuda.is_flash_attention_available() or torch.cuda.get_device_capability() < (8, 0):
            return "UNAVAILABLE", "this torch has no FlashAttention-2 kernel for this GPU"
        kernels, dtypes, head_dims = torch_flash_kernels(), [torch.bfloat16, torch.float16], (64, 128)
    result = compare(lambda: FlashAttn2Backend(kernels=kernels), FlashAttn2Backend.capabilities.kv_layouts, dtypes,
                     head_dims, _device(emulate))
    return _verdict(*result, "; kernel: " + ("emulated varlen" if emulate else "aten._flash_attention_forward"))


def stage_flex(emulate: bool) -> tuple[str, str]:
    """FlexAttention vs naive: eagerly on every case, then compiled (Triton kernels, one compile per shape bucket)
    on one GQA bfloat16 case per cache layout, which keeps the compiles within the stage's limit."""
    import torch

    from kvcore.backends.flex import FlexBackend

    device, layouts = _device(emulate), FlexBackend.capabilities.kv_layouts
    if emulate:  # the CPU's compiled path is the test suite's (tests/backends/test_flex_backend.py)
        return _verdict(*compare(lambda: FlexBackend(compile=False), layouts[1:], [torch.float32], (64,), device,
                                 heads=((8, 2),)), "; eager")
    reason = FlexBackend.availability()
    if reason:
        return "UNAVAILABLE", reason
    eager = _verdict(*compare(lambda: FlexBackend(compile=False), layouts,
                              [torch.bfloat16, torch.float16, torch.float32], (64, 128), device))
    compiled = _verdict(*compare(FlexBackend, layouts, [torch.bfloat16], (64,), device, heads=((8, 2),)))
    status = "FAIL" if "FAIL" in (eager[0], compiled[0]) else "PASS"
    return status, f"eager: {eager[1]}; compiled: {compiled[1]}"


# -- engine and conformance ---------------------------------------------------------------------------
CONFORMANCE_TARGETS = {"xformers": ["--backend", "xformers"], "sdpa": ["--backend", "sdpa"],
                       "paged": ["--backend", "paged"], "int8": ["--kv-cache", "int8"]}


def stage_conformance(emulate: bool) -> tuple[str, str]:
    import torch

    from kvcore import Engine, EngineConfig, SamplingParams
    from kvcore.conformance.models import get_model

    device = str(_device(emulate))
    model = get_model("tiny", torch.float32, device).model
    prompts, greedy = [[5, 9, 13, 17, 21], [7, 8], list(range(30, 70))], SamplingParams(max_new_tokens=8,
                                                                                        ignore_eos=True)
    configs = {"naive": {"backend": "naive"}, "sdpa": {"backend": "sdpa"}, "paged": {"backend": "paged"},
               "int8": {"backend": "paged", "kv_cache": "int8"}}
    if not emulate:
        configs["xformers"] = {"backend": "xformers"}
    streams, problems = {}, []
    for name, cfg in configs.items():
        try:
            engine = Engine(model, None, EngineConfig(device=device, max_model_len=128, **cfg))
            streams[name] = [r.token_ids for r in engine.generate(prompts, greedy)]
        except Exception as exc:
            problems.append(f"engine {name}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    # int8 is lossy: its greedy stream may leave naive's at a near-tie, which the conformance suite judges
    for name, ids in streams.items():
        if name not in ("naive", "int8") and ids != streams.get("naive"):
            problems.append(f"engine {name}: greedy streams differ from naive's")
    print(f"engine greedy streams: {sorted(streams)}; problems: {problems or 'none'}")
    targets = {"sdpa": CONFORMANCE_TARGETS["sdpa"]} if emulate else CONFORMANCE_TARGETS
    base = [sys.executable, "-m", "kvcore.cli", "conformance", "--device", device, "--quick", "--model", "tiny",
            "--no-progress"] + (["--tier", "op", "--dtype", "float32"] if emulate else [])
    procs = {n: subprocess.Popen(base + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n, args in targets.items()}  # side by side: the GPU has room, the stage has one limit
    codes = {}
    for name, proc in procs.items():
        text, _ = proc.communicate()
        codes[name] = proc.returncode
        print(f"---- kvcore conformance {' '.join(targets[name])} (exit {proc.returncode})\n{text.rstrip()}")
    verdicts = {0: "pass", 1: "FAIL", 2: "ERROR", 3: "unavailable"}
    detail = ", ".join(f"{n} {verdicts.get(c, f'exit {c}')}" for n, c in codes.items())
    failed = problems or any(c in (1, 2) or c not in verdicts for c in codes.values())
    status = "FAIL" if failed else ("UNAVAILABLE" if 3 in codes.values() else "PASS")
    return status, f"engine {len(streams)}/{len(configs)} ok; conformance {detail}" + (
        f"; {problems[0]}" if problems else "")


# -- NCCL ------------------------------------------------------------------------------------------------
def stage_nccl(emulate: bool) -> tuple[str, str]:
    import torch

    from kvcore.execution.distributed.parallel_state import Endpoint, RankGroup

    device = _device(emulate)
    store, endpoint = RankGroup.open_store(Endpoint("tcp", 1, device_type=device.type), 0)
    group = RankGroup.connect(endpoint, 0, store)
    x = torch.arange(8, dtype=torch.float32, device=device)
    summed = group.all_reduce(x.clone())
    ok = torch.equal(summed.cpu(), x.cpu())  # one rank: the sum is the tensor itself
    group.abort()
    print(f"one-rank {'NCCL' if device.type == 'cuda' else 'gloo'} all-reduce: {'ok' if ok else 'WRONG'}")
    # more ranks than the machine has GPUs (CPU: more ranks than KV heads) must be refused in one line
    size = torch.cuda.device_count() + 1 if device.type == "cuda" else 3
    cmd = [sys.executable, "-m", "kvcore.cli", "generate", "--model", str(REPO / "tests/data/tiny-llama"),
           "--device", device.type, "--tensor-parallel-size", str(size), "--max-new-tokens", "1", "Hello"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=40)
    err = run.stderr.strip().splitlines()
    print(f"tensor parallel {size}: exit {run.returncode}, stderr {err}")
    refused = run.returncode == 2 and len(err) == 1 and "tensor_parallel_size" in err[0]
    status = "PASS" if ok and refused else "FAIL"
    return status, f"one-rank all-reduce {'ok' if ok else 'wrong'}; TP={size}: " + (err[-1] if err else "no error")


# -- flash-attn: reduced build, then the real kernels ----------------------------------------------------
FLASH_DISABLE = ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K", "LOCAL")  # flash-attn's own switches


def reduce_flash_sources(root: Path) -> int:
    """Patch an unpacked flash-attn 2.x sdist to build only what kvcore calls: the forward kernels (plain
    and split-KV, which flash_attn_with_kvcache uses) for head_dim 64 and 128 in fp16/bf16, with the
    library's own FLASHATTENTION_DISABLE_* switches on. Returns the number of kernel files dropped."""
    import re

    setup = root / "setup.py"
    text = setup.read_text()
    kernels = re.compile(r'\n\s*"csrc/flash_attn/src/flash_(?:bwd|fwd|fwd_split)_hdim\d+_\w+\.cu",')
    keep = re.compile(r"flash_fwd(_split)?_hdim(64|128)_(fp16|bf16)(_causal)?_sm80\.cu")
    before = len(kernels.findall(text))
    text = kernels.sub(lambda m: m.group(0) if keep.search(m.group(0)) else "", text)
    dropped = before - len(kernels.findall(text))
    flags = ", ".join(f'"-DFLASHATTENTION_DISABLE_{f}"' for f in FLASH_DISABLE)
    text = text.replace('compiler_c17_flag=["-O3", "-std=c++17"]', f'compiler_c17_flag=["-O3", "-std=c++17", {flags}]')
    text = text.replace('"--use_fast_math",', f'"--use_fast_math", {flags},', 1)
    setup.write_text(text)
    switch = root / "csrc/flash_attn/src/static_switch.h"
    # every head size is routed to 64 or 128, so the switch instantiates only what was built (the check
    # runs 64 and 128 alone)
    header, n = re.subn(
        r"(#define HEADDIM_SWITCH\(HEADDIM, \.\.\.\)\s*\\\n\s*\[&\] \{).*?(\n\s*\}\(\))",
        r"\1 \\\n    if (HEADDIM <= 64) { constexpr static int kHeadDim = 64; return __VA_ARGS__(); } \\\n"
        r"    else { constexpr static int kHeadDim = 128; return __VA_ARGS__(); } \\\2",
        switch.read_text(), flags=re.S)
    switch.write_text(header)
    api = root / "csrc/flash_attn/flash_api.cpp"
    source, m = re.subn(r"(void run_mha_bwd\(Flash_bwd_params &params, cudaStream_t stream\) \{).*?\n\}\n",
                        r'\1\n    TORCH_CHECK(false, "this flash-attn build has no backward kernels");\n}\n',
                        api.read_text(), count=1, flags=re.S)
    api.write_text(source)
    if n != 1 or m != 1 or dropped <= 0:
        raise RuntimeError(f"this flash-attn sdist does not have the expected layout ({n}, {m}, {dropped})")
    return dropped


def stage_flash_build(emulate: bool) -> tuple[str, str]:
    """Build flash-attn from GPU_CHECK_FLASH_SDIST, reduced (:func:`reduce_flash_sources`) and for sm90 only,
    into GPU_CHECK_FLASH_SITE."""
    import tarfile

    sdist, site = Path(os.environ["GPU_CHECK_FLASH_SDIST"]), Path(os.environ["GPU_CHECK_FLASH_SITE"])
    src = site.parent / "flash-src"
    with tarfile.open(sdist) as tar:
        tar.extractall(src, filter="data")
    root = next(src.iterdir())
    dropped = reduce_flash_sources(root)
    print(f"dropped {dropped} kernel files; building {root.name} for sm90", flush=True)
    env = {**os.environ, "FLASH_ATTENTION_FORCE_BUILD": "TRUE", "FLASH_ATTN_CUDA_ARCHS": "90", "MAX_JOBS": "14",
           "NVCC_THREADS": "1"}  # one arch: parallel files, not parallel nvcc passes
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--target",
           str(site), str(root)]
    code = subprocess.run(cmd, env=env, cwd=root).returncode
    return ("PASS", "built") if code == 0 else ("FAIL", f"pip exit {code}")


def stage_flash_real(emulate: bool) -> tuple[str, str]:
    import torch

    from kvcore.backends.flash_attn2 import FlashAttn2Backend

    reason = FlashAttn2Backend.availability()
    if reason:
        return "UNAVAILABLE", reason
    result = compare(FlashAttn2Backend, FlashAttn2Backend.capabilities.kv_layouts, [torch.bfloat16, torch.float16],
                     (64, 128), _device(emulate))
    return _verdict(*result, "; kernel: flash_attn_2_cuda")


CHILDREN = {"setup": stage_setup, "xformers": stage_xformers, "flash_shim": stage_flash_shim, "flex": stage_flex,
            "conformance": stage_conformance, "nccl": stage_nccl, "flash_build": stage_flash_build,
            "flash_real": stage_flash_real}

if __name__ == "__main__":
    sys.exit(main())
