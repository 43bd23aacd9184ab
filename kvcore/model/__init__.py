"""The model (layer 2): configuration, RoPE, weights, the decoder, the LM head, architectures and families."""
