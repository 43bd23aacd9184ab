"""Deprecated: ``kvcore.backends.ngram`` is :mod:`kvcore.speculative.ngram`; import it from there."""

import sys
import warnings

from kvcore.speculative import ngram

warnings.warn("kvcore.backends.ngram moved to kvcore.speculative.ngram; import it from there",
              DeprecationWarning, stacklevel=2)
# the new module itself, not a copy: one set of classes (and of hooks) under both names
sys.modules[__name__] = ngram
