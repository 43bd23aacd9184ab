"""``python -m kvcore.cli`` (what torchrun and the tests launch)."""

import sys

from kvcore.cli import main

sys.exit(main())
