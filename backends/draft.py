"""Deprecated: ``kvcore.backends.draft`` is :mod:`kvcore.speculative.draft`; import it from there."""

import sys
import warnings

from kvcore.speculative import draft

warnings.warn("kvcore.backends.draft moved to kvcore.speculative.draft; import it from there",
              DeprecationWarning, stacklevel=2)
# the new module itself, not a copy: one set of classes (and of hooks) under both names
sys.modules[__name__] = draft
