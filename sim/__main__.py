"""`python -m sim` runs the tpusim command."""

import sys

from sim.cli import main

sys.exit(main())
