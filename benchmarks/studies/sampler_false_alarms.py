"""False-alarm rate of the conformance suite's sampler oracle: the oracle cases of a correct sampler, run
with many independent seeds (``SuiteConfig.seed``), and how often a run fails.

Each seed is one full run of the ``oracle-*`` cases (kvcore conformance --sampler NAME --seed S --tier
sampling runs the same cases). Also reports how the chi-square p-values of all runs are spread: for a
calibrated test about 5% fall under 0.05 and 1% under 0.01. Run from the repository root:

    python benchmarks/studies/sampler_false_alarms.py --sampler default --seeds 200
"""

from __future__ import annotations

import argparse
import time

import torch

from kvcore.conformance.runner import run_case
from kvcore.conformance.sampler_scenarios import FAMILY_ALPHA, oracle_cases
from kvcore.conformance.settings import SuiteConfig
from kvcore.conformance.target import resolve_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sampler", default="default")
    p.add_argument("--seeds", type=int, default=200, help="independent runs (seeds 1 .. N; 0 is the suite's own)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = resolve_target(None, sampler=args.sampler)
    cases = oracle_cases()
    failed_runs, p_values, start = [], [], time.perf_counter()
    for seed in range(1, args.seeds + 1):
        cfg = SuiteConfig(seed=seed, tiers=("sampling",))
        failures = []
        for case in cases:
            result = run_case(target, "sampling", case, cfg)
            if "p_value" in result.info:
                p_values.append(result.info["p_value"])
            if result.failed:
                failures.append(f"{case.id}: {result.detail}")
        if failures:
            failed_runs.append((seed, failures))
    seconds = time.perf_counter() - start
    n = args.seeds
    print(f"sampler {args.sampler}: {len(failed_runs)} of {n} runs failed ({len(cases)} oracle cases each, "
          f"family alpha {FAMILY_ALPHA:g}) in {seconds:.0f}s")
    for seed, failures in failed_runs:
        print(f"  seed {seed}: " + "; ".join(failures))
    for level in (0.05, 0.01, 0.001):
        share = sum(v < level for v in p_values) / len(p_values)
        print(f"  chi-square p-values under {level:g}: {share:.2%} of {len(p_values)}")


if __name__ == "__main__":
    main()
