"""``kvcore conformance``: the release gate for an attention backend.

Exit codes: 0 every case that ran passed; 1 something failed, or the thing under test is broken (its
module raised at import, its ``availability()`` or constructor raised: a traceback summary is printed);
2 usage or configuration error (bad flag, unknown backend, cache, sampler or dtype, bad options, a model
that cannot be loaded: leave it out with ``--model``); 3 the backend is unavailable here (its
``availability()`` returned a reason), or every case was skipped; 130 interrupted (Ctrl-C) during the cases:
the report of the cases that finished is still printed or written.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from kvcore.conformance.limits import DEFAULT_CASE_TIMEOUT
from kvcore.errors import KVCoreError

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "conformance",
        help="check an attention backend against the reference (the release gate)",
        description="Run the conformance suite against one backend: op-level attention vs the reference, "
        "cache consistency, greedy token streams and seeded sampling. Exit 0 pass, 1 fail, 2 usage error, "
        "3 backend unavailable.",
    )
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="registered backend name (see `kvcore backends`) or package.module:ClassName; optional "
                   "with --kv-cache (a backend that reads the cache's layout is chosen)")
    p.add_argument("--backend-option", action="append", default=None, metavar="KEY=VALUE",
                   help="constructor option for the backend (as in [backends.NAME]); VALUE is parsed as JSON "
                   "when it can be, e.g. --backend-option block_size=8; repeatable")
    p.add_argument("--kv-cache", default=None, metavar="NAME",
                   help="certify this KV cache (see `kvcore plugins`): every tier runs over it; a lossy cache is "
                   "held to the tolerances its declared precision implies")
    p.add_argument("--kv-cache-option", action="append", default=None, metavar="KEY=VALUE",
                   help="constructor option for the KV cache (as in [kv_caches.NAME]); repeatable")
    p.add_argument("--sampler", default=None, metavar="NAME",
                   help="certify this sampler: the sampling tier checks its draws against kvcore's reference and "
                   "the streams run through it; alone, only the tier that judges a sampler runs (sampling)")
    p.add_argument("--sampler-option", action="append", default=None, metavar="KEY=VALUE",
                   help="constructor option for the sampler (as in [samplers.NAME]); repeatable")
    p.add_argument("--proposer", default=None, metavar="NAME",
                   help="certify this speculative-decoding proposer: every stream with its drafts must equal the "
                   "stream without; alone, only the speculative tier runs (on the best available backend)")
    p.add_argument("--attention-variant", dest="attention_variants", action="append", default=None, metavar="NAME",
                   help="run with this registered attention variant (see `kvcore plugins`) selected: op cases whose "
                   "layers carry it, and every engine of the stream and sampling tiers attending with it; repeatable")
    p.add_argument("--quick", action="store_true", help="CI-sized case set (under 2 minutes on 2 CPU cores)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="the report as JSON: on stdout, or written atomically to FILE (the text report then goes to "
                   "stdout); a run stopped with Ctrl-C still writes the cases that finished (exit 130)")
    p.add_argument("--report", metavar="FILE.md", default=None, help="also write a Markdown report to FILE.md")
    p.add_argument("--dtype", default=None,
                   help="certify only this dtype: float32, bfloat16 or float16 (default: float32 and every reduced "
                   "precision, cases in undeclared dtypes skipped)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--model", action="append", default=None, metavar="SPEC",
                   help="model for the model-level tiers: 'tiny' (in-memory random Llama), 'smollm2', a .gguf "
                   "file or a Hugging Face directory; repeat or comma-separate (default: tiny,smollm2)")
    p.add_argument("--tier", action="append", default=None, metavar="TIER",
                   help="run only these tiers: op, cache, stream, sampling, speculative (repeat or comma-separate)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="run the engine-level tiers (stream, sampling) on N tensor-parallel ranks against the "
                   "one-rank reference; the op and cache tiers check the backend in one process")
    p.add_argument("--seed", type=int, default=0,
                   help="base of the seeds the sampler oracle draws with (default 0): runs are reproducible; "
                   "another seed is another independent trial of the statistical checks")
    p.add_argument("--case-timeout", type=float, default=DEFAULT_CASE_TIMEOUT, metavar="SECONDS",
                   help=f"fail a case still running after SECONDS (checked between engine steps; default "
                   f"{DEFAULT_CASE_TIMEOUT:g}, 0 = no limit) and go on with the next; an engine run also fails "
                   "past 4 steps per token it asks for: a plugin that makes the engine loop fails its case")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: fastest on a shared 2-core machine; 0 = torch's default)")
    p.add_argument("--verbose", "-v", action="store_true", help="list every case and failure tracebacks")
    p.add_argument("--no-progress", action="store_true", help="do not print per-case progress on stderr")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def _split(values: list[str] | None) -> tuple[str, ...] | None:
    if not values:
        return None
    return tuple(v.strip() for item in values for v in item.split(",") if v.strip())


def _options(values: list[str] | None, flag: str = "--backend-option") -> dict:
    from kvcore.conformance.target import parse_options

    return parse_options(values, flag)


def _error(message: str) -> int:
    from kvcore.conformance.results import EXIT_USAGE

    print(f"kvcore conformance: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcore.conformance.models import model_problem
    from kvcore.conformance.report import to_json, to_markdown, to_text, write_json
    from kvcore.conformance.results import EXIT_FAIL
    from kvcore.conformance.runner import prepare_kernels, run_suite, stderr_notice, stderr_progress
    from kvcore.conformance.settings import DEFAULT_MODELS, PROPOSER_TIERS, SAMPLER_TIERS, TIERS, SuiteConfig
    from kvcore.conformance.target import BrokenTargetError, resolve_target

    if args.threads < 0:
        return _error(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    sampler_only = args.sampler is not None and args.backend is None and args.kv_cache is None
    proposer_only = args.proposer is not None and args.backend is None and args.kv_cache is None
    default_tiers = PROPOSER_TIERS if proposer_only else SAMPLER_TIERS if sampler_only else TIERS
    try:
        cfg = SuiteConfig(
            dtype=args.dtype,
            device=args.device,
            quick=args.quick,
            models=_split(args.model) or DEFAULT_MODELS,
            tiers=_split(args.tier) or default_tiers,
            tensor_parallel_size=args.tensor_parallel_size,
            seed=args.seed,
            case_timeout=args.case_timeout or None,
            attention_variants=tuple(args.attention_variants or ()),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if args.backend is None and args.kv_cache is None and args.sampler is None and args.proposer is None:
                return _error("give --backend, --kv-cache, --sampler or --proposer: what to certify")
            target = resolve_target(
                args.backend,
                options=_options(args.backend_option),
                kv_cache=args.kv_cache,
                kv_cache_options=_options(args.kv_cache_option, "--kv-cache-option"),
                sampler=args.sampler,
                sampler_options=_options(args.sampler_option, "--sampler-option"),
                proposer=args.proposer,
            )
            for name in cfg.attention_variants:  # an unknown name is a usage error, with a suggestion
                target.registry.create_variant(name)
            try:
                if target.availability() is None:
                    prepare_kernels(cfg, stderr_notice)  # announced here: constructors may load them
                    target.preflight()  # bad options fail here, as a usage error
            except BrokenTargetError:
                pass  # run_suite reports it as a failure, in every output format
        named = [n for n in (args.backend, args.kv_cache, args.sampler, args.proposer) if n]
        for w in caught:
            if "kvcore:" in str(w.message) and any(n in str(w.message) for n in named):
                print(f"warning: {w.message}", file=sys.stderr)
    except BrokenTargetError as exc:  # the module under test raised at import
        print(f"kvcore conformance: FAIL: {exc}", file=sys.stderr)
        if exc.summary:
            print("  " + exc.summary.replace("\n", "\n  "), file=sys.stderr)
        return EXIT_FAIL
    except KVCoreError as exc:
        return _error(str(exc))
    try:
        torch.empty(0, device=cfg.torch_device)
    except (RuntimeError, AssertionError) as exc:
        return _error(f"device '{cfg.device}' is not usable here: {str(exc).splitlines()[0]}")
    if set(cfg.tiers) - {"op"}:
        for spec in cfg.models:
            problem = model_problem(spec, cfg.dtype, cfg.device)
            if problem:
                return _error(f"{problem}; leave it out with --model (e.g. --model tiny)")

    if proposer_only and not args.tier:
        print(f"kvcore conformance: proposer only: running the speculative tier on backend '{target.name}'",
              file=sys.stderr)
    if sampler_only and not args.tier:
        print(f"kvcore conformance: sampler only: running the tiers that judge a sampler ({', '.join(SAMPLER_TIERS)})",
              file=sys.stderr)
    progress = None if args.no_progress else stderr_progress
    report = run_suite(target, cfg, progress=progress, notice=stderr_notice)
    if args.report:
        try:
            Path(args.report).write_text(to_markdown(report), encoding="utf-8")
        except OSError as exc:
            return _error(f"cannot write report '{args.report}': {exc.strerror or exc}")
    if args.json and args.json != "-":
        try:
            write_json(report, args.json)
        except OSError as exc:
            return _error(f"cannot write JSON report '{args.json}': {exc.strerror or exc}")
    text = to_json(report) if args.json == "-" else to_text(report, verbose=args.verbose)
    sys.stdout.write(text + "\n")  # one write: a redirected file holds the whole report or nothing
    sys.stdout.flush()
    return report.exit_code
