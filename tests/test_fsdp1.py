"""FSDP1 flat parameters (`--fsdp-impl fsdp1`) and the lightning profile's FSDP default.

The mechanism is checked against torch's own FullyShardedDataParallel, run for real on the
CPU with a fake process group of two ranks (torch's testing backend): a unit that mixes
frozen and trained parameters gets a gradient of its whole flat parameter, unsharded inside
`no_sync()` and one shard after a synchronising backward; its frozen linears keep their
inputs. The byte counts of vramcalc/terms/fsdp1.py are then pinned by hand for Llama-2-7B:

- Llama-2-7B block (h = 4096, f = 11008, a = g = 32, RMSNorm, no biases): q, k, v, o
  4·4096² = 67,108,864; gate, up, down 3·4096·11008 = 135,266,304; two norms 2·4096
  = 8,192: 202,383,360. LoRA r = 8 on q and v (LitGPT's LoRAQKVLinear: A (2r, h), B
  (2h, r) = PEFT's two adapters' 2·(8·4096 + 4096·8)): 131,072. A flat block: 202,514,432.
- Sources: torch/distributed/fsdp/_flat_param.py `_validate_tensors_to_flatten` (requires
  grad = OR over the tensors), `_use_unsharded_views(as_params=False)`; _runtime_utils.py
  `_post_backward_hook` (`if not state._sync_gradients: ... return` before reduce-scatter);
  Lightning 2.1.0.rc0 fabric/strategies/fsdp.py (`use_orig_params` True, `no_backward_sync`
  = `module.no_sync()`); LitGPT 8641822 finetune/lora.py (`fabric.no_backward_sync` while
  accumulating).
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from vramcalc.cli import app, main
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms import comm, fsdp1
from vramcalc.terms.gradients import gradients_at_step_bytes, gradients_bytes

BLOCK = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
LORA_QV = 2 * (8 * 4096 + 4096 * 8)
LAYERS = 32


def _alloc(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def _ctx(**kw: object) -> RankContext:
    values: dict[str, object] = {
        "model": "llama2-7b", "gpus": "2xA100-40GB", "precision": "bf16-pure",
        "finetune": "lora", "lora_targets": "q,v", "fsdp": "full", "seq_len": 1304,
        "recompute": "full"}
    values.update(kw)
    scn = build_scenario(values).resolved()
    return RankContext(scn.model, scn.training, scn.parallel, 0)


def test_real_fsdp1_mixed_unit_gets_whole_flat_gradient() -> None:
    torch = pytest.importorskip("torch")
    import warnings

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from vramcalc.trace.distributed import fake_process_group

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(16, 32, bias=False)  # frozen, 512
            self.down = nn.Linear(32, 16, bias=False)  # frozen, 512
            self.lora_a = nn.Linear(16, 2, bias=False)  # trained, 32

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x))) + self.lora_a(x).sum(-1, keepdim=True)

    unit = 16 * 32 * 2 + 2 * 16
    model = nn.Sequential(Block(), Block())
    for name, p in model.named_parameters():
        p.requires_grad_("lora" in name)
    saved: list[tuple[int, ...]] = []
    with fake_process_group(2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fsdp = FSDP(model, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({Block}),
                    device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD)
        blocks = [m for m in fsdp.modules() if isinstance(m, FSDP) and m is not fsdp]
        x = torch.randn(4, 16)
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
            with fsdp.no_sync():
                fsdp(x).sum().backward()
        unsharded = [b._handle.flat_param.grad.numel() for b in blocks]
        fsdp(x).sum().backward()
        sharded = [b._handle.flat_param.grad.numel() for b in blocks]
    assert len(blocks) == 2
    assert unsharded == [unit, unit]  # the frozen up/down included, not just lora_a's 32
    assert sharded == [math.ceil(unit / 2)] * 2
    # the frozen `up` keeps its input (4, 16) and `down` the relu output (4, 32): autograd
    # computes their weight gradients (a frozen nn.Linear outside FSDP would keep neither)
    assert saved.count((4, 32)) >= 2


def test_lightning_fsdp1_lora_gradients_hand_derived() -> None:
    ctx = _ctx(framework="lightning", grad_accum=128)
    assert fsdp1.flat(ctx) and fsdp1.no_sync(ctx) and fsdp1.mixed_units(ctx)
    assert fsdp1.block_numel(ctx) == BLOCK + LORA_QV
    # no_sync: every block's whole flat gradient, unsharded, bf16
    assert gradients_bytes(ctx) == LAYERS * _alloc((BLOCK + LORA_QV) * 2)
    # the last micro-batch reduce-scatters them: one shard of each for the step
    assert gradients_at_step_bytes(ctx) == LAYERS * _alloc(math.ceil((BLOCK + LORA_QV) / 2) * 2)


def test_fsdp1_without_accumulation_and_fsdp2() -> None:
    one = _ctx(framework="lightning", grad_accum=1)
    assert not fsdp1.no_sync(one)
    assert gradients_bytes(one) == LAYERS * _alloc(math.ceil((BLOCK + LORA_QV) / 2) * 2)
    # the reference profile reduces every micro-batch (its loop is not LitGPT's)
    ref = _ctx(fsdp_impl="fsdp1", grad_accum=128)
    assert fsdp1.flat(ref) and not fsdp1.no_sync(ref)
    assert gradients_bytes(ref) == gradients_bytes(one)
    # FSDP2 (the default elsewhere, or asked for): the adapters' gradients only
    for ctx in (_ctx(grad_accum=128), _ctx(framework="lightning", fsdp_impl="fsdp2")):
        assert not fsdp1.flat(ctx)
        assert gradients_bytes(ctx) < LAYERS * _alloc(LORA_QV * 2)


def test_fsdp1_full_finetune_root_unit() -> None:
    """Full training: the root unit (embedding, final norm, head: 2·32000·4096 + 4096)
    gets its gradient too."""
    ctx = _ctx(finetune="full", fsdp_impl="fsdp1", grad_accum=1)
    root = 2 * 32000 * 4096 + 4096
    assert fsdp1.root_numel(ctx) == root
    assert gradients_bytes(ctx) == (LAYERS * _alloc(math.ceil(BLOCK / 2) * 2)
                                    + _alloc(math.ceil(root / 2) * 2))


def test_fsdp1_keeps_frozen_linear_inputs() -> None:
    """Under FSDP1 the LoRA layer keeps full training's inputs (q/k/v and MLP inputs)."""
    from vramcalc.terms.activations import layer_saved

    names = {t.name for t in layer_saved(_ctx(fsdp_impl="fsdp1", recompute="none"))}
    assert {"attn.input", "mlp.input", "mlp.down_input"} <= names
    names2 = {t.name for t in layer_saved(_ctx(recompute="none"))}
    assert not {"mlp.input", "mlp.down_input"} & names2  # q/v adapters share attn.input


