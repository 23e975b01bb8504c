"""Optimizers the trace engine runs, and the mixed-precision wrapper.

- torch.optim SGD (with and without momentum), Adam, AdamW, Adafactor: `foreach=True`,
  PyTorch's default on CUDA (`_default_to_fused_or_foreach`), or the scenario's
  `step_impl`: `fused=True` or the per-parameter loop (`foreach=False`).
- `TransformersAdamW`: transformers' own AdamW (HF Trainer's `adamw_hf`), a Python loop
  over the parameters, written from transformers v4.31.0 src/transformers/optimization.py
  `AdamW.step` (the class is gone from transformers 5.x, so it cannot be imported).
- `Lion` (Chen et al. 2023, Alg. 2): a small foreach implementation; its step allocates one
  state-sized update direction per parameter, all at once.
- `AdamW8bitStandIn`: bitsandbytes' AdamW8bit / PagedAdamW / PagedAdamW8bit storage layout
  (see the class) with an in-place update, as bitsandbytes' fused CUDA kernels do;
  bitsandbytes itself cannot run on fake tensors.
- `MixedPrecisionOptimizer`: 16-bit parameters with fp32 master copies. It allocates the
  masters once (4 bytes/param). At each step it replaces every 16-bit gradient by an fp32
  copy on its master (one tensor at a time: allocate fp32, free 16-bit), runs the inner
  optimizer on the masters, frees the fp32 gradients and copies the masters into the 16-bit
  parameters in place (no allocation).

Optimizer step counters: PyTorch keeps `state["step"]` on the host when neither
`capturable` nor `fused` is set (torch/optim/adam.py), so the tracker does not count them;
fused ones are 0-dim fp32 device tensors and are counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch.optim import Optimizer
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from vramcalc.terms.optimizer_states import BNB_BLOCK, BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL

QMAP_ENTRIES = 256  # bitsandbytes dynamic quantization map: 256 fp32 values (signed, unsigned)
LR = 1e-4


class TransformersAdamW(Optimizer):
    """transformers' AdamW step (see the module docstring): per parameter, both moments
    updated in place, `denom = sqrt(v) + eps` as one new tensor, then the update and the
    decoupled weight decay in place; the step count is a Python int."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = LR,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = v.sqrt().add_(group["eps"])  # the one new tensor per parameter
                size = group["lr"] * (1 - beta2 ** state["step"]) ** 0.5 / (
                    1 - beta1 ** state["step"])
                p.addcdiv_(m, denom, value=-size)
                p.add_(p, alpha=-group["lr"] * group["weight_decay"])


class Lion(Optimizer):
    """Lion: update = sign(β1·m + (1−β1)·g); m ← β2·m + (1−β2)·g (foreach)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = LR,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            beta1, beta2 = group["betas"]
            update = torch._foreach_mul(exp_avgs, beta1)  # one state-sized tensor per param
            torch._foreach_add_(update, grads, alpha=1 - beta1)
            torch._foreach_sign_(update)
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-group["lr"])
            del update
            torch._foreach_mul_(exp_avgs, beta2)
            torch._foreach_add_(exp_avgs, grads, alpha=1 - beta2)


def _unified(paged: bool) -> Any:
    """Where a paged state buffer is allocated: bitsandbytes' get_paged (cudaMallocManaged),
    outside the caching allocator, so the active MemoryTracker neither counts it nor
    replays it (a plain allocation when not paged or not traced)."""
    if paged:
        for mode in _get_current_dispatch_mode_stack():
            if hasattr(mode, "host_allocations"):
                return mode.host_allocations()
    return contextlib.nullcontext()


class AdamW8bitStandIn(Optimizer):
    """bitsandbytes AdamW (8-bit, paged) device storage with an in-place (fused) update.

    Per tensor of n elements (optim/optimizer.py Optimizer2State.init_state): 8-bit when
    n >= BNB_MIN_8BIT_SIZE (two uint8 states + two fp32 absmax per BNB_BLOCK elements; the
    first such tensor moves the two shared 256-entry fp32 quantization maps to the device),
    else two fp32 states. Paged variants allocate the state buffers (not the absmax) of
    tensors with n >= BNB_PAGED_MIN_NUMEL in CUDA unified memory, outside the caching
    allocator: `paged_states` lists them so the tracker leaves them out.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = LR,
                 weight_decay: float = 0.01, eight_bit: bool = True,
                 paged: bool = False) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.eight_bit, self.paged = eight_bit, paged
        self.qmaps: list[torch.Tensor] = []
        self.paged_states: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    n = p.numel()
                    if self.eight_bit and n >= BNB_MIN_8BIT_SIZE:
                        if not self.qmaps:  # "dynamic" and "udynamic", shared by all params
                            self.qmaps = [torch.zeros(QMAP_ENTRIES, device=p.device)
                                          for _ in range(2)]
                        blocks = -(-n // BNB_BLOCK)
                        with _unified(self.paged and n >= BNB_PAGED_MIN_NUMEL):
                            state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                            state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, device=p.device)
                        state["absmax2"] = torch.zeros(blocks, device=p.device)
                        state["qmap1"], state["qmap2"] = self.qmaps
                    else:
                        with _unified(self.paged and n >= BNB_PAGED_MIN_NUMEL):
                            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                    if self.paged and n >= BNB_PAGED_MIN_NUMEL:
                        self.paged_states += [state["state1"], state["state2"]]
                # the fused kernel reads and writes these in place: no temporaries
                state["state1"].add_(1)
                state["state2"].add_(1)
                for key in ("absmax1", "absmax2"):
                    if key in state:
                        state[key].mul_(1.0)
                p.add_(p.grad, alpha=-group["lr"])


