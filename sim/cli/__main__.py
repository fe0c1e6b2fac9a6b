"""`python -m sim.cli` runs the tpusim command (as `python -m sim` does)."""

import sys

from sim.cli import main

sys.exit(main())
