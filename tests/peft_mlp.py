"""A transformers LlamaMLP (hidden 64, intermediate 96, bf16) under PEFT LoRA r4, for tests
that watch what torch saves or runs through a real adapted MLP on the CPU."""

from __future__ import annotations

from typing import Any

import pytest


def peft_llama_mlp(targets: list[str], fp32_adapters: bool = False) -> Any:
    """The adapted MLP module (`model.base_model.model.mlp`): PEFT's default fp32 adapters
    (`autocast_adapter_dtype=True`) or adapters in the model's bf16."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x)

    model = peft.get_peft_model(Wrapper().to(torch.bfloat16),
                                peft.LoraConfig(r=4, target_modules=targets),
                                autocast_adapter_dtype=fp32_adapters)
    return model.base_model.model.mlp
