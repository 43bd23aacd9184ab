"""Tensor parallelism (kvcore/distributed): the head split, sharded forwards against the full model,
TP=2 engines over gloo against TP=1, and failure handling (a killed or hung rank ends the CLI with one
error line, exit code 7, and no worker process left)."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from golden import GOLDEN_TOKENS, load_golden
from helpers import make_plugin, make_random_gemma3, make_random_model

from kvcore import Engine, EngineConfig, SamplingParams
from kvcore.backends.naive import NaiveBackend
from kvcore.errors import ConfigError, TensorParallelError
from kvcore.execution.distributed import plan_shards
from kvcore.execution.distributed.sharding import build_local_model, local_config, shard_state
from kvcore.model.config import ModelConfig
from kvcore.plugins.registry import PluginRegistry

DATA = Path(__file__).parents[1] / "data"


def _config(h: int, h_kv: int, width: int = 64) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=width, num_hidden_layers=1,
                       num_attention_heads=h, num_key_value_heads=h_kv, head_dim=8, max_position_embeddings=64)


# -- the head split -------------------------------------------------------------------------------------
def test_smollm2_heads_split_unevenly_by_whole_gqa_groups():
    r0, r1 = plan_shards(_config(9, 3), 2)
    assert (r0.kv_heads, r0.q_heads) == ((0, 1), tuple(range(6)))
    assert (r1.kv_heads, r1.q_heads) == ((2,), (6, 7, 8))
    assert (r0.ffn, r1.ffn) == ((0, 32), (32, 64))


def test_fewer_kv_heads_than_ranks_are_replicated():
    shards = plan_shards(_config(8, 2), 4)
    assert [s.kv_heads for s in shards] == [(0,), (0,), (1,), (1,)]
    assert [s.q_heads for s in shards] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(q // 4 == s.kv_heads[0] for s in shards for q in s.q_heads)  # within the KV head's group


@pytest.mark.parametrize(("h", "h_kv", "n"), [(6, 2, 3), (4, 4, 8), (6, 3, 4)])
def test_splits_that_do_not_fit_are_refused(h, h_kv, n):
    with pytest.raises(ConfigError, match="does not fit this model's heads"):
        plan_shards(_config(h, h_kv), n)


def test_engine_refuses_a_bad_size_before_starting_processes(random_model):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    children = set(psutil.Process().children())
    with pytest.raises(ConfigError, match="does not fit"):
        Engine(random_model, None, EngineConfig(tensor_parallel_size=3))  # 2 KV heads
    assert set(psutil.Process().children()) == children


# -- sharded forwards in one process (threads stand in for ranks) ----------------------------------------
class _ThreadAllReduce:
    """An all-reduce between threads: every rank gets the rank-ordered sum of the partials."""

    def __init__(self, n: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=30)

    def for_rank(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()
            return x.copy_(total)

        return all_reduce


def _causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence attending to this call's own K/V: ``[T, H, D]`` from ``[T, H|H_kv, D]``."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(0, 1)


@pytest.mark.parametrize(("h", "h_kv", "n"), [(4, 2, 2), (6, 3, 2), (8, 2, 4), (4, 1, 2), (6, 3, 3)])
def test_sharded_forward_equals_the_full_model(h, h_kv, n):
    """Even, uneven (whole GQA groups) and replicated-KV splits: the ranks' outputs all equal the full model's."""
    _check_sharded_forward(make_random_model(num_heads=h, num_kv_heads=h_kv, head_dim=8, seed=h * 10 + n), n)


@pytest.mark.parametrize("family", ["llama-bias", "qwen2", "qwen3", "phi3", "gemma2"])
def test_sharded_forward_of_every_family(tmp_path, family):
    """The decoder's options shard too: Q/K/V and output biases (the output bias added once, to the sum),
    Q/K norms, fused projections as loaded, Gemma's extra norms and scaled RoPE tables."""
    from tiny_checkpoints import build_hf, save_hf

    from kvcore.loaders import build_model, load_model

    loaded = load_model(str(save_hf(build_hf(family), tmp_path / family)))
    _check_sharded_forward(build_model(loaded, max_model_len=64), 2)


