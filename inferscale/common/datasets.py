"""Deprecated alias of `inferscale.evaluation.datasets` and `.locomo`, kept for one release: import from there."""

import warnings

from inferscale.evaluation.datasets import *  # noqa: F401,F403
from inferscale.evaluation.locomo import *  # noqa: F401,F403

warnings.warn("inferscale.common.datasets moved to inferscale.evaluation.datasets; this alias goes in the next release",
              DeprecationWarning, stacklevel=2)
