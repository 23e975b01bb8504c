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
graph stays alive. Backward released that graph's saved tensors (each node's
`release_variables` once it has run) but not what a custom autograd Function keeps as a
plain attribute: bitsandbytes' `MatMul4Bit.forward` before 0.43.2 holds `ctx.tensors = (A,
B)` (vramcalc/qlora.py `BNB_FREES_INPUT`). So the next forward, until the model returns,
runs beside the previous micro-batch's fp32 logits list and, with such a bitsandbytes, the
storage of every 4-bit linear's input on the stage, whether or not another node had saved
the same storage: the attention proj's input is a view of SDPA's output (the flash kernel
writes it (b, s, a, d)-major, so `y.transpose(1, 2).reshape` copies nothing), which SDPA's
node released in backward and the proj still holds. Running LitGPT 00af8b0d's own GPT under
the fake-tensor tracker with a bitsandbytes-0.42 stand-in for its linears (Llama-2-7B, LoRA
r32 on q and v, micro-batch 2 x 512 tokens) moves the forward peak from 11.56 GB to 13.15 GB
when `logits` is kept as the loop keeps it (on the CPU that proj input is a copy, the same
bytes; docs/methodology.md §17).
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms import activations as act
from vramcalc.terms.finetune_activations import (
    bnb_keeps_inputs,
    embedding_trained,
    held_4bit_inputs,
)
from vramcalc.terms.logits import lit_logits_lists


def previous_logits_bytes(ctx: RankContext) -> int:
    """The previous micro-batch's fp32 logits list (last stage, lightning profile)."""
    if ctx.training.framework != "lightning" or not ctx.is_last_stage:
        return 0
    return lit_logits_lists(ctx)[1]


def previous_held_bytes(ctx: RankContext) -> int:
    """The previous micro-batch's 4-bit linear inputs that bitsandbytes < 0.43.2 still holds:
    per layer q/k/v's input (norm_1's output), proj's (SDPA's output), fc_1/fc_2's (norm_2's
    output) and the down projection's; none for the first layer's q/k/v, whose input needs
    no gradient under a frozen embedding (`ctx.tensors = (None, None)`); with a 4-bit head,
    the final norm's output its chunks are views of."""
    tr = ctx.training
    if tr.framework != "lightning" or not bnb_keeps_inputs(ctx):
        return 0
    layer = held_4bit_inputs(ctx)
    first = (sum(t.nbytes for t in layer if t.name.startswith("attn.input"))
             if ctx.is_first_stage and ctx.num_layers and not embedding_trained(tr) else 0)
    head = sum(t.nbytes for t in act.head_saved(ctx)
               if t.name.startswith("lm_head.input")) if tr.quantize_head else 0
    return ctx.num_layers * sum(t.nbytes for t in layer) - first + head
