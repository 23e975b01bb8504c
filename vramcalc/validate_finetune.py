"""Fine-tuning and low-memory scenarios for `vramcalc validate` (LoRA, QLoRA, DoRA, 8-bit
and paged optimizers, chunked cross entropy, activation offload), included in
vramcalc.validate.default_grid.

Both profiles: `reference` traces vramcalc's LoRALinear / NF4Linear (vramcalc/trace/lora.py,
nf4.py); `hf` traces transformers + PEFT's get_peft_model (with NF4Linear bases for QLoRA).
The shapes are the validation grid's; names extend the grid's with the method, rank,
targets and dropout so they stay unique.
"""

from __future__ import annotations

from typing import Any

from vramcalc.parallel import ParallelConfig
from vramcalc.scenario import Scenario

# (shape, framework, training options)
CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("llama-gqa", "reference", {"finetune": "lora"}),
    ("llama-gqa", "reference", {"finetune": "qlora", "lora_targets": "all-linear"}),
    ("llama-gqa", "reference", {"finetune": "lora", "lora_targets": "all-linear",
                                "lora_dropout": 0.1, "precision": "amp-bf16"}),
    ("llama-gqa", "reference", {"finetune": "qlora", "precision": "amp-bf16"}),
    ("llama-deep", "reference", {"finetune": "qlora", "lora_targets": "all-linear",
                                 "lora_dropout": 0.05, "seq_len": 2048}),
    ("llama-mha", "reference", {"finetune": "lora", "attention": "eager",
                                "recompute": "selective", "lora_targets": "q,k,v,o"}),
    ("llama-gqa", "reference", {"finetune": "qlora", "recompute": "full", "lora_rank": 64,
                                "optimizer": "paged-adamw-8bit", "lora_targets": "all-linear"}),
    ("llama-gqa", "reference", {"finetune": "dora"}),
    ("gpt2", "reference", {"finetune": "lora", "lora_targets": "all-linear"}),
    ("moe-shared", "reference", {"finetune": "qlora", "lora_targets": "all-linear"}),
    ("llama-gqa", "hf", {"finetune": "lora"}),
    ("llama-gqa", "hf", {"finetune": "qlora", "lora_targets": "all-linear",
                         "optimizer": "adamw-8bit"}),
    ("llama-deep", "hf", {"finetune": "lora", "lora_targets": "all-linear",
                          "lora_dropout": 0.05}),
    ("llama-gqa", "hf", {"finetune": "dora", "lora_targets": "all-linear"}),
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "amp-bf16", "recompute": "full"}),
    ("llama-gqa", "hf", {"finetune": "qlora", "attention": "eager", "optimizer": "paged-adamw"}),
    ("moe", "hf", {"finetune": "qlora"}),
    # fused projections under PEFT: GPT-2's c_attn (Conv1D), Phi-3's qkv_proj / gate_up_proj
    ("gpt2", "hf", {"finetune": "lora"}),
    ("gpt2", "hf", {"finetune": "lora", "lora_targets": "all-linear", "lora_dropout": 0.1,
                    "attention": "eager"}),
    ("phi3-fused", "hf", {"finetune": "lora"}),
    ("phi3-fused", "hf", {"finetune": "qlora", "lora_targets": "all-linear"}),
    ("phi3-fused", "hf", {"finetune": "lora", "lora_targets": "q,k,v,o,gate,up",
                          "precision": "amp-bf16", "recompute": "selective"}),
    ("phi3-fused", "hf", {"finetune": "dora", "lora_targets": "k,up"}),
    # chunked cross entropy and activation offload (vramcalc/terms/lowmem.py)
    ("llama-deep", "reference", {"chunked_ce": 16, "seq_len": 2048}),
    ("llama-gqa", "reference", {"chunked_ce": 4, "precision": "amp-bf16"}),
    ("llama-gqa", "hf", {"finetune": "lora", "chunked_ce": 8, "lora_targets": "all-linear"}),
    ("llama-deep", "reference", {"activation_offload": True, "seq_len": 2048}),
    ("llama-deep", "reference", {"finetune": "qlora", "activation_offload": True,
                                 "lora_targets": "all-linear", "seq_len": 2048}),
    ("llama-gqa", "hf", {"finetune": "lora", "activation_offload": True, "lora_dropout": 0.1}),
    ("llama-mha", "reference", {"finetune": "lora", "activation_offload": True,
                                "attention": "eager", "chunked_ce": 4}),
)


# FSDP2 (vramcalc/trace/distributed.py): (shape, framework, world, training options). The
# small-vocabulary shape puts the peak in the layers' backward, where the gathered block,
# the prefetched next block and the adapters' reduce-scatter count; QLoRA gathers packed
# 4-bit weights (vramcalc.finetune.gathered_layer_bytes).
FSDP_CASES: tuple[tuple[str, str, int, dict[str, Any]], ...] = (
    ("llama-deep", "reference", 4, {"finetune": "qlora", "precision": "bf16",
                                    "lora_targets": "all-linear"}),
    ("llama-deep", "hf", 2, {"finetune": "qlora", "precision": "bf16"}),
    ("llama-deep", "reference", 2, {"finetune": "qlora", "precision": "amp-bf16"}),
    ("llama-deep", "reference", 4, {"finetune": "lora", "precision": "amp-bf16",
                                    "lora_targets": "all-linear"}),
    ("llama-gqa", "hf", 2, {"finetune": "lora"}),
)


def finetune_grid() -> list[tuple[str, Scenario]]:
    """(name, scenario) pairs of the fine-tuning cases above (FSDP2 ones included)."""
    from vramcalc.validate import _scn

    cases = [(shape, fw, 1, kw) for shape, fw, kw in CASES] + list(FSDP_CASES)
    out = []
    for shape, framework, world, kw in cases:
        name, scn = _scn(shape, framework=framework, **kw)
        if world > 1:
            scn = scn.model_copy(update={"parallel": ParallelConfig(dp=world, fsdp="full")})
            name += f"/fsdp-full{world}"
        tr = scn.training
        tag = tr.finetune
        if tr.finetune != "full":
            tag += f"-r{tr.lora_rank}-{tr.lora_targets.replace(',', '')}"
        if tr.lora_dropout:
            tag += f"-p{tr.lora_dropout:g}"
        if tr.chunked_ce > 1:
            tag += f"-ce{tr.chunked_ce}"
        if tr.activation_offload:
            tag += "-offload"
        out.append((f"{name}/{tag}", scn))
    return out
