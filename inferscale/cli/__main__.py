"""`python -m inferscale.cli ...` is the `inferscale` command (what the benchmarks start servers with)."""

import sys

from inferscale.cli import main

sys.exit(main())
