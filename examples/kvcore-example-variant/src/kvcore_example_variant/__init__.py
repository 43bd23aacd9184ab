"""kvcore-example-variant: attention variants as code, registered through kvcore's plugin hook."""

from kvcore_example_variant.variants import Alibi, LocalGlobal

__all__ = ["Alibi", "LocalGlobal"]
