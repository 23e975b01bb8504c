"""Rendering the catalogs: GPU profiles and built-in models as rich tables."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from vramcalc.render.tables import Column, fitted_table
from vramcalc.units import GB, GiB


def gpus_table(profiles: list[Any], width: int = 120) -> Table:
    """`vramcalc gpus`: one row per GPU profile, sorted by id."""
    columns = [Column("id"), Column("name", rank=3, wrap=True), Column("GB", "right"),
               Column("GiB", "right", 2), Column("BF16 TFLOP/s", "right", 4),
               Column("per node", "right", 5), Column("$/GPU-h", "right", 6),
               Column("aliases", rank=7, wrap=True)]
    rows = []
    for p in sorted(profiles, key=lambda p: p.id):
        bf16 = p.dense_tflops.get("bf16")
        rows.append([p.id, p.name, f"{p.memory_total_bytes / GB:,.1f}",
                     f"{p.memory_total_bytes / GiB:,.1f}", f"{bf16:,.0f}" if bf16 else "-",
                     str(p.gpus_per_node),
                     f"{p.price_usd_per_hour:.2f}" if p.price_usd_per_hour else "-",
                     ", ".join(p.aliases[:4])])
    table, _ = fitted_table("GPU profiles (usable memory as the runtime reports it)", columns,
                            rows, width)
    return table


def models_table(entries: list[Any], width: int = 120) -> Table:
    """`vramcalc models`: one row per built-in model, in catalog order."""
    columns = [Column("name"), Column("params", "right"), Column("layers", "right", 3),
               Column("hidden", "right", 4), Column("heads/kv", "right", 5),
               Column("vocab", "right", 2), Column("aliases", rank=6, wrap=True)]
    rows = []
    for e in entries:
        s = e.spec
        rows.append([s.name, f"{s.num_params:,}", str(s.num_hidden_layers), str(s.hidden_size),
                     f"{s.num_attention_heads}/{s.kv_heads}", f"{s.vocab_size:,}",
                     ", ".join(e.meta.aliases)])
    table, _ = fitted_table("Built-in models (exact parameter counts)", columns, rows, width)
    return table
