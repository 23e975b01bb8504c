"""LoRA, QLoRA and DoRA on the traced models (vramcalc/finetune.py says what is modelled).

`apply_finetune(model, scn)` turns the model `vramcalc.trace.engine.build_model` made into
the fine-tuning one, inside the trace's FakeTensorMode:

- every base parameter is frozen (`requires_grad_(False)`);
- QLoRA: every linear inside the transformer layers (attention projections, MLP, expert and
  shared-expert matrices; not the router, not lm_head) becomes `vramcalc.trace.nf4.NF4Linear`,
  bitsandbytes' Linear4bit storage layout, computing in the policy's compute dtype
  (`bnb_4bit_compute_dtype`);
- reference profile: each targeted linear is wrapped in `LoRALinear` (adapters in the
  policy's weight dtype; y = base(x) + B(A(dropout(x)))·α/r, PEFT's formula without its
  input cast; DoRA as PEFT's DoraLinearLayer);
- hf profile: `peft.get_peft_model(model, LoraConfig(r, target_modules, lora_dropout,
  use_dora))` with PEFT's defaults (adapters upcast to fp32, inputs cast to the adapter
  dtype). For QLoRA the NF4 layers are put in first, as bitsandbytes' loader does, so PEFT
  wraps 4-bit bases (it keeps fp32 adapters next to a uint8 weight). With `kbit_prepare`
  the model is built in the compute dtype, as a 4-bit load leaves it, and PEFT's own
  `prepare_model_for_kbit_training` runs before `get_peft_model`.

torch (and peft for the hf profile) are imported only when a trace runs.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vramcalc.errors import InputError, one_line, shown_path
from vramcalc.finetune import adapted_linears, fused_family, targeted_linears
from vramcalc.peft_file import peft_config_path, peft_type_of, read_peft_config
from vramcalc.peft_moe import adapts_shared_expert_gate, moe_family, wrapped_parameters
from vramcalc.trace.nf4 import NF4Linear

LORA_ALPHA = 16  # changes values only (scaling α/r), not memory
_PEFT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
               "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# transformers' module names in the fused families: GPT-2 (Conv1D c_attn, attn.c_proj, c_fc,
# mlp.c_proj) and Phi-3 (qkv_proj, o_proj, gate_up_proj, down_proj)
_PEFT_NAMES_FUSED = {
    "gpt2": {"qkv": "c_attn", "o": "attn.c_proj", "up": "c_fc", "down": "mlp.c_proj"},
    "phi3": {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"},
}
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CudaDropout(nn.Module):
    """Dropout as CUDA runs it: `native_dropout`, keeping a bool mask for backward. On the
    CPU `F.dropout` takes a composite path that keeps a mask in the input's dtype."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return torch.native_dropout(x, self.p, True)[0]


