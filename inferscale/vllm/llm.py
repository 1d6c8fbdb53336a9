"""Deprecated alias of `inferscale.serving.memory_llm`, kept for one release: import from there."""

import warnings

from inferscale.serving.memory_llm import *  # noqa: F401,F403

warnings.warn("inferscale.vllm.llm moved to inferscale.serving.memory_llm; this alias goes in the next release",
              DeprecationWarning, stacklevel=2)
