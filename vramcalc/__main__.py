"""`python -m vramcalc`."""

from vramcalc.entry import run

run()