class LoRALinear(nn.Module):
    """A frozen base linear plus trained adapters A (r × in) and B (out × r)."""

    def __init__(self, base: nn.Linear, rank: int, dropout: float, dtype: torch.dtype,
                 dora: bool = False) -> None:
        super().__init__()
        self.base = base
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout: nn.Module = CudaDropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = LORA_ALPHA / rank
        self.magnitude = (nn.Parameter(torch.ones(base.out_features, device=dev, dtype=dtype))
                          if dora else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.magnitude is None:
            return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling
        # PEFT's Linear.forward casts the sum back to the base output's dtype
        # (`result.to(torch_result_dtype)`): an fp32 magnitude under autocast promotes it
        return (y + self._dora(self.dropout(x), y)).to(y.dtype)

    def _dora(self, x: torch.Tensor, base_result: torch.Tensor) -> torch.Tensor:
        """PEFT DoraLinearLayer.forward (peft 0.21.2 tuners/lora/dora.py), dropout-free form."""
        lora_weight = self._lora_weight()  # (out, in)
        weight = self._base_weight(x.dtype)
        norm = torch.linalg.norm(weight + self.scaling * lora_weight.detach().to(x.dtype), dim=1)
        norm = norm.to(weight.dtype).detach()  # (out,): treated as a constant (DoRA Sec. 4.3)
        scale = (self.magnitude / norm).view(1, -1)
        lora_result = self.lora_B(self.lora_A(x))
        return (scale - 1) * base_result + scale * lora_result * self.scaling

    def _lora_weight(self) -> torch.Tensor:
        """PEFT `DoraLinearLayer.get_lora_weight`: the adapters applied to torch.eye(in),
        a local of this call (the graph keeps it only where lora_A saves its input)."""
        a_w = self.lora_A.weight
        eye = torch.eye(a_w.shape[1], device=a_w.device, dtype=a_w.dtype)  # (in, in)
        return self.lora_B(self.lora_A(eye)).T

    def _base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(self.base, NF4Linear):
            return self.base.new_weight(dtype)
        return self.base.weight.to(dtype)


def _linears(block: nn.Module) -> list[tuple[nn.Module, str, str | None]]:
    """(parent, attribute, target letter or None) of every linear in a reference block that
    QLoRA quantizes; the target letter says which --lora-targets name adapts it."""
    out: list[tuple[nn.Module, str, str | None]] = []
    attn: Any = block.attn  # the reference Attention (q/k/v/o_proj)
    for t in ("q", "k", "v", "o"):
        out.append((attn, f"{t}_proj", t))
    mlp: Any = block.mlp  # the reference MLP, or MoE (experts, shared_experts)

    def dense(m: nn.Module, targeted: bool) -> None:
        for attr, t in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"),
                        ("fc", "up"), ("proj", "down")):
            if isinstance(getattr(m, attr, None), nn.Linear):
                out.append((m, attr, t if targeted else None))

    if hasattr(mlp, "experts"):  # MoE: routed experts frozen, shared experts adaptable
        for e in mlp.experts:
            dense(e, False)
        for sh in mlp.shared_experts:
            dense(sh, True)
    else:
        dense(mlp, True)
    return out


def _reference(model: nn.Module, scn: Any) -> nn.Module:
    tr = scn.training
    wanted = set(targeted_linears(scn.model, tr.lora_targets))
    a_dtype = _TORCH[tr.weight_dtype]
    compute = _TORCH[tr.compute_dtype]
    for p in model.parameters():
        p.requires_grad_(False)
    layers: Any = model.layers  # the reference model's blocks (an nn.ModuleList)
    for block in layers:
        for parent, attr, target in _linears(block):
            lin = getattr(parent, attr)
            if tr.finetune == "qlora":
                lin = NF4Linear.from_linear(lin, compute, tr.nf4)
            if target in wanted:
                lin = LoRALinear(lin, tr.lora_rank, tr.lora_dropout, a_dtype,
                                 dora=tr.finetune == "dora")
            setattr(parent, attr, lin)
    return model


@contextlib.contextmanager
def _fake_module_casts() -> Iterator[None]:
    """Let `module.to(dtype)` work on fake parameters while PEFT builds its layers.

    nn.Module._apply swaps a FakeTensor parameter with its converted copy
    (`torch.utils.swap_tensors`), which refuses tensors FakeTensorMode holds weak references
    to; re-pointing the parameter at the new storage (`param.data = new`) is what _apply did
    before the swap path and leaves the same storages alive."""
    original = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            original(t1, t2)
        except RuntimeError:
            with torch.no_grad():
                t1.data = t2.data

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def _fake_deepcopies() -> Iterator[None]:
    """Let PEFT copy a module of fake parameters.

    `copy.deepcopy` of a FakeTensor makes it in a new FakeTensorMode, which the trace's mode
    refuses to mix with; seeding deepcopy's memo with a fresh `empty_like` of each parameter
    and buffer (made in the active mode) copies the module with storages of the same sizes
    and dtypes, which is all the trace counts. PEFT copies through `copy.deepcopy`
    (peft 0.21.2 utils/other.py `ModulesToSaveWrapper.update`) or a `deepcopy` it imported
    (tuners/ln_tuning/layer.py `LNTuningLayer.update_layer`): both names are re-pointed in
    every loaded peft module while PEFT builds its layers."""
    import sys
    import types

    def deepcopy(obj: Any, memo: dict[int, Any] | None = None) -> Any:
        memo = {} if memo is None else memo
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                memo[id(p)] = nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
            for b in obj.buffers():
                memo[id(b)] = torch.empty_like(b)
        return copy.deepcopy(obj, memo)

    shim = types.SimpleNamespace(deepcopy=deepcopy, copy=copy.copy)
    saved: list[tuple[Any, str, Any]] = []
    for name, mod in list(sys.modules.items()):
        if name == "peft" or name.startswith("peft."):
            for attr, new in (("copy", shim), ("deepcopy", deepcopy)):
                old = getattr(mod, attr, None)
                if old is copy or old is copy.deepcopy:
                    saved.append((mod, attr, old))
                    setattr(mod, attr, new)
    try:
        yield
    finally:
        for mod, attr, old in saved:
            setattr(mod, attr, old)


