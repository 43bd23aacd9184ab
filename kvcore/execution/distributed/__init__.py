"""Tensor parallelism: ``EngineConfig(tensor_parallel_size=N)`` / ``kvcore generate --tensor-parallel-size N``.

- :mod:`~kvcore.execution.distributed.parallel_state`: the process group (gloo / NCCL), its channels and timeouts;
- :mod:`~kvcore.execution.distributed.sharding`: the head split and the rank-local models;
- :mod:`~kvcore.execution.distributed.worker`: ranks 1..N-1;
- :mod:`~kvcore.execution.distributed.tp_runner`: rank 0's side, the engine's runner.
"""

from kvcore.execution.distributed.sharding import RankShard, plan_shards
from kvcore.execution.distributed.tp_runner import TensorParallelRunner

__all__ = ["TensorParallelRunner", "RankShard", "plan_shards"]
