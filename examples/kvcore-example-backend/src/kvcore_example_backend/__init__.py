"""An example third-party kvcore plugin package: one attention backend, one KV cache, one sampler.

* ``example_chunked`` (:class:`ChunkedAttentionBackend`): chunked-KV online-softmax attention in plain PyTorch;
* ``example_fp16`` (:class:`Float16KVCache`): a paged KV cache storing K/V as float16;
* ``example_repetition_penalty`` (:class:`RepetitionPenaltySampler`): the CTRL repetition penalty.
"""

from kvcore_example_backend.backend import ChunkedAttentionBackend
from kvcore_example_backend.cache import Float16KVCache
from kvcore_example_backend.sampler import RepetitionPenaltySampler, apply_repetition_penalty

__all__ = ["ChunkedAttentionBackend", "Float16KVCache", "RepetitionPenaltySampler", "apply_repetition_penalty"]
__version__ = "0.1.0"
