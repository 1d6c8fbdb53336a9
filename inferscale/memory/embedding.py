"""Deprecated alias of `inferscale.retrieval.embedders`, kept for one release: import from there."""

import warnings

from inferscale.retrieval.embedders import *  # noqa: F401,F403

warnings.warn("inferscale.memory.embedding moved to inferscale.retrieval.embedders; this alias goes in the next release",
              DeprecationWarning, stacklevel=2)
