"""torchtune's packed batches (`--packed`, vramcalc/terms/packed.py).

Expected values come from outside the analytic code:
- torch itself: AOTAutograd's partitioners run torchtune's layer (written from pytorch/
  torchtune 1814feb, vramcalc/trace/compiled.py) with `input_pos` under FakeTensorMode and
  say what its forward keeps (default partition: what eager autograd keeps; inductor's
  min-cut for `compile: True`); real autograd on CPU tensors says which storage RoPE's mul
  saves;
- hand derivations from tensor shapes × dtype sizes (512-byte blocks), each citing the
  torchtune or torch source line it follows;
- torchtune's rule for flex attention (utils/_import_guard.py: compute capability >= 7.5)
  against NVIDIA's published compute capabilities in the GPU profiles.
"""

from __future__ import annotations

import pytest

from vramcalc.cli import main
from vramcalc.model import ModelSpec
from vramcalc.rank import RankContext
from vramcalc.scenario import Scenario
from vramcalc.terms import activations as act
from vramcalc.terms.packed import packed_batch_saved
from vramcalc.terms.saved_layers import embedding_saved
from vramcalc.training import TrainingConfig
from vramcalc.units import alloc

torch = pytest.importorskip("torch")

SMALL = ModelSpec(name="small", hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, intermediate_size=768, vocab_size=3000,
                  tie_word_embeddings=True)
# Llama 3.2 3B's shapes (its config.json; benchmarks/calibration.py _LLAMA32_3B)
LLAMA32_3B = ModelSpec(name="llama3.2-3b", hidden_size=3072, num_hidden_layers=28,
                       num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
                       vocab_size=128256, tie_word_embeddings=True)


def ctx_of(spec: ModelSpec = SMALL, **kw: object) -> RankContext:
    args = {"framework": "torchtune", "precision": "bf16-pure", "recompute": "none",
            "seq_len": 64, "micro_batch_size": 2, **kw}
    return RankContext(spec, TrainingConfig(**args), Scenario(model=spec).parallel, 0)  # type: ignore[arg-type]


def layer_bytes(ctx: RankContext) -> int:
    return sum(t.nbytes for t in act.layer_saved(ctx))


def test_rope_gathers_two_fp32_copies_per_layer_by_hand() -> None:
    # position_embeddings.py 95-97: cache[input_pos] with input_pos (b, s) and the cache
    # (max_seq_len, d/2, 2) fp32 -> (b, s, d/2, 2) fp32 per call, q's and k's: at b = 2,
    # s = 4096, d = 128 that is 4 MiB a call, 8 MiB a layer (224 MiB over 28 layers)
    plain = ctx_of(LLAMA32_3B, seq_len=4096)
    packed = ctx_of(LLAMA32_3B, seq_len=4096, packed=True)
    assert layer_bytes(packed) - layer_bytes(plain) == 2 * 4 * 2**20


