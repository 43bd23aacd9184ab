"""Deprecated: ``kvcore.backends.backoff`` is :mod:`kvcore.speculative.backoff`; import it from there."""

import sys
import warnings

from kvcore.speculative import backoff

warnings.warn("kvcore.backends.backoff moved to kvcore.speculative.backoff; import it from there",
              DeprecationWarning, stacklevel=2)
# the new module itself, not a copy: one set of classes (and of hooks) under both names
sys.modules[__name__] = backoff
