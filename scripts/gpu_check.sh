#!/usr/bin/env bash
# Check kvcore's CUDA-only attention backends (flash_attn2, xformers) on a machine with an NVIDIA GPU.
#
#   scripts/gpu_check.sh [--backends "flash_attn2 xformers"] [--dtype bfloat16] [--quick]
#                        [--wheels DIR] [--out DIR] [--skip-conformance] [--skip-pytest] [--emulate]
#                        [--tp-size N] [--skip-tp]
#
# Installs nothing unless --wheels DIR is given (then: pip install --no-index --no-deps DIR/*.whl, for
# machines without network; see docs/gpu-backends.md for making DIR with `pip download`). kvcore itself
# must be importable (pip install --no-deps -e . from the repo root).
#
# Steps: (1) environment report: nvidia-smi, python, torch, CUDA, GPU, package versions;
#        (2) `kvcore backends`;
#        (3) per backend: `kvcore conformance --backend NAME --dtype D --device cuda --json --report ...`
#            (exit codes 0 pass, 1 fail, 3 unavailable);
#        (4) pytest tests/test_gpu_backends_emulated.py (the glue vs naive with emulated kernels);
#        (5) per backend: the REAL kernels vs the naive oracle on CUDA (ragged prefill, continuing
#            prefill, permuted-slot decode, multi-step decode; MHA/GQA/MQA; head_dim 64/128; both cache
#            kinds), outputs within tolerance and cache contents identical;
#        (6) tensor parallelism over NCCL (needs --tp-size GPUs, default 2): `kvcore generate
#            --tensor-parallel-size N --device cuda` gives the one-GPU greedy ids (naive, sdpa, paged);
#            `kvcore conformance --tensor-parallel-size N` (stream tier); a worker killed mid-generation
#            ends the CLI with exit 7 and leaves no worker process;
#        then a summary table.
# --emulate: a dry run of step (5) on the CPU with kvcore's emulated kernels (checks this script, not a GPU).
# Exit: 0 everything ran and passed; 1 something failed; 3 nothing failed but a backend was unavailable.
# Environment: PYTHON (default python3), OUT (default /tmp/kvcore-gpu-check; at most 16 files are written).
set -u -o pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BACKENDS="flash_attn2 xformers"
DTYPE=bfloat16
QUICK=""
WHEELS=""
OUT=${OUT:-/tmp/kvcore-gpu-check}
RUN_CONFORMANCE=1
RUN_PYTEST=1
EMULATE=0
TP_SIZE=2
RUN_TP=1

while [ $# -gt 0 ]; do
    case "$1" in
        --backends) BACKENDS=$2; shift 2 ;;
        --dtype) DTYPE=$2; shift 2 ;;
        --quick) QUICK=--quick; shift ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --skip-conformance) RUN_CONFORMANCE=0; shift ;;
        --skip-pytest) RUN_PYTEST=0; shift ;;
        --emulate) EMULATE=1; shift ;;
        --tp-size) TP_SIZE=$2; shift 2 ;;
        --skip-tp) RUN_TP=0; shift ;;
        -h | --help) sed -n '2,29p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"

SUMMARY=()
FAILED=0
UNAVAILABLE=0
record() { # record NAME CHECK STATUS [DETAIL]
    SUMMARY+=("$(printf '%-12s %-34s %-12s %s' "$1" "$2" "$3" "${4:-}")")
    case "$3" in
        FAIL | ERROR) FAILED=1 ;;
        UNAVAILABLE) UNAVAILABLE=1 ;;
    esac
}
section() { printf '\n==== %s ====\n' "$*"; }

# -- optional offline install -------------------------------------------------------------------------
if [ -n "$WHEELS" ]; then
    section "installing wheels from $WHEELS (--no-index --no-deps)"
    if "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl; then
        record all "install wheels" PASS "$WHEELS"
    else
        record all "install wheels" FAIL "$WHEELS"
    fi
fi

# -- (1) environment ------------------------------------------------------------------------------------
section "environment"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || nvidia-smi
else
    echo "nvidia-smi: not found"
fi
"$PY" - <<'EOF'
import importlib.metadata as md
import platform

print(f"python      {platform.python_version()} ({platform.machine()})")
try:
    import torch
