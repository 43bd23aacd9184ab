"""Plugin hook specifications. The docstrings are the spec.

A plugin is a module (or object) with functions named like these hooks, decorated with
``kvcore.hookimpl``, advertised under the ``kvcore`` entry-point group::

    [project.entry-points.kvcore]
    my_plugin = "my_package.plugin"

There is one ``kvcore_register_*`` hook per pluggable kind, all with the same shape: the hook receives
a ``register`` callback and calls it once per class it provides. The built-in backends, KV caches and
sampler register through these same hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    import argparse

__all__ = [
    "hookspec",
    "hookimpl",
    "Register",
    "kvcore_register_backends",
    "kvcore_register_kv_caches",
    "kvcore_register_samplers",
    "kvcore_register_architectures",
    "kvcore_register_proposers",
    "kvcore_register_attention_variants",
    "kvcore_configure",
    "kvcore_register_commands",
]

hookspec = pluggy.HookspecMarker("kvcore")
hookimpl = pluggy.HookimplMarker("kvcore")


class Register(Protocol):
    def __call__(self, cls: type, *, name: str | None = None) -> None: ...


@hookspec
def kvcore_register_backends(register: Register) -> None:
    """Register attention backends.

    Call ``register(BackendClass)`` once per backend; ``name`` defaults to ``BackendClass.name``.
    The class must subclass :class:`kvcore.AttentionBackend` and implement every abstract method,
    or registration fails with the missing names. A name registered by two plugins is an error that
    names both. Import heavy or optional packages (flash-attn, xformers) inside the backend's methods,
    not at module import, so listing backends stays cheap and never fails.

    :param register: callback that records one :class:`~kvcore.interfaces.attention.AttentionBackend` class.
    """


@hookspec
def kvcore_register_kv_caches(register: Register) -> None:
    """Register KV-cache layouts.

    Call ``register(CacheClass)`` once per cache; ``name`` defaults to ``CacheClass.name``. The class
    must subclass :class:`kvcore.KVCache`, implement every abstract method and declare ``layout``
    (the contract backends read, e.g. "contiguous" or "paged") and ``capabilities``. Users select it
    with ``kv_cache = "name"`` / ``--kv-cache name``; its options come from ``[kv_caches.<name>]``.

    :param register: callback that records one :class:`~kvcore.interfaces.kv_cache.KVCache` class.
    """


@hookspec
def kvcore_register_samplers(register: Register) -> None:
    """Register samplers.

    Call ``register(SamplerClass)`` once per sampler; ``name`` defaults to ``SamplerClass.name``. The
    class must subclass :class:`kvcore.Sampler` and implement :meth:`~kvcore.Sampler.sample`. Users
    select it with ``sampler = "name"`` / ``--sampler name``; its options come from ``[samplers.<name>]``.

    :param register: callback that records one :class:`~kvcore.sampling.sampler.Sampler` class.
    """


@hookspec
def kvcore_register_architectures(register: Register) -> None:
    """Register model architectures.

    Call ``register(ArchitectureClass)`` once per family; ``name`` defaults to ``ArchitectureClass.name``.
    The class must subclass :class:`kvcore.model.architectures.Architecture` and declares which checkpoints it
    reads (Hugging Face ``architectures`` / ``model_type``, GGUF ``general.architecture``), its decoder
    options and its weight names; the loaders pick it for a matching ``config.json`` or GGUF file and
    ``kvcore models`` lists it.

    :param register: callback that records one :class:`~kvcore.model.architectures.Architecture` class.
    """


@hookspec
def kvcore_register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers.

    Call ``register(ProposerClass)`` once per proposer; ``name`` defaults to ``ProposerClass.name``. The
    class must subclass :class:`kvcore.interfaces.proposer.Proposer` and implement
    :meth:`~kvcore.interfaces.proposer.Proposer.propose`. Users select it with ``proposer = "name"`` /
    ``--speculative name``; its options come from ``[proposers.<name>]``. ``kvcore conformance --proposer
    name`` certifies that it leaves every stream unchanged.

    :param register: callback that records one :class:`~kvcore.interfaces.proposer.Proposer` class.
    """


@hookspec
def kvcore_register_attention_variants(register: Register) -> None:
    """Register attention variants written as code.

    Call ``register(VariantClass)`` once per variant; ``name`` defaults to ``VariantClass.name``. The class
    must subclass :class:`kvcore.interfaces.variants.AttentionVariant` and implement
    :meth:`~kvcore.interfaces.variants.AttentionVariant.bind`, which returns a layer's ``score_mod`` /
    ``mask_mod`` (FlexAttention's signatures, absolute positions). Users select variants with
    ``attention_variants = ["name"]`` / ``--attention-variant name``; options come from ``[variants.<name>]``.
    The ``naive`` reference evaluates any variant, so ``kvcore conformance --attention-variant name`` certifies a
    backend that declares ``variants_as_code`` against the variant itself.

    :param register: callback that records one :class:`~kvcore.interfaces.variants.AttentionVariant` class.
    """


@hookspec
def kvcore_configure(options: dict[str, Any]) -> None:
    """Receive this plugin's options from the config file.

    Called once after loading, with the ``[plugins.<plugin name>]`` table of the config file
    (an empty dict when there is none). Options of one backend, cache, sampler, proposer or attention variant
    go in ``[backends.<name>]``, ``[kv_caches.<name>]``, ``[samplers.<name>]``, ``[proposers.<name>]`` or
    ``[variants.<name>]`` instead
    and reach that class's constructor as keyword arguments.

    :param options: the plugin's own config table.
    """


@hookspec
def kvcore_register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``kvcore`` command line.

    Call ``subparsers.add_parser(name, help=...)`` once per command, add its arguments, and set the
    function that runs it with ``parser.set_defaults(func=run)``: ``run(args: argparse.Namespace) -> int``
    gets the parsed arguments and returns the process exit code. Errors a user can trigger are
    :class:`kvcore.errors.KVCoreError` subclasses: the CLI prints them as one line and exits with their
    ``exit_code``. A name already taken (a built-in command or another plugin's) makes ``add_parser``
    raise. A hook that raises is skipped with a one-line warning, the commands it added before raising
    are removed, and the rest of the CLI keeps working. The hook runs every time ``kvcore`` starts:
    import heavy packages inside ``run``, not at module import.

    :param subparsers: the ``kvcore`` parser's subcommands, as returned by ``add_subparsers()``.
    """
