"""The kvcore exception hierarchy.

Every error a user can trigger (bad CLI flag, bad config, bad model file, a backend that cannot run
here) is a :class:`KVCoreError`. The CLI prints ``str(err)`` as one line on stderr and exits non-zero;
a traceback is shown only with ``--debug``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterable

__all__ = [  # the exception classes (README's exit-code table lists each); did_you_mean is imported by name
    "KVCoreError",
    "ConfigError",
    "InvalidRequestError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelFileChangedError",
    "BackendError",
    "BackendOutputError",
    "NonFiniteRowsError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "PluginError",
    "SamplerError",
    "OutOfBlocksError",
    "ContextLengthError",
    "GrammarError",
    "ChatTemplateError",
    "RequestAbortedError",
    "TensorParallelError",
    "OutputError",
    "CacheTrustError",
    "KernelBuildError",
]


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` naming the choices closest to ``name`` (a typed flag, key or plugin name), or ``""``
    when none is close: the one suggestion every user error that names a wrong name ends with."""
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def reject_unknown_keywords(cls: type) -> type:
    """Class decorator for a config dataclass: an unknown keyword argument is a :class:`ConfigError` naming
    it with :func:`did_you_mean`, where the generated ``__init__`` raises a bare TypeError. Apply it above
    ``@dataclass``; the signature (``inspect.signature``) and everything else stay the dataclass's."""
    init = cls.__init__
    accepted = [p for p in inspect.signature(init).parameters if p != "self"]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for key in kwargs:
            if key not in accepted:
                hint = did_you_mean(key, accepted) or f" (its fields: {', '.join(accepted)})"
                raise ConfigError(f"{cls.__name__} got an unknown field '{key}'{hint}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


class KVCoreError(Exception):
    """Base class of every error kvcore raises on purpose."""

    #: process exit code the CLI uses for this kind of error
    exit_code: int = 1
    #: the CLI ends the process at once after reporting it (``os._exit``: no interpreter teardown), because
    #: tearing down what failed could still abort the process and replace the documented exit code
    end_process: bool = False


class ConfigError(KVCoreError):
    """A configuration file, option or dataclass field has a bad value. ``key``: where a config file would give
    the value at fault (``("backends", "sdpa", "blok_size")``), so that the file's line can be named
    (:func:`kvcore.engine.file_config.located`); ``()`` when no one key is."""

    exit_code = 2

    def __init__(self, message: str = "", *, key: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.key = key


class InvalidRequestError(ConfigError):
    """A generation request is invalid (empty prompt, bad sampling parameter, ...)."""


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested new tokens do not fit the model's context window or the cache."""


class GrammarError(InvalidRequestError):
    """A structured-output constraint (JSON schema, regex, choice, grammar) is malformed; the message names
    the problem (kvcore/sampling/structured.py)."""


class ChatTemplateError(ConfigError):
    """The model's chat template is not valid Jinja, or rendering it hit the time or size limit
    (:mod:`kvcore.text.chat_template`)."""


class CacheTrustError(ConfigError):
    """A folder or file in kvcore's cache is not private to the user (another owner, writable by others, a
    symbolic link): kvcore will not load code or weights from it. The message names it (kvcore/paths.py)."""


class ModelLoadError(KVCoreError):
    """A model file is missing, truncated, corrupt or of an unsupported kind."""

    exit_code = 3


class ModelNotFoundError(ModelLoadError):
    """The model path does not exist, or the embedded default is not installed."""


class ModelFileChangedError(ModelLoadError):
    """A file the running model reads its weights from was truncated or written to after it was loaded
    (kvcore/loaders/watched.py): the engine refuses to run on it (HTTP 503) until it is restarted."""


class BackendError(KVCoreError):
    """Something is wrong with an attention backend."""

    exit_code = 4


class BackendOutputError(BackendError):
    """An attention backend returned an output that breaks its contract: NaN or inf, a wrong shape, dtype or
    device, or values that disagree with the reference attention (kvcore/execution/backend_check.py). The requests of
    that forward fail; the others go on."""


class NonFiniteRowsError(BackendOutputError):
    """NaN or inf in the output of some sequences of a batch only: those requests fail, the engine samples
    the others from :attr:`logits` (the rows of the sequences that sample, as computed)."""

    def __init__(self, message: str, seq_indices: list[int], logits: object) -> None:
        super().__init__(message)
        self.seq_indices = seq_indices  # positions in the batch of the sequences whose output is not finite
        self.logits = logits


class UnknownBackendError(BackendError):
    """No backend of that name is registered."""


class BackendUnavailableError(BackendError):
    """The backend is registered but cannot run here; the message says why."""

    exit_code = 5


class KernelBuildError(BackendUnavailableError):
    """kvcore's CPU kernels could not be built or loaded: the message has the compiler's first error line
    (or the loader's) and what to do about it."""


class PluginError(BackendError):
    """A plugin broke a registration rule (duplicate name, incomplete backend class, ...)."""


class SamplerError(KVCoreError):
    """A sampler raised while picking tokens (the requests of that batch fail, the others go on)."""

    exit_code = 4


class OutOfBlocksError(KVCoreError):
    """The KV cache has no room left for a request."""

    exit_code = 6


class RequestAbortedError(KVCoreError):
    """The caller aborted the request."""


class TensorParallelError(KVCoreError):
    """A tensor-parallel rank died, hung past its collective timeout or failed; the whole group was shut
    down (kvcore/distributed)."""

    exit_code = 7
    # the aborted collective group's library threads may still be joinable: destroying them at interpreter exit
    # calls std::terminate (SIGABRT)
    end_process = True


class OutputError(KVCoreError):
    """The CLI cannot write its output (a full disk, an I/O error). A reader that went away (a closed pipe)
    is not an error: the CLI then stops quietly with exit code 141."""

    exit_code = 74  # EX_IOERR