except Exception as exc:
    raise SystemExit(f"torch: cannot import ({exc})")
print(f"torch       {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
print(f"cuda        available={torch.cuda.is_available()} devices={torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    cc = torch.cuda.get_device_capability(i)
    print(f"  [{i}] {torch.cuda.get_device_name(i)} sm{cc[0]}{cc[1]}")
for dist in ("kvcore", "flash-attn", "xformers", "triton"):
    try:
        print(f"{dist:<11} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist:<11} not installed")
EOF
if ! "$PY" -c "import kvcore.backends.naive" 2>/dev/null; then
    echo "gpu_check: kvcore is not importable; from the repo root run: $PY -m pip install --no-deps -e ." >&2
    exit 2
fi

# -- (2) kvcore backends ------------------------------------------------------------------------------
section "kvcore backends"
if "$PY" -m kvcore.cli backends; then record all "kvcore backends" PASS; else record all "kvcore backends" FAIL; fi

availability() { # prints the backend's availability reason, or nothing when it can run
    "$PY" - "$1" <<'EOF'
import sys

from kvcore.plugins.registry import BackendRegistry

entry = BackendRegistry(load_entrypoints=False).backends.get(sys.argv[1])
print("not registered" if entry is None else (entry.availability() or ""))
EOF
}

CUDA_OK=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# -- (3) conformance ------------------------------------------------------------------------------------
if [ "$RUN_CONFORMANCE" = 1 ] && [ "$CUDA_OK" != 1 ]; then
    record all "conformance $DTYPE" UNAVAILABLE "no CUDA device (torch.cuda.is_available() is False)"
elif [ "$RUN_CONFORMANCE" = 1 ]; then
    for b in $BACKENDS; do
        section "conformance: $b ($DTYPE)"
        "$PY" -m kvcore.cli conformance --backend "$b" --dtype "$DTYPE" --device cuda --json $QUICK \
            --report "$OUT/conformance-$b.md" >"$OUT/conformance-$b.json" 2>"$OUT/.stderr"
        rc=$?
        { echo "== $b (exit $rc)"; cat "$OUT/.stderr"; } >>"$OUT/conformance-stderr.log"
        tail -n 5 "$OUT/conformance-$b.json" "$OUT/.stderr" 2>/dev/null
        case $rc in
            0) record "$b" "conformance $DTYPE" PASS "$OUT/conformance-$b.md" ;;
            1) record "$b" "conformance $DTYPE" FAIL "$OUT/conformance-$b.md" ;;
            3) record "$b" "conformance $DTYPE" UNAVAILABLE "$(availability "$b")" ;;
            *)
                if grep -q "invalid choice: 'conformance'" "$OUT/.stderr"; then
                    record "$b" "conformance $DTYPE" ERROR "this kvcore has no 'conformance' command"
                else
                    record "$b" "conformance $DTYPE" ERROR "exit $rc, see $OUT/conformance-stderr.log"
                fi
                ;;
        esac
    done
fi

# -- (4) emulated-kernel tests ------------------------------------------------------------------------
if [ "$RUN_PYTEST" = 1 ]; then
    section "pytest tests/test_gpu_backends_emulated.py"
    if "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_backends_emulated.py 2>&1 | tee "$OUT/pytest-emulated.log"; then
        record all "pytest (emulated kernels)" PASS
    else
        record all "pytest (emulated kernels)" FAIL "$OUT/pytest-emulated.log"
    fi
fi

# -- (5) real kernels vs naive on CUDA ----------------------------------------------------------------
CHECK5="real kernel vs naive"
if [ "$EMULATE" = 1 ]; then CHECK5="EMULATED kernel vs naive (dry run)"; fi
for b in $BACKENDS; do
    section "real kernels vs naive: $b"
    reason=$(availability "$b")
    if [ "$EMULATE" = 1 ]; then
        reason=""
    fi
    if [ -n "$reason" ]; then
        echo "unavailable: $reason"
        record "$b" "$CHECK5" UNAVAILABLE "$reason"
        continue
    fi
    KVCORE_GPU_CHECK_EMULATE=$EMULATE "$PY" - "$b" <<'EOF' 2>&1 | tee "$OUT/real-vs-naive-$b.log"
import os
import sys

import torch

