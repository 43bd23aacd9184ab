"""Tensor parallelism: ``EngineConfig(tensor_parallel_size=N)`` / ``kvcore generate --tensor-parallel-size N``.

- :mod:`~kvcore.distributed.parallel_state`: the process group (gloo / NCCL), its channels and timeouts;
- :mod:`~kvcore.distributed.sharding`: the head split and the rank-local models;
- :mod:`~kvcore.distributed.worker`: ranks 1..N-1;
- :mod:`~kvcore.distributed.tp_runner`: rank 0's side, the engine's runner.
"""

from kvcore.distributed.sharding import RankShard, plan_shards
from kvcore.distributed.tp_runner import TensorParallelRunner

__all__ = ["TensorParallelRunner", "RankShard", "plan_shards"]
