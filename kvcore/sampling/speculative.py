"""Deprecated: ``kvcore.sampling.speculative`` is :mod:`kvcore.sampling.rejection`; import it from there."""

import sys
import warnings

from kvcore.sampling import rejection

warnings.warn("kvcore.sampling.speculative moved to kvcore.sampling.rejection; import it from there",
              DeprecationWarning, stacklevel=2)
# the new module itself, not a copy: one set of classes (and of hooks) under both names
sys.modules[__name__] = rejection