from kvcore.backends.flash_attn2 import FlashAttn2Backend
from kvcore.backends.naive import NaiveBackend
from kvcore.backends.xformers import XFormersBackend
from kvcore.interfaces.kv_cache import CacheSpec, ContiguousKVCache, create_cache

name = sys.argv[1]
cls = {"flash_attn2": FlashAttn2Backend, "xformers": XFormersBackend}[name]
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4}
dtypes = [torch.bfloat16, torch.float16] + ([torch.float32] if torch.float32 in cls.capabilities.dtypes else [])
head_dims = (64, 128)
dev, make = torch.device("cuda"), cls
if os.environ.get("KVCORE_GPU_CHECK_EMULATE") == "1":  # dry run on CPU with the emulated kernels
    sys.path.insert(0, "tests")  # the emulations are a testing module, not part of the kvcore package
    import kernel_emulation

    kernels = kernel_emulation.FLASH_KERNELS if name == "flash_attn2" else kernel_emulation.XFORMERS_KERNELS
    dev, make, dtypes, head_dims = torch.device("cpu"), lambda: cls(kernels=kernels), [torch.bfloat16], (64,)
    print("EMULATED kernels on CPU: a dry run of this check, not a GPU result")
failures = checks = 0
worst = 0.0


def scenario(kind, heads, kv_heads, head_dim, dtype):
    global failures, checks, worst
    spec = CacheSpec(2, kv_heads, head_dim, dtype, dev, 6, 320)
    ref, ref_cache = NaiveBackend(), ContiguousKVCache(spec)
    backend, cache = make(), create_cache(kind, spec)
    gen = torch.Generator(device=dev).manual_seed(0)

    def step(seq_ids, lens):
        global failures, checks, worst
        m_ref, m = ref_cache.prepare(seq_ids, lens, head_dim**-0.5), cache.prepare(seq_ids, lens, head_dim**-0.5)
        t = sum(lens)
        for layer in range(2):
            q = torch.randn(t, heads, head_dim, device=dev, generator=gen, dtype=dtype)
            k = torch.randn(t, kv_heads, head_dim, device=dev, generator=gen, dtype=dtype)
            v = torch.randn(t, kv_heads, head_dim, device=dev, generator=gen, dtype=dtype)
            want = ref.forward(layer, q, k, v, ref_cache, m_ref).float()
            got = backend.forward(layer, q.clone(), k.clone(), v.clone(), cache, m).float()
            err = (got - want).abs().max().item()
            worst = max(worst, err)
            checks += 1
            if not (got.shape == want.shape and err <= TOL[dtype]):
                failures += 1
                print(f"FAIL {kind} H={heads} H_kv={kv_heads} D={head_dim} {dtype} {seq_ids} {lens} layer {layer}: "
                      f"max |err| {err:.3g} > {TOL[dtype]}")

    for s in range(4):
        ref_cache.add_sequence(s), cache.add_sequence(s)
    step([0, 1, 2, 3], [5, 1, 200, 3])  # ragged fresh prefill
    step([0, 2], [40, 6])  # continuing prefill
    step([3, 2, 1, 0], [1, 1, 1, 1])  # decode, permuted slots
    ref_cache.free_sequence(1), cache.free_sequence(1)
    ref_cache.add_sequence(4), cache.add_sequence(4)
    step([4, 0], [7, 1])  # mixed batch
    for _ in range(3):
        step([0, 2, 3, 4], [1, 1, 1, 1])  # multi-step decode
    step([0, 4], [1, 1])  # consecutive slots
    for s in ref_cache.seq_ids:
        for layer in range(2):
            if not all(torch.equal(a, b) for a, b in zip(cache.read(layer, s), ref_cache.read(layer, s))):
                failures += 1
                print(f"FAIL {kind} H={heads} H_kv={kv_heads} D={head_dim} {dtype}: cache of seq {s} layer {layer} differs")


for kind in cls.capabilities.cache_kinds:
    for heads, kv_heads in [(8, 8), (8, 2), (8, 1)]:
        for head_dim in head_dims:
            for dtype in dtypes:
                scenario(kind, heads, kv_heads, head_dim, dtype)
if dev.type == "cuda":
    torch.cuda.synchronize()