@pytest.mark.parametrize("args, needle", [
    (["--fsdp", "full", "--fsdp-impl", "fsdp1", "--finetune", "qlora"], "qlora"),
    (["--fsdp", "full", "--fsdp-impl", "fsdp1", "--tp", "2"], "data parallelism alone"),
    (["--framework", "lightning", "--chunked-ce", "4"], "chunks its head"),
    (["--fsdp", "full", "--fsdp-impl", "fsdp3"], "unknown value"),
])
def test_cli_errors(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "llama2-7b", "--gpus", "4xA100", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def test_cli_lightning_record() -> None:
    """The LitGPT resource-table run (2 x A100, Llama-2-7B LoRA, FSDP, AC per block, 128
    accumulation steps) is dominated by the unsharded bf16 gradients of all 32 blocks."""
    res = CliRunner().invoke(app, [
        "estimate", "--model", "llama2-7b", "--gpus", "2xA100-40GB", "--framework",
        "lightning", "--fsdp", "full", "--precision", "bf16-pure", "--recompute", "full",
        "--finetune", "lora", "--lora-dropout", "0.05", "--seq-len", "1304", "--grad-accum",
        "128", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["terms"]["gradients"] == LAYERS * _alloc((BLOCK + LORA_QV) * 2)
    assert rep["peak_allocated_bytes"] > rep["terms"]["weights"] + rep["terms"]["gradients"]
    assert any(n.startswith("FSDP1 flat parameters") and "no_sync()" in n for n in rep["notes"])


def test_plan_with_fsdp1() -> None:
    """The planner shards its FSDP layouts with FSDP1 when asked, and never proposes FSDP1
    with tensor parallelism."""
    from vramcalc.cli.plan import prepare_plan
    from vramcalc.planner import search

    base, req, _ = prepare_plan({"model": "llama2-7b", "gpus": "8xA100", "finetune": "lora",
                                 "seq_len": 1304, "fsdp_impl": "fsdp1", "fsdp": "full"},
                                top=50)
    res = search(base, req)
    sharded = [e for e in res.entries if e.scenario.parallel.fsdp != "none"]
    assert sharded
    for e in sharded:
        par = e.scenario.parallel
        assert par.tp == par.pp == par.cp == 1
        assert fsdp1.flat(RankContext(e.scenario.model, e.scenario.training, par, 0))


def _lora_fsdp_wrap_policy(block: type) -> object:
    """torchtune fef3ed10 torchtune/utils/_distributed.py `lora_fsdp_wrap_policy`, restated:
    a module whose `weight` requires grad (LoRA's A and B nn.Linear) is a unit of its own,
    then each block."""
    def policy(module: object, recurse: bool, **_: object) -> bool:
        if recurse:
            return True
        weight = getattr(module, "weight", None)
        if weight is not None and weight.requires_grad:
            return True
        return isinstance(module, block)
    return policy


def test_real_fsdp1_torchtune_wrap_policy_frozen_blocks() -> None:
    """torchtune's FSDP1 LoRA recipe (fef3ed10 recipes/lora_finetune_distributed.py
    `_setup_model`: FULL_SHARD, use_orig_params left False, lora_fsdp_wrap_policy) run for
    real: each block's flat parameter is frozen and gets no gradient, each LoRA matrix gets
    one shard of its own gradient, and a block's all-gathered parameters are freed once its
    backward is done (_runtime_utils.py `_register_post_backward_reshard_only_hook`: a
    multi-grad hook on the block's inputs), the next block's prefetched (BACKWARD_PRE); the
    first block, whose input needs no gradient, and the root wait for the end of backward."""
    torch = pytest.importorskip("torch")
    import warnings

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from vramcalc.trace.distributed import fake_process_group

    class LoRALinear(nn.Module):  # torchtune's: frozen weight + lora_b(lora_a(x))
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 16))
            self.lora_a = nn.Linear(16, 2, bias=False)  # 32
            self.lora_b = nn.Linear(2, 16, bias=False)  # 32

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight) + self.lora_b(self.lora_a(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = LoRALinear()
            self.up = nn.Linear(16, 32, bias=False)
            self.down = nn.Linear(32, 16, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.q(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 16)
            self.layers = nn.ModuleList(Block() for _ in range(3))
            self.out = nn.Linear(16, 10, bias=False)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            h = self.emb(t)
            for layer in self.layers:
                h = layer(h)
            return self.out(h)

    model = Model()
    for name, p in model.named_parameters():
        p.requires_grad_("lora" in name)
    seen: list[tuple[str, list[str]]] = []
    with fake_process_group(2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fsdp = FSDP(model, auto_wrap_policy=_lora_fsdp_wrap_policy(Block),
                    sharding_strategy=ShardingStrategy.FULL_SHARD,
                    device_id=torch.device("cpu"))
        units = {n.replace("_fsdp_wrapped_module.", "") or "root": m for n, m in
                 fsdp.named_modules() if isinstance(m, FSDP) and m._handle is not None}

        def alive() -> list[str]:
            return sorted(n for n, m in units.items() if "lora" not in n and
                          m._handle.flat_param._full_param_padded.untyped_storage().size())

        for i in range(3):
            units[f"layers.{i}"].register_full_backward_hook(
                lambda *_, i=i: seen.append((f"layers.{i}", alive())))
        fsdp(torch.randint(0, 10, (4, 8))).sum().backward()
        after = alive()
        frozen = {n: m._handle.flat_param for n, m in units.items() if "lora" not in n}
        lora = {n: m._handle.flat_param for n, m in units.items() if "lora" in n}
    # the block's unit: q's frozen weight, up, down (16·16 + 2·16·32 = 1280), no adapters
    assert frozen["layers.0"]._unpadded_unsharded_size.numel() == 16 * 16 + 2 * 16 * 32
    assert all(not p.requires_grad and p.grad is None for p in frozen.values())
    assert len(lora) == 6 and all(p.grad is not None and p.grad.numel() == 16 for p in
                                  lora.values())  # ceil(32 / 2)
    assert seen == [("layers.2", ["layers.1", "root"]), ("layers.1", ["layers.0", "root"]),
                    ("layers.0", ["layers.0", "root"])]
    assert after == []


def test_torchtune_fsdp1_lora_is_per_parameter_sharding() -> None:
    """Hand derivation for the README run (2 x RTX 4090, Llama-2-7B LoRA r8 on q, v): each
    of the 4·32 LoRA matrices (8·4096 = 32,768 elements) is a unit of its own, one shard of
    16,384 bf16 gradients each = 32,768 B (a multiple of 512): 128 · 32,768 = 4,194,304 B,
    and the blocks get none. Backward and the step are FSDP2's; forward is not (below)."""
    kw = {"framework": "torchtune", "gpus": "2xRTX4090", "seq_len": 512, "recompute": "none",
          "micro_batch_size": 2, "grad_accum": 32}
    one = _ctx(fsdp_impl="fsdp1", **kw)
    assert fsdp1.wrapped_adapters(one) and not fsdp1.flat(one) and not fsdp1.mixed_units(one)
    assert gradients_bytes(one) == 4 * LAYERS * 16384 * 2 == 4_194_304
    lightning = _ctx(framework="lightning", fsdp_impl="fsdp1", grad_accum=1)
    assert fsdp1.mixed_units(lightning) and not fsdp1.wrapped_adapters(lightning)
    full = _ctx(framework="torchtune", fsdp_impl="fsdp1", finetune="full")
    assert fsdp1.flat(full) and not fsdp1.wrapped_adapters(full)

    def report(impl: str) -> dict[str, object]:
        res = CliRunner().invoke(app, [
            "estimate", "--model", "llama2-7b", "--framework", "torchtune", "--gpus",
            "2xRTX4090", "--precision", "bf16-pure", "--recompute", "none", "--seq-len",
            "512", "--finetune", "lora", "--lora-targets", "q,v", "--fsdp", "full",
            "--fsdp-impl", impl, "--json"])
        assert res.exit_code == 0, res.output
        out: dict[str, object] = json.loads(res.output)
        return out

    r1, r2 = report("fsdp1"), report("fsdp2")
    phases1, phases2 = r1["phases"], r2["phases"]
    assert isinstance(phases1, dict) and isinstance(phases2, dict)
    assert phases1["backward"] == phases2["backward"] and r1["peak_phase"] == "backward"
    assert phases1["optimizer"] == phases2["optimizer"]
    # FSDP2 alone copies each all-gather out of a flat output on its copy-in stream
    # (FSDP1 gathers into the flat parameter's own storage): at the top block's copy-out
    # the block below's output and the top block's are alive (comm.py
    # `forward_top_outputs_bytes`), which sets FSDP2's forward peak here
    copy_in = comm.copy_in_stream_bytes(_ctx(fsdp_impl="fsdp2", **kw))
    block = comm.fsdp_layer_bytes(_ctx(fsdp_impl="fsdp2", **kw))
    assert copy_in > block > 0 and fsdp1.flat(full) and comm.copy_in_stream_bytes(full) == 0
    assert 0 < phases2["forward"] - phases1["forward"] <= 2 * block
    assert any("lora_fsdp_wrap_policy" in str(n) for n in r1["notes"])  # type: ignore[union-attr]
