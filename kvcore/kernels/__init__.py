"""Compute kernels: CPU feature detection, kvcore's C++ library (built on first use), dense and
quantized matmuls. The one package that touches private torch operators."""
