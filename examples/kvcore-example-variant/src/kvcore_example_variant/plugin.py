"""The plugin module named by the ``kvcore`` entry point: one ``register`` call per variant."""

from kvcore import hookimpl
from kvcore_example_variant.variants import Alibi, LocalGlobal


@hookimpl
def kvcore_register_attention_variants(register):
    register(Alibi)
    register(LocalGlobal)