def _check_sharded_forward(model, n: int) -> None:
    ids = torch.randint(3, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11)
    with torch.inference_mode():
        expected = model(ids, positions, _causal_attention)
    reduce = _ThreadAllReduce(n)
    outputs: list[torch.Tensor | None] = [None] * n

    def run(shard) -> None:
        local = build_local_model(local_config(model.config, shard), shard_state(model, shard, shard.rank == 0),
                                  reduce.for_rank(shard.rank))
        assert local.config.num_key_value_heads == len(shard.kv_heads)
        with torch.inference_mode():
            outputs[shard.rank] = local(ids, positions, _causal_attention)

    threads = [threading.Thread(target=run, args=(s,)) for s in plan_shards(model.config, n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in outputs:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# -- TP=2 engines (2 processes, gloo) ---------------------------------------------------------------------
def _generate(model, config: EngineConfig, prompts, n: int = 12):
    engine = Engine(model, None, config)
    try:
        results = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
        return [r.token_ids for r in results], (engine.runner.describe() if engine.runner else None)
    finally:
        engine.close()


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 43)), [3] * 17]


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_tp2_generates_the_tp1_tokens(random_model, backend):
    want, _ = _generate(random_model, EngineConfig(backend=backend), PROMPTS)
    got, group = _generate(random_model, EngineConfig(backend=backend, tensor_parallel_size=2), PROMPTS)
    assert got == want
    assert [r["kv_heads"] for r in group["ranks"]] == [[0], [1]]
    assert len({r["pid"] for r in group["ranks"]}) == 2 and group["collectives"] == "gloo"


def test_tp2_uneven_heads_paged_with_prefix_caching():
    """3 KV heads over 2 ranks (rank 0 holds 2, rank 1 one), a paged cache with shared prefix blocks: the
    tokens equal TP=1's and each rank's KV bytes per token count only its own heads."""
    model = make_random_model(num_heads=6, num_kv_heads=3, head_dim=8, seed=3)
    prompts = [list(range(3, 40)), list(range(3, 40)) + [7, 8], [9] * 20]
    config = dict(backend="paged", block_size=8, enable_prefix_caching=True, max_num_seqs=2)
    want, _ = _generate(model, EngineConfig(**config), prompts)
    got, group = _generate(model, EngineConfig(**config, tensor_parallel_size=2), prompts)
    assert got == want
    per_head = 2 * model.config.num_hidden_layers * 8 * 4  # K and V, layers, head_dim, fp32 bytes
    assert [r["kv_bytes_per_token"] for r in group["ranks"]] == [2 * per_head, per_head]
    assert group["ranks"][0]["num_blocks"] == group["ranks"][1]["num_blocks"]


def test_tp2_sliding_window_layers_give_blocks_back_on_every_rank():
    """Window layers giving KV blocks back (kvcore/scheduling/kv_groups.py): each rank addresses its cache
    through rank 0's per-group block tables; the tokens equal TP=1's with every block kept."""
    model = make_random_gemma3(window=5)
    config = dict(backend="paged", block_size=4, max_model_len=64, max_num_batched_tokens=8)
    want, _ = _generate(model, EngineConfig(**config, free_window_blocks=False), PROMPTS)
    got, group = _generate(model, EngineConfig(**config, tensor_parallel_size=2), PROMPTS)
    assert got == want
    assert group["ranks"][0]["num_blocks"] == group["ranks"][1]["num_blocks"]


@pytest.mark.slow
@GOLDEN_TOKENS
def test_smollm2_tp2_matches_the_golden_tokens(smollm2, num_tokens):
    """The golden prompts, batched, on 2 ranks (9 query heads over 3 KV heads: split 2 + 1 KV heads) with
    naive, sdpa and paged: exactly the fp32 greedy ids transformers gives (and TP=1 gives)."""
    from kvcore import LlamaModel

    golden = load_golden("golden_smollm2.json")
    num_tokens = num_tokens or golden["max_new_tokens"]
    model = LlamaModel.from_weights(smollm2.config, smollm2.weights)
    prompts = [p["prompt_token_ids"] for p in golden["prompts"]]
    for backend in ("naive", "sdpa", "paged"):
        config = EngineConfig(backend=backend, max_num_seqs=len(prompts), tensor_parallel_size=2)
        got, _ = _generate(model, config, prompts, num_tokens)
        for p, ids in zip(golden["prompts"], got):
            assert ids == p["token_ids"][:num_tokens], f"{backend}: prompt '{p['name']}' diverges on 2 ranks"


# -- failure: a rank that raises, is killed or hangs mid-generation --------------------------------------------
class WorkerFailsBackend(NaiveBackend):
    """``naive``, except that on a spawned rank (a worker) its third forward call raises."""

    name = "tp-worker-fails"

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, layer_idx, q, k, v, cache, plan):
        if multiprocessing.parent_process() is not None and layer_idx == 0:
            self.calls += 1
            if self.calls == 3:
                # a slow teardown, as on a loaded machine: rank 0 sees the closed sockets seconds before the exit
                atexit.register(time.sleep, 3.0)
                raise RuntimeError("planted failure on a worker")
        return super().forward(layer_idx, q, k, v, cache, plan)