def test_ropes_mul_saves_the_gathered_copy() -> None:
    # position_embeddings.py 110-118 on real CPU tensors: the products save the cache
    # operand (x.float() requires grad, the cache does not): with input_pos a view of the
    # gather, without it a view of the buffer itself
    b, s, heads, d = 2, 16, 4, 8
    cache = torch.randn(64, d // 2, 2)
    x = torch.randn(b, s, heads, d, requires_grad=True)
    for input_pos in (torch.randint(0, 64, (b, s)), None):
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            xshaped = x.float().reshape(b, s, heads, -1, 2)
            rows = cache[:s] if input_pos is None else cache[input_pos]
            rope = rows.view(-1, s, 1, d // 2, 2)
            (xshaped[..., 0] * rope[..., 0]).sum().backward()
        storages = {t.untyped_storage().data_ptr() for t in saved}
        if input_pos is None:
            assert storages == {cache.untyped_storage().data_ptr()}
        else:
            assert storages == {rows.untyped_storage().data_ptr()}
            assert rows.shape == (b, s, d // 2, 2) and rows.dtype == torch.float32


def _layer_args(spec: ModelSpec, b: int, s: int) -> list[object]:
    h, f = spec.hidden_size, spec.intermediate_size
    a, g, d = spec.num_attention_heads, spec.kv_heads, spec.head_size

    def p(*shape: int) -> object:
        return torch.empty(*shape, dtype=torch.bfloat16, requires_grad=True)

    return [p(b, s, h), p(h), p(a * d, h), p(g * d, h), p(g * d, h), p(h, a * d), p(h),
            p(f, h), p(h, f), p(f, h), torch.empty(4 * s, d // 2, 2),
            torch.zeros(b, s, dtype=torch.long)]


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_eager_packed_layer_equals_what_torch_keeps(kv_heads: int) -> None:
    # the layer with input_pos through AOTAutograd's default partition: every saved tensor
    # but the weights, the cache and input_pos (the layer input counted), 512-byte blocks
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.compiled import compiled_saved, torchtune_layer

    spec = SMALL.model_copy(update={"num_key_value_heads": kv_heads})
    b, s = 2, 64
    with FakeTensorMode():
        saved = compiled_saved(torchtune_layer(8, kv_heads), *_layer_args(spec, b, s),
                               inductor=False)
    x_shape = (b, s, spec.hidden_size)
    gathers = [t for t in saved if t.shape == (b, s, spec.head_size // 2, 2)]
    assert len(gathers) == 2 and all(t.dtype == torch.float32 for t in gathers)
    traced = sum(alloc(t.nbytes, "int8") for t in saved
                 if not t.is_input or t.shape == x_shape)
    assert layer_bytes(ctx_of(spec, seq_len=s, micro_batch_size=b, packed=True)) == traced


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_compiled_packed_layer_breaks_at_flex_and_keeps_one_gather(kv_heads: int) -> None:
    # compile_friendly_flex_attention is torch.compiler.disable'd: the compiled layer is two
    # graphs, each through inductor's min-cut partitioner; flex attention keeps q, k, v, its
    # output and logsumexp (torch/_higher_order_ops/flex_attention.py
    # FlexAttentionAutogradOp.forward; the output takes q's strides, so output_proj's input
    # is a view of it) -- added by hand: flex has no CPU backward to trace
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.compiled import compiled_saved, torchtune_layer_parts

    spec = SMALL.model_copy(update={"num_key_value_heads": kv_heads})
    b, s, a, d = 2, 64, 8, spec.head_size
    before, after = torchtune_layer_parts(a, kv_heads)
    with FakeTensorMode():
        x, n1, wq, wk, wv, wo, n2, w1, w2, w3, cache, pos = _layer_args(spec, b, s)
        first = compiled_saved(before, x, n1, wq, wk, wv, cache, pos)
        out = torch.empty(b, s, a, d, dtype=torch.bfloat16,
                          requires_grad=True).transpose(1, 2)
        second = compiled_saved(after, x, out, wo, n2, w1, w2, w3)
    x_shape = (b, s, spec.hidden_size)
    made = [t for t in first + second if not t.is_input]
    assert sum(t.shape == (b, s, d // 2, 2) for t in made) == 1  # CSE: one gather
    traced = sum(alloc(t.nbytes, "int8") for t in made) + alloc(b * s * spec.hidden_size, "bf16")
    flex = 4 * alloc(b * a * s * d, "bf16") + alloc(b * a * s, "fp32")  # q, k, v, out; lse
    assert any(t.is_input and t.shape == x_shape for t in first)
    ctx = ctx_of(spec, seq_len=s, micro_batch_size=b, packed=True, compile=True)
    assert layer_bytes(ctx) == traced + flex


def test_dense_mask_layer_keeps_the_additive_copy_by_hand() -> None:
    # attention.cpp convert_boolean_attn_mask: zeros_like(mask (b, 1, s, s), q's dtype) and
    # masked_fill_; preprocess_mask expands it (a view) when s % 16 == 0; the efficient
    # kernel's backward takes it: b·s²·2 bytes a layer in bf16 (s = 64: 16 KiB at b = 2)
    flex = ctx_of(packed=True, packed_mask="flex")
    dense = ctx_of(packed=True, packed_mask="dense")
    assert layer_bytes(dense) - layer_bytes(flex) == 2 * 64 * 64 * 2
    # s = 72: padded to 80 columns and materialised at (b, a, s, 80); logsumexp's 72 rows
    # padded to 96 (kAlignLSE 32): 8 heads
    flex = ctx_of(packed=True, packed_mask="flex", seq_len=72)
    dense = ctx_of(packed=True, packed_mask="dense", seq_len=72)
    assert layer_bytes(dense) - layer_bytes(flex) == (alloc(2 * 8 * 72 * 80, "bf16")
                                                     + alloc(2 * 8 * 24, "fp32"))


def test_packed_batch_holds_input_pos_and_the_mask() -> None:
    # collate.py padded_collate_packed: input_pos (b, s) int64; dense: (b, s, s) bool
    # (create_block_causal_mask); flex: the BlockMask's 8 int32 tensors of 128-token
    # blocks and the document ids (b, s) int64 its mask_mod holds
    b, s = 2, 4096
    dense = ctx_of(LLAMA32_3B, seq_len=s, packed=True, packed_mask="dense")
    assert sum(t.nbytes for t in packed_batch_saved(dense)) == b * s * 8 + b * s * s
    flex = ctx_of(LLAMA32_3B, seq_len=s, packed=True, packed_mask="flex")
    blocks = 4 * alloc(b * 32, "fp32") + 4 * alloc(b * 32 * 32, "fp32")
    assert sum(t.nbytes for t in packed_batch_saved(flex)) == 2 * b * s * 8 + blocks
    plain = ctx_of(LLAMA32_3B, seq_len=s)
    assert (sum(t.nbytes for t in embedding_saved(flex))
            - sum(t.nbytes for t in embedding_saved(plain))) == 2 * b * s * 8 + blocks


def _estimate(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str]:
    code = main(["estimate", "--model", "llama3-8b", "--framework", "torchtune",
                 "--precision", "fp32", "--seq-len", "2048", "--packed", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("gpu", "mask"), [
    ("1xA100-80GB", "flex"),  # compute capability 8.0
    ("1xT4", "flex"),  # 7.5: torchtune's bound is >= (7, 5)
    ("1xV100-32GB", "dense"),  # 7.0
])
def test_the_gpu_picks_the_mask(gpu: str, mask: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _estimate(capsys, "--gpus", gpu)
    assert code in (0, 1) and f"packed ({mask} mask)" in out


@pytest.mark.parametrize(("flags", "words"), [
    (["--gpus", "1x910B1"], "torch.cuda is not available"),
    (["--gpus", "1xV100-32GB", "--compile"], "dense block-causal mask"),
    (["--framework", "hf", "--precision", "bf16"], "torchtune profile only"),
])
def test_packing_it_cannot_count_is_refused(flags: list[str], words: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _estimate(capsys, *flags)
    assert code == 2 and err.startswith("error: ") and words in err
    assert err.count("\n") == 1


def test_packing_is_off_by_default() -> None:
    tr = TrainingConfig(framework="torchtune", precision="bf16-pure")
    assert not tr.packed and "packed" not in tr.model_dump()


def test_the_traces_refuse_packing(capsys: pytest.CaptureFixture[str]) -> None:
    # the traced models build unpacked batches: both traces refuse --packed
    errors = []
    for gpus in (["--gpus", "2xA100-80GB", "--fsdp", "full"], ["--gpus", "1xA100-80GB"]):
        code = main(["trace", "--model", "llama3-8b", "--framework", "torchtune",
                     "--precision", "bf16-pure", "--packed", *gpus])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ")
        errors.append(err)
    assert all("--packed: the traces build unpacked batches" in e for e in errors)


def test_compute_capabilities_agree_with_what_the_profiles_say_otherwise() -> None:
    # NVIDIA's capability table against facts the profiles cite from other sources: BF16
    # needs compute capability >= 8.0 (TransformerEngine's support docs), FlashAttention-2
    # runs on Ampere and newer (flash-attention README), FP8 tensor cores from 8.9 on
    from vramcalc.hardware import load_profiles

    cuda = [g for g in load_profiles().values() if g.memory_api == "cuda"]
    assert cuda and all(g.cuda_capability is not None for g in cuda)
    for g in cuda:
        cap = tuple(int(v) for v in str(g.cuda_capability).split("."))
        assert g.bf16_supported == (cap >= (8, 0)), g.id
        assert g.flash_attention_2 == (cap >= (8, 0)), g.id
        if g.peak_tflops("fp8") is not None:
            assert cap >= (8, 9), g.id
