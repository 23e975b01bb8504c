"""vramcalc: will a training job fit in GPU memory, how should it run, what should I buy?

Library entry points (no torch needed): `vramcalc.options.build_scenario`,
`vramcalc.analytic.estimate`. The torch engines live in `vramcalc.trace` and `vramcalc.probe`.
"""

__version__ = "0.1.0"
