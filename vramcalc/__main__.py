"""`python -m vramcalc`."""

from vramcalc.cli import run

run()
