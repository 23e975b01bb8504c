"""What a compiled region keeps for backward, asked of torch itself.

`torch.compile` hands a region's joint forward-backward graph to AOTAutograd, which splits
it with inductor's partitioner (`min_cut_rematerialization_partition`, after inductor's
decompositions, torch/_inductor/compile_fx.py): the forward graph returns the region's
outputs followed by the tensors the backward graph needs. `compiled_saved` runs a function
through the same partitioner under FakeTensorMode with a compiler that only records the
forward graph, so the answer is torch's, not vramcalc's; no kernel is generated or run.

`torchtune_cross_entropy` is torchtune's compiled function, written from its source
(pytorch/torchtune 1814feb, torchtune/modules/loss/ce_chunked_output_loss.py
`CEWithChunkedOutputLoss.compute_cross_entropy`, which `training.compile_loss` compiles).

torch is imported only when these run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SavedTensor:
    """One tensor the forward graph hands to the backward graph."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_input: bool  # a graph input kept alive (no new allocation of the region)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def torchtune_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                            ignore_index: int = -100) -> torch.Tensor:
    """Upcast one chunk's logits to fp32 and sum its token losses (torchtune's
    `compute_cross_entropy`)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index,
                           reduction="sum")


def compiled_saved(fn: Callable[..., Any], *args: torch.Tensor,
                   inductor: bool = True) -> list[SavedTensor]:
    """The tensors `fn`'s compiled forward keeps for its backward. `args` are fake or meta
    tensors (a FakeTensorMode must be active for fake ones). `inductor=False` partitions
    the undecomposed graph with AOTAutograd's default partitioner, which keeps what the
    eager operators' autograd formulas keep."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import (
        default_partition,
        min_cut_rematerialization_partition,
    )

    graphs: list[Any] = []

    def record(gm: Any, _inputs: Any) -> Any:
        graphs.append(gm)
        return gm

    def noop(gm: Any, _inputs: Any) -> Any:
        return gm

    kwargs: dict[str, Any] = {"fw_compiler": record, "bw_compiler": noop}
    if inductor:
        from torch._inductor.decomposition import select_decomp_table

        kwargs.update(partition_fn=min_cut_rematerialization_partition,
                      decompositions=select_decomp_table())
    else:
        kwargs.update(partition_fn=default_partition)
    out = aot_function(fn, **kwargs)(*args)
    n_out = len(out) if isinstance(out, (tuple, list)) else 1
    (gm,) = graphs
    output = next(n for n in gm.graph.nodes if n.op == "output")
    aliases = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)

    def base(node: Any) -> Any:  # an alias of a saved tensor shares its storage
        while node.op == "call_function" and node.target in aliases:
            node = node.args[0]
        return node

    saved: dict[str, SavedTensor] = {}
    for node in output.args[0][n_out:]:
        val, root = node.meta.get("val"), base(node)
        if isinstance(val, torch.Tensor) and root.name not in saved:
            saved[root.name] = SavedTensor(root.name, tuple(int(d) for d in val.shape),
                                           val.dtype, root.op == "placeholder")
    return list(saved.values())