def test_worker_error_reaches_rank_0_and_the_group_stays_down(random_model):
    registry = PluginRegistry(load_entrypoints=False)
    registry.register_plugin(make_plugin(backends=[WorkerFailsBackend]), name="tp-worker-fails")
    before = set(psutil.Process().children())
    engine = Engine(random_model, None, EngineConfig(backend="tp-worker-fails", tensor_parallel_size=2),
                    registry=registry)
    workers = [p for p in set(psutil.Process().children()) - before if "spawn_main" in " ".join(p.cmdline())]
    assert len(workers) == 1
    try:
        (result,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert isinstance(result.error, TensorParallelError)
        assert "rank 1" in str(result.error) and "exited with code 1 after RuntimeError: planted failure" in str(
            result.error)
        assert len(result.token_ids) == 2  # the prefill and one decode step ran on both ranks
        (again,) = engine.generate([[8, 9]], SamplingParams(max_new_tokens=2))
        assert str(again.error) == str(result.error)  # later steps fail at once with the same error
    finally:
        engine.close()
    assert _gone([p.pid for p in workers])


# -- failure: a rank killed or hung mid-generation ----------------------------------------------------------
def _disturb_a_worker_mid_generation(sig: int, env: dict | None = None) -> tuple[int, str, float, list[int]]:
    """Run the CLI at TP=2, send ``sig`` to the worker once the first token is printed; returns (exit code,
    stderr, seconds from the signal to exit, pids of every process the CLI started)."""
    cmd = [sys.executable, "-m", "kvcore.cli", "generate", "--model", str(DATA / "tiny-llama"),
           "--tensor-parallel-size", "2", "--backend", "naive", "--max-new-tokens", "240", "--ignore-eos",
           "Once upon a time"]
    cli = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    try:
        first = cli.stdout.read(1)  # the stream has started: both ranks are mid-generation
        assert first, cli.stderr.read().decode()
        procs = psutil.Process(cli.pid).children(recursive=True)
        workers = [p for p in procs if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 1, [p.cmdline() for p in procs]
        os.kill(workers[0].pid, sig)
        start = time.monotonic()
        _, err = cli.communicate(timeout=60)
        return cli.returncode, err.decode(), time.monotonic() - start, [p.pid for p in procs]
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_killed_worker_ends_the_cli_with_one_error_and_no_orphans():
    rc, err, seconds, pids = _disturb_a_worker_mid_generation(signal.SIGKILL)
    assert rc == 7, err
    (line,) = err.strip().splitlines()  # one line on stderr, nothing else
    assert line.startswith("kvcore: error: tensor-parallel group failed: rank 1 (pid ") and "SIGKILL" in line
    assert seconds < 30
    assert _gone(pids), "a process the CLI started is still running"


def test_hung_worker_times_out_and_is_reaped():
    rc, err, seconds, pids = _disturb_a_worker_mid_generation(signal.SIGSTOP, {"KVCORE_TP_TIMEOUT_S": "2"})
    assert rc == 7, err
    (line,) = err.strip().splitlines()
    assert "timed out" in line.lower() and "KVCORE_TP_TIMEOUT_S=2" in line
    assert seconds < 30
    assert _gone(pids), "the stopped worker was left behind"


def test_cli_under_torchrun_matches_one_process():
    """``torchrun --nproc-per-node 2 kvcore generate --tensor-parallel-size 2``: rank 0 prints the TP=1 ids,
    rank 1 serves inside the engine constructor and exits 0."""
    import json

    args = ["generate", "--model", str(DATA / "tiny-llama"), "--backend", "naive", "--max-new-tokens", "8",
            "--ignore-eos", "--json", "Once upon a time"]
    one = subprocess.run([sys.executable, "-m", "kvcore.cli", *args], capture_output=True, text=True, timeout=120)
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--module", "kvcore.cli",
           *args, "--tensor-parallel-size", "2"]
    two = subprocess.run(run, capture_output=True, text=True, timeout=180, env={**os.environ, "MASTER_PORT": "0"})
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    results = [json.loads(line) for line in two.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1  # rank 0 only
    assert results[0]["token_ids"] == json.loads(one.stdout.splitlines()[-1])["token_ids"]
    assert results[0]["tensor_parallel"]["launcher"] == "torchrun"


def test_cli_ends_at_once_after_a_group_failure():
    """After a TensorParallelError the CLI reports it and ends with its exit code without the interpreter's
    teardown, which could otherwise destroy the aborted group's threads and abort the process (SIGABRT)."""
    script = (
        "import atexit, sys\n"
        "from kvcore.cli import app\n"
        "from kvcore.errors import TensorParallelError\n"
        "atexit.register(lambda: print('teardown ran', flush=True))\n"
        "def fail(argv, state):\n"
        "    print('partial output', end='')\n"  # buffered: must still reach the reader
        "    raise TensorParallelError('tensor-parallel group failed: rank 1 was killed')\n"
        "app._dispatch = fail\n"
        "sys.exit(app.main(['generate', 'hi']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert done.stderr == "kvcore: error: tensor-parallel group failed: rank 1 was killed\n"
    assert done.stdout == "partial output"  # flushed, and no teardown after it