def _hf(model: nn.Module, scn: Any) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:  # pragma: no cover - peft is a test dependency
        raise InputError("tracing LoRA with the hf profile needs peft: pip install peft") from None
    tr = scn.training
    if tr.finetune == "qlora":
        compute = _TORCH[tr.compute_dtype]
        from transformers.pytorch_utils import Conv1D

        causal: Any = model  # a transformers causal LM: duck-typed
        decoder = causal.get_decoder()
        layers = decoder.layers if hasattr(decoder, "layers") else decoder.h  # GPT-2: h
        for layer in layers:
            for name, mod in list(layer.named_modules()):
                if name.rsplit(".", 1)[-1] in ("router", "gate", "shared_expert_gate"):
                    continue
                if isinstance(mod, Conv1D) or (isinstance(mod, nn.Linear)
                                                and not isinstance(mod, NF4Linear)):
                    parent = (layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name
                              else layer)
                    setattr(parent, name.rsplit(".", 1)[-1],
                            NF4Linear.from_linear(mod, compute, tr.nf4))
    if tr.kbit_prepare:
        # PEFT's own preparation (peft 0.21.2 utils/other.py prepare_model_for_kbit_training):
        # freezes everything, casts the 16-bit parameters to fp32 (the NF4 codes are uint8),
        # enables input grads and gradient checkpointing (kwargs {}: torch's reentrant default)
        from peft import prepare_model_for_kbit_training

        model.is_loaded_in_4bit = True  # type: ignore[assignment]  # as a 4-bit load sets it
        with _fake_module_casts():
            model = prepare_model_for_kbit_training(model)
    # module names PEFT matches (a suffix after a dot); fused families adapt the fused module
    fam = fused_family(scn.model, "hf")
    names = _PEFT_NAMES_FUSED.get(fam or "", _PEFT_NAMES)
    targets: Any = [names[t] for t in adapted_linears(scn.model, tr.lora_targets, "hf")]
    wrapped = wrapped_parameters(scn.model, "hf", tr.finetune, tr.lora_targets,
                                 tr.transformers_version)
    if wrapped and tr.lora_targets != "all-linear":
        # the names asked for, also where no dense layer or shared expert has the module:
        # PEFT moves them to the experts' parameters (vramcalc/peft_moe.py)
        targets += [names[t] for t in tr.lora_targets.split(",")
                    if t in ("gate", "up", "down") and names[t] not in targets]
    if adapts_shared_expert_gate(scn.model, "hf", tr.finetune, tr.lora_targets):
        targets.append("shared_expert_gate")  # what PEFT's "all-linear" resolves to there
    if "router" in wrapped:
        # PEFT resolves "all-linear" itself on a MoE model it converts (vramcalc/peft_moe.py):
        # the attention linears, the experts' fused parameters and the router; with extra
        # modules, the list it would resolve to (its nn.Linear names and the old expert and
        # router names, peft 0.21.2 `_resolve_string_target_modules`)
        old = ["w1", "w2", "w3", "gate"] if moe_family(scn.model) == "mixtral" else ["gate"]
        targets = targets + old if tr.lora_embedding or tr.lora_head else "all-linear"
    if tr.lora_embedding:
        targets.append("embed_tokens")
    if tr.lora_head:
        targets.append("lm_head")
    cfg = LoraConfig(r=tr.lora_rank, lora_alpha=LORA_ALPHA, target_modules=targets,
                     lora_dropout=tr.lora_dropout, bias="none", use_dora=tr.finetune == "dora",
                     task_type="CAUSAL_LM",
                     modules_to_save=tr.modules_to_save.split(",") if tr.modules_to_save else None)
    with _fake_module_casts(), _fake_deepcopies():
        model = get_peft_model(model, cfg, autocast_adapter_dtype=not tr.adapters_16bit)
    if tr.adapters_16bit:
        # TRL's SFTTrainer on a quantized model (huggingface/trl f2cd5771 sft_trainer.py):
        # every trained parameter to bf16; PEFT made a 4-bit linear's adapters in fp32
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(_TORCH[tr.weight_dtype])
    return _cuda_dropouts(model)


