"""The model: configuration, RoPE, weights, the decoder, the LM head, architectures and families."""
