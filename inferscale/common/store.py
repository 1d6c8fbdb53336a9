"""Deprecated alias of `inferscale.common.storage`, kept for one release: import from there."""

import warnings

from inferscale.common.storage.format import *  # noqa: F401,F403
from inferscale.common.storage.local_store import *  # noqa: F401,F403
from inferscale.common.storage.atomic import *  # noqa: F401,F403

warnings.warn("inferscale.common.store moved to inferscale.common.storage; this alias goes in the next release",
              DeprecationWarning, stacklevel=2)