class MixedPrecisionOptimizer:
    """16-bit params + fp32 masters; the inner optimizer steps the masters (see module doc)."""

    def __init__(self, params: Iterable[torch.Tensor],
                 make_inner: Callable[[Sequence[torch.Tensor]], Optimizer]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        for p, m in zip(self.params, self.masters, strict=True):
            setattr(m, "vramcalc_muon", getattr(p, "vramcalc_muon", False))  # noqa: B010
        self.inner = make_inner(self.masters)

    @property
    def state(self):  # noqa: ANN201
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is not None:
                m.grad = p.grad.float()  # fp32 copy, then the 16-bit gradient goes
                p.grad = None
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()


def make_optimizer(name: str, params: Sequence[torch.Tensor], impl: str = "foreach"
                   ) -> Optimizer:
    """A torch optimizer (or stand-in) by vramcalc's optimizer name, stepping with `impl`:
    foreach (PyTorch's default on CUDA), fused or the per-parameter loop."""
    foreach, fused = impl == "foreach", impl == "fused"
    if impl == "hf-loop" and name == "adamw":
        return TransformersAdamW(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, foreach=foreach, fused=fused)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=foreach, fused=fused)
    if name == "adam":
        return torch.optim.Adam(params, lr=LR, foreach=foreach, fused=fused)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=foreach,
                                 fused=fused)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2, foreach=True)
    if name == "lion":
        return Lion(params)
    if name == "muon":
        return cast(Optimizer, MuonWithAdamW(params, foreach, fused))  # its duck type
    if name in ("adamw-8bit", "paged-adamw", "paged-adamw-8bit"):
        return AdamW8bitStandIn(params, eight_bit=name.endswith("8bit"),
                                paged=name.startswith("paged-"))
    raise ValueError(f"unknown optimizer {name!r}")


class MuonWithAdamW:
    """torch.optim.Muon (torch 2.9+) on the parameters the engine flags `vramcalc_muon` (the
    layers' matrices), torch's AdamW on the rest, stepped one after the other."""

    def __init__(self, params: Sequence[torch.Tensor], foreach: bool, fused: bool) -> None:
        mats = [p for p in params if getattr(p, "vramcalc_muon", False)]
        rest = [p for p in params if not getattr(p, "vramcalc_muon", False)]
        self.optimizers: list[Optimizer] = [torch.optim.Muon(mats, lr=LR)] if mats else []
        if rest:
            self.optimizers.append(torch.optim.AdamW(rest, lr=LR, weight_decay=0.01,
                                                     foreach=foreach, fused=fused))

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for opt in self.optimizers for k, v in opt.state.items()}

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def build_optimizer(name: str, params: list[torch.Tensor], master_weights: bool,  # noqa: ANN201
                    impl: str = "foreach"):
    """The optimizer the engine steps: wrapped with fp32 masters for bf16/fp16 policies."""
    if master_weights:
        return MixedPrecisionOptimizer(params, lambda ms: make_optimizer(name, ms, impl))
    return make_optimizer(name, params, impl)


class InBackward:
    """torchtune's optimizer in backward (written from pytorch/torchtune bd2a0fc
    torchtune/modules/optim.py `OptimizerInBackward`, torchtune/training/memory.py
    `register_optim_in_bwd_hooks`): one optimizer per trained parameter, and a
    post-accumulate-grad hook on each that steps it and sets the gradient to None as soon
    as autograd has accumulated it. `step` is then a no-op (the recipe still calls it);
    `on_step(p, opt)` runs after each parameter's step (the engine labels its states)."""

    def __init__(self, params: Sequence[torch.Tensor], make: Callable[[list[torch.Tensor]], Optimizer],
                 on_step: Callable[[torch.Tensor, Optimizer], None]) -> None:
        self.optimizers = [make([p]) for p in params]
        for p, opt in zip(params, self.optimizers, strict=True):
            def hook(param: torch.Tensor, opt: Optimizer = opt) -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)
                on_step(param, opt)

            p.register_post_accumulate_grad_hook(hook)

    def step(self) -> None:
        """Every parameter was stepped inside backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def optimizer_state_tensors(opt) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
    """(device state tensors incl. fp32 masters, host step counters) of an optimizer."""
    device: list[torch.Tensor] = []
    host: list[torch.Tensor] = []
    if isinstance(opt, InBackward):
        for one in opt.optimizers:
            d, h = optimizer_state_tensors(one)
            device += d
            host += h
        return device, host
    if isinstance(opt, MixedPrecisionOptimizer):
        device += opt.masters
        inner = opt.inner
    else:
        inner = opt
    paged = {id(t) for t in getattr(inner, "paged_states", [])}
    # step counts stay on the host unless the optimizer is fused (or capturable)
    on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
    for st in inner.state.values():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                host_side = (key == "step" and not on_device) or id(val) in paged
                (host if host_side else device).append(val)
    if isinstance(inner, AdamW8bitStandIn):
        device += inner.qmaps
    return device, host
