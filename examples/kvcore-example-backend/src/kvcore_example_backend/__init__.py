"""An example third-party kvcore backend: chunked-KV online-softmax attention in plain PyTorch."""

from kvcore_example_backend.backend import ChunkedAttentionBackend

__all__ = ["ChunkedAttentionBackend"]
__version__ = "0.1.0"