def _cuda_dropouts(model: nn.Module) -> nn.Module:
    """PEFT's adapter dropouts (`lora_dropout`, `vera_dropout`, ...: ModuleDicts by adapter
    name) as CUDA's kernel runs them (`CudaDropout`)."""
    for mod in list(model.modules()):
        if isinstance(mod, nn.ModuleDict):
            for key, d in list(mod.items()):
                if type(d) is nn.Dropout:
                    mod[key] = CudaDropout(d.p)
    return model


def peft_from_file(model: nn.Module, scn: Any) -> nn.Module:
    """--peft-config: PEFT's `get_peft_model` with the file's config, whatever the method
    (vramcalc/peft_file.py). PEFT's defaults hold (`autocast_adapter_dtype=True`: 16-bit
    adapter weights upcast to fp32)."""
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError:  # pragma: no cover - peft is a test dependency
        raise InputError("--peft-config needs peft: pip install peft") from None
    path = scn.training.peft_config
    doc = read_peft_config(path)
    where = f"--peft-config {shown_path(str(peft_config_path(path)))}"
    try:
        cfg = PeftConfig.from_peft_type(**doc)
    except KeyError:
        raise InputError(f"{where}: PEFT has no method peft_type "
                         f"{shown_path(str(doc['peft_type']))}") from None
    except ImportError as err:  # a method's own dependency (AdaMSS: scikit-learn)
        raise InputError(f"{where}: PEFT needs a package for it: {one_line(str(err))}") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise InputError(f"{where}: PEFT does not accept it: {one_line(str(err))}") from None
    try:
        with _fake_module_casts(), _fake_deepcopies(), peft_trace_limits(scn.training):
            model = get_peft_model(model, cfg)
    except InputError:  # peft_trace_limits' own
        raise
    except ImportError as err:
        raise InputError(f"{where}: PEFT needs a package for it: {one_line(str(err))}") from None
    except (TypeError, ValueError, KeyError, AttributeError, NotImplementedError) as err:
        raise InputError(f"{where}: PEFT cannot apply it to {scn.model.name}: "
                         f"{one_line(str(err))}") from None
    return _cuda_dropouts(model)


@contextlib.contextmanager
def peft_trace_limits(tr: Any) -> Iterator[None]:
    """A PEFT method whose forward needs tensor values (data-dependent shapes, such as
    `nonzero`), which a fake-tensor trace has none of: one clear error instead of torch's."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        if tr.finetune != "peft":
            raise
        raise InputError(f"--peft-config: PEFT's {peft_type_of(tr.peft_config)} computes "
                         f"shapes from tensor values ({err.func}), which a fake-tensor trace "
                         "has none of: it cannot be measured without a GPU (vramcalc probe "
                         "--run measures a real step)") from None
    except RuntimeError as err:  # a method's own check of tensor values (VB-LoRA's isinf)
        if tr.finetune != "peft":
            raise
        raise InputError(f"--peft-config: PEFT's {peft_type_of(tr.peft_config)} could not "
                         f"run on fake tensors, which hold no values: {one_line(str(err))}"
                         ) from None


def apply_finetune(model: nn.Module, scn: Any) -> nn.Module:
    """The fine-tuning model for `scn.training.finetune` (see the module docstring)."""
    if scn.training.finetune == "full":
        return model
    if scn.training.finetune == "peft":
        return peft_from_file(model, scn)
    if scn.training.framework == "hf":
        return _hf(model, scn)
    return _reference(model, scn)
