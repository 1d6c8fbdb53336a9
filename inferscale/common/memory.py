"""Deprecated alias of `inferscale.common.facts`, kept for one release: import from there."""

import warnings

from inferscale.common.facts import *  # noqa: F401,F403

warnings.warn("inferscale.common.memory moved to inferscale.common.facts; this alias goes in the next release",
              DeprecationWarning, stacklevel=2)
