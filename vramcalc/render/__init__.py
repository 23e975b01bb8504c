"""Rendering: results to rich tables, plain lines and markdown. The only package that
imports rich.

One module per thing rendered: `report` (one scenario's memory breakdown, explain),
`plan` (plan, size, check markdown), `probe` (probe records), `validation` (engines side by
side), `catalog` (the GPU and model catalogs); `console` makes the console and progress bars
the CLI prints through. Nothing here reads argv or sets exit codes (vramcalc/cli/).
"""