print(f"{name}: {checks} output checks, {failures} failures, worst max |err| {worst:.3g}")
sys.exit(1 if failures else 0)
EOF
    if [ $? -eq 0 ]; then
        record "$b" "$CHECK5" PASS "$(tail -n 1 "$OUT/real-vs-naive-$b.log")"
    else
        record "$b" "$CHECK5" FAIL "$OUT/real-vs-naive-$b.log"
    fi
done

# -- (6) tensor parallelism over NCCL -------------------------------------------------------------------
NUM_GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$RUN_TP" = 1 ] && [ "$NUM_GPUS" -lt "$TP_SIZE" ]; then
    record nccl "tensor parallel x$TP_SIZE" UNAVAILABLE "$NUM_GPUS GPU(s) visible, --tp-size $TP_SIZE needs $TP_SIZE"
elif [ "$RUN_TP" = 1 ]; then
    TP_PROMPT="The history of the printing press begins"
    for b in naive sdpa paged; do
        section "tensor parallel x$TP_SIZE (NCCL): $b"
        for n in 1 "$TP_SIZE"; do
            "$PY" -m kvcore.cli generate --device cuda --dtype float32 --backend "$b" --tensor-parallel-size "$n" \
                --max-new-tokens 32 --ignore-eos --json "$TP_PROMPT" >"$OUT/tp-$b-$n.out" 2>>"$OUT/tp.log"
        done
        if "$PY" - "$OUT/tp-$b-1.out" "$OUT/tp-$b-$TP_SIZE.out" <<'EOF'
import json
import sys

one, many = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:])
print("1 GPU: ", one["token_ids"])
print("N GPUs:", many["token_ids"])
print(many.get("tensor_parallel"))
sys.exit(0 if one["token_ids"] == many["token_ids"] else 1)
EOF
        then
            record "$b" "tensor parallel x$TP_SIZE ids" PASS
        else
            record "$b" "tensor parallel x$TP_SIZE ids" FAIL "$OUT/tp.log"
        fi
    done
    section "conformance --tensor-parallel-size $TP_SIZE (stream tier, NCCL)"
    if "$PY" -m kvcore.cli conformance --backend sdpa --device cuda --tier stream --quick \
        --tensor-parallel-size "$TP_SIZE" >"$OUT/tp-conformance.txt" 2>>"$OUT/tp.log"; then
        record sdpa "conformance tensor parallel" PASS
    else
        record sdpa "conformance tensor parallel" FAIL "$OUT/tp-conformance.txt"
    fi
    section "tensor parallel x$TP_SIZE: a worker killed mid-generation"
    if KVCORE_TP_TIMEOUT_S=20 "$PY" - "$PY" "$TP_SIZE" <<'EOF' 2>&1 | tee -a "$OUT/tp.log"
import os
import signal
import subprocess
import sys
import time

import psutil

py, n = sys.argv[1], sys.argv[2]
cli = subprocess.Popen([py, "-m", "kvcore.cli", "generate", "--device", "cuda", "--tensor-parallel-size", n,
                        "--max-new-tokens", "2000", "--ignore-eos", "Once upon a time"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
cli.stdout.read(1)
procs = psutil.Process(cli.pid).children(recursive=True)
workers = [p for p in procs if "spawn_main" in " ".join(p.cmdline())]
os.kill(workers[0].pid, signal.SIGKILL)
start = time.monotonic()
_, err = cli.communicate(timeout=120)
time.sleep(2)
left = [p.pid for p in procs if psutil.pid_exists(p.pid) and psutil.Process(p.pid).status() != "zombie"]
print(f"exit {cli.returncode} after {time.monotonic() - start:.1f} s; stderr: {err.decode().strip()}; left: {left}")
sys.exit(0 if cli.returncode == 7 and not left else 1)
EOF
    then
        record nccl "tensor parallel: killed worker" PASS
    else
        record nccl "tensor parallel: killed worker" FAIL "$OUT/tp.log"
    fi
fi

rm -f "$OUT/.stderr"

# -- summary --------------------------------------------------------------------------------------------
section "summary"
printf '%-12s %-34s %-12s %s\n' backend check status detail
for line in "${SUMMARY[@]}"; do echo "$line"; done
if [ "$FAILED" = 1 ]; then exit 1; fi
if [ "$UNAVAILABLE" = 1 ]; then exit 3; fi
exit 0
