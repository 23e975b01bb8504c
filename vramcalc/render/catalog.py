"""Rendering the catalogs: GPU profiles and built-in models as rich tables."""

from __future__ import annotations

from typing import Any

from rich.console import JustifyMethod
from rich.table import Table

from vramcalc.units import GB, GiB


def gpus_table(profiles: list[Any]) -> Table:
    """`vramcalc gpus`: one row per GPU profile, sorted by id."""
    table = Table(title="GPU profiles (usable memory as the runtime reports it)",
                  title_justify="left", show_edge=False, pad_edge=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("id", "left"), ("name", "left"), ("GB", "right"), ("GiB", "right"),
        ("BF16 TFLOP/s", "right"), ("per node", "right"), ("$/GPU-h", "right"),
        ("aliases", "left"),
    )
    for col, just in columns:
        table.add_column(col, justify=just)
    for p in sorted(profiles, key=lambda p: p.id):
        bf16 = p.dense_tflops.get("bf16")
        table.add_row(p.id, p.name, f"{p.memory_total_bytes / GB:,.1f}",
                      f"{p.memory_total_bytes / GiB:,.1f}", f"{bf16:,.0f}" if bf16 else "-",
                      str(p.gpus_per_node),
                      f"{p.price_usd_per_hour:.2f}" if p.price_usd_per_hour else "-",
                      ", ".join(p.aliases[:4]))
    return table


def models_table(entries: list[Any]) -> Table:
    """`vramcalc models`: one row per built-in model, in catalog order."""
    table = Table(title="Built-in models (exact parameter counts)", title_justify="left",
                  show_edge=False, pad_edge=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("name", "left"), ("params", "right"), ("layers", "right"), ("hidden", "right"),
        ("heads/kv", "right"), ("vocab", "right"), ("aliases", "left"),
    )
    for col, just in columns:
        table.add_column(col, justify=just)
    for e in entries:
        s = e.spec
        table.add_row(s.name, f"{s.num_params:,}", str(s.num_hidden_layers), str(s.hidden_size),
                      f"{s.num_attention_heads}/{s.kv_heads}", f"{s.vocab_size:,}",
                      ", ".join(e.meta.aliases))
    return table
