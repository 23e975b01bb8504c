"""`python -m vramcalc`."""

import sys

from vramcalc.cli import main

sys.exit(main())
