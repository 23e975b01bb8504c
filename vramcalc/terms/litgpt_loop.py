"""What LitGPT's training loop keeps of the previous micro-batch while the next forward
runs (the lightning profile).

litgpt/finetune/lora.py `fit` (LitGPT 00af8b0d; lit-gpt 8641822 and finetune/full.py alike)
binds `logits = model(input_ids, lm_head_chunk_size=128)` and `loss =
chunked_cross_entropy(logits, ...)`. After `fabric.backward(loss / ...)` the loop rebinds
`loss` (every iteration with the configs' `log_interval: 1`: `loss =
running_loss.compute().item()`), but `logits` stays bound until the next `model(...)`
returns. The list is Fabric's fp32 copy of the head's chunks (lightning/fabric/wrappers.py
`_FabricModule.forward`: `self._precision.convert_output(output)`, to the default dtype,
fp32, outside the precision's forward context), and through its grad_fn the whole previous
graph stays alive. Backward released that graph's saved tensors but not what a custom
autograd Function keeps as a plain attribute: bitsandbytes' `MatMul4Bit.forward` before
0.43.2 holds `ctx.tensors = (A, B)` (vramcalc/qlora.py `BNB_FREES_INPUT`). So the next
forward, until the model returns, runs beside the previous micro-batch's fp32 logits list
and, with such a bitsandbytes, every 4-bit linear's input on the stage. Running LitGPT
00af8b0d's own GPT under the fake-tensor tracker with a bitsandbytes-0.42 stand-in for its
linears (Llama-2-7B, LoRA r32 on q and v, micro-batch 2 x 512 tokens) moves the forward
peak from 11.56 GB to 13.15 GB when `logits` is kept as the loop keeps it; on the CPU the
attention output's reshape is a copy the 4-bit proj holds as well, which on CUDA is a view
of what SDPA keeps (docs/methodology.md §17).
"""

from __future__ import annotations

from vramcalc.qlora import BNB_FREES_INPUT
from vramcalc.rank import RankContext
from vramcalc.terms import activations as act
from vramcalc.terms.finetune_activations import bnb_keeps_inputs
from vramcalc.terms.logits import lit_logits_lists


def previous_logits_bytes(ctx: RankContext) -> int:
    """The previous micro-batch's fp32 logits list (last stage, lightning profile)."""
    if ctx.training.framework != "lightning" or not ctx.is_last_stage:
        return 0
    return lit_logits_lists(ctx)[1]


def previous_held_bytes(ctx: RankContext) -> int:
    """The previous micro-batch's 4-bit linear inputs that bitsandbytes < 0.43.2 still holds:
    the stage's saved bytes less what the same stage saves with a bitsandbytes that frees
    them."""
    if ctx.training.framework != "lightning" or not bnb_keeps_inputs(ctx):
        return 0
    release = ".".join(map(str, BNB_FREES_INPUT))
    freed = RankContext(ctx.spec, ctx.training.model_copy(update={"bnb_version": release}),
                        ctx.parallel, ctx.stage)
    return _stage_saved(ctx) - _stage_saved(freed)


def _stage_saved(ctx: RankContext) -> int:
    n_dense, dense, n_moe, moe = act.stage_layer_bytes(ctx)
    return (n_dense * dense + n_moe * moe - act.first_layer_gap(ctx)
            + sum(t.nbytes for t in act.head_saved(ctx)))
