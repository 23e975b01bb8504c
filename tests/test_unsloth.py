"""The unsloth profile (`--framework unsloth`), pinned by hand from Unsloth's source. Its
kernels are Triton and CUDA-stream code that does not run on the CPU (and unsloth is not
installed here), so the trace engine cannot referee it: each expected value below is
derived from the cited lines.

Sources:
- unslothai/unsloth-zoo ce232d6c, unsloth_zoo/gradient_checkpointing.py:
  `initialize_unsloth_gradient_checkpointing` (200 pinned CPU buffers of 128*1024 elements,
  one GPU buffer of INITIAL_GPU_BUFFER_SIZE = 2*256*2048 elements, MINIMUM_SIZE =
  2*1024*1024 // 2 elements for bf16, LAST_GC_INDEX "Don't offload the last layer");
  `UnslothCheckpointFunction.forward` (offloads arg 0 when `new_size > MINIMUM_SIZE` and it
  is not the last checkpointed layer after the first pass; `GPU_BUFFER.resize_(new_size)`).
- unsloth_zoo/fused_losses/cross_entropy_loss.py: `_get_chunk_multiplier` (target_gb =
  min(free/2, 4.0)), `get_chunk_size`, `UnslothFusedLoss.forward` (grad_inputs =
  empty_like(hidden_states), shifted labels), `.backward` (`grad_inputs * scale_factor`,
  out of place).
- unsloth_zoo/training_utils.py `prepare_model_for_training`: lora_A/lora_B `upcast = True`
  to float32.
- unslothai/unsloth 015bdef0, unsloth/kernels/utils.py `matmul_lora` ->
  `fast_dequantize(W, W_quant, use_global_buffer=True)` (WEIGHT_BUFFERS in the weight's
  dtype, ABSMAX_BUFFERS fp32, one absmax per 64-weight block).

Legend: Llama-3-8B (h = 4096, f = 14336, L = 32, V = 128256), b = 1, bf16 (2 bytes).
"""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from vramcalc.cli import app, main
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms import logits as lg
from vramcalc.terms.activations import activation_host_bytes, head_saved, layer_saved
from vramcalc.terms.modifiers import persistent_parts

H, F, L, V = 4096, 14336, 32, 128256
GIB = 2**30


def _alloc(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def _ctx(**kw: object) -> RankContext:
    values: dict[str, object] = {
        "model": "llama3-8b", "gpus": "1xRTX4090", "precision": "bf16",
        "framework": "unsloth", "finetune": "qlora", "lora_rank": 32,
        "lora_targets": "all-linear", "optimizer": "adamw-8bit", "recompute": "full",
        "seq_len": 4096}
    values.update(kw)
    scn = build_scenario(values).resolved()
    return RankContext(scn.model, scn.training, scn.parallel, 0)


def _unsloth_n_chunks(bsz: int, qlen: int, vocab: int, target_gb: float) -> int:
    """get_chunk_size's arithmetic, as written there (floats, GiB)."""
    multiplier = (vocab * 4 / 1024 / 1024 / 1024) / target_gb / 4
    exact = bsz * qlen * multiplier * 4
    if exact <= 1.0 + 1e-9:
        return 1
    return math.ceil(exact / 4 - 1e-9) * 4


def test_checkpoint_inputs_offloaded_but_the_last() -> None:
    s = 4096
    ctx = _ctx(seq_len=s)
    assert layer_saved(ctx) == []  # every layer input goes to a pinned CPU buffer
    last = [t for t in head_saved(ctx) if t.name == "unsloth.last_layer_input"]
    assert len(last) == 1 and last[0].nbytes == s * H * 2
    # pinned host memory: L buffers grown to T·h (the first pass offloads all L), the other
    # 200 - L initial buffers of 128Ki bf16 elements unchanged
    assert activation_host_bytes(ctx) == L * s * H * 2 + (200 - L) * 128 * 1024 * 2


def test_persistent_buffers() -> None:
    s = 4096
    parts = persistent_parts(_ctx(seq_len=s), None)
    # the reload buffer grows to the largest input: T·h bf16 (> the initial 2^20 elements)
    assert parts["transients/unsloth_gc_buffer"] == s * H * 2
    # the global dequant buffer: the largest 4-bit weight (gate/up/down, f·h) in bf16, and
    # its absmax, one fp32 per 64 weights
    assert parts["transients/unsloth_dequant_buffer"] == F * H * 2 + F * H // 64 * 4


def test_small_inputs_stay_on_device() -> None:
    # T·h = 256·4096 = 2^20 = MINIMUM_SIZE: `new_size > MINIMUM_SIZE` is false, so the
    # checkpoint keeps the input on the device, as torch's reentrant checkpoint does
    ctx = _ctx(seq_len=256)
    assert [t.numel for t in layer_saved(ctx)] == [256 * H]
    assert activation_host_bytes(ctx) == 0
    assert "transients/unsloth_gc_buffer" not in persistent_parts(ctx, None)
    assert layer_saved(_ctx(seq_len=257)) == []  # one token more: offloaded


def test_no_recompute_no_offload() -> None:
    ctx = _ctx(recompute="none", seq_len=1024)
    assert layer_saved(ctx) != []
    assert activation_host_bytes(ctx) == 0


@pytest.mark.parametrize(("s", "n"), [(1024, 1), (5789, 1), (8192, 1), (32768, 4),
                                      (16384, 4), (75520, 12), (131072, 16)])
def test_fused_ce_chunks(s: int, n: int) -> None:
    assert _unsloth_n_chunks(1, s, V, 4.0) == n  # the hand count agrees with the source's
    ctx = _ctx(seq_len=s)
    chunk = -(-s // n)  # torch.chunk: ceil(T / n) rows in the first chunk
    assert chunk * V * 4 <= 4 * GIB  # the 4 GiB cap holds per chunk
    saved = _alloc(s * H * 2) + _alloc(s * 8) + 2 * 512  # grad_inputs, labels, 2 scalars
    assert lg.logits_saved_bytes(ctx) == saved
    assert lg.logits_forward_peak_bytes(ctx) == saved + _alloc(chunk * V * 4)
    assert lg.logits_backward_peak_bytes(ctx) == saved + _alloc(s * H * 2)


def test_fused_ce_keeps_no_logits() -> None:
    # the hf profile keeps fp32 log-probabilities (T·V·4) for backward; Unsloth keeps T·h
    s = 5789
    hf = _ctx(framework="hf", precision="amp-bf16", seq_len=s)
    assert lg.logits_saved_bytes(hf) >= s * V * 4
    assert lg.logits_saved_bytes(_ctx(seq_len=s)) < s * V * 4 // 10


def test_adapters_fp32_no_master() -> None:
    tr = _ctx().training
    assert tr.trainable_dtype == "fp32" and tr.weight_dtype == "bf16"
    assert not tr.has_master_weights


@pytest.mark.parametrize("flags", [
    ["--finetune", "full"], ["--precision", "amp-bf16"], ["--recompute", "selective"],
    ["--attention", "eager"], ["--chunked-ce", "4"]])
def test_refused_settings_exit_2(flags: list[str], capsys: pytest.CaptureFixture[str]
                                 ) -> None:
    base = ["estimate", "--model", "llama3-8b", "--gpus", "1xRTX4090", "--framework",
            "unsloth", "--finetune", "qlora", "--precision", "bf16"]
    code = main(base + flags)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "unsloth profile" in err


def test_forward_peak_grows_without_the_inputs() -> None:
    # doubling T from 32768 to 65536 under torch's checkpoint would add L more inputs of
    # T·h·2 bytes to the forward-end peak; offloaded, the device gains one kept input, the
    # reload buffer and the loss's dL/dhidden (its chunk stays 8192 tokens: 4 chunks, then 8)
    import json

    def fwd(s: int) -> int:
        base = ["estimate", "--model", "llama3-8b", "--gpus", "1xH100", "--framework",
                "unsloth", "--finetune", "qlora", "--precision", "bf16", "--seq-len",
                str(s), "--lora-targets", "all-linear", "--recompute", "full", "--json"]
        return int(json.loads(CliRunner().invoke(app, base).output)["phases"]["forward"])

    t = 32768
    grown = fwd(2 * t) - fwd(t)
    assert grown < L * t * H * 2
    assert grown >= 3 * t * H * 2  # the kept input, the buffer, dL/dhidden


def test_trace_refuses_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    # Unsloth's Triton kernels and CUDA streams do not run under FakeTensorMode on the CPU
    code = main(["trace", "--model", "llama3-8b", "--gpus", "1xH100", "--framework",
                 "unsloth", "--finetune", "qlora", "--precision", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "unsloth" in err


def test_report_notes_the_offload_and_chunks() -> None:
    import json
    out = CliRunner().invoke(app, [
        "estimate", "--model", "llama3-8b", "--gpus", "1xH100", "--framework", "unsloth",
        "--finetune", "qlora", "--precision", "bf16", "--seq-len", "32768", "--recompute",
        "full", "--json"]).output
    notes = " ".join(json.loads(out)["notes"])
    assert "pinned host memory" in notes and "4 chunks" in notes


def test_lora_kernels_saved_set() -> None:
    # fast_lora.py LoRA_MLP.forward: ctx.save_for_backward(gateA, gateB, upA, upB, downA,
    # downB, X, e, g): of the MLP only X (T·h), e = gate(X) and g = up(X) (T·f each); h =
    # act(e)·g is recomputed in backward; LoRA_QKV / LoRA_W keep no adapter A outputs
    from vramcalc.terms.activations import without_recompute
    s = 1000
    saved = {t.name: t for t in layer_saved(without_recompute(_ctx(seq_len=s)))}
    assert {n for n in saved if n.startswith("mlp.")} == {"mlp.input", "mlp.gate", "mlp.up"}
    assert saved["mlp.gate"].numel == saved["mlp.up"].numel == s * F
    assert not [n for n in saved if n.startswith("lora.")]


def test_lora_mlp_backward_one_buffer() -> None:
    # LoRA_MLP.backward: DW = dY·downᵀ is the one new (T, f) buffer; `_backward_function(DW,
    # e, g)` writes h, df, de in place. The hf profile's autograd act·up backward allocates
    # d(act·up), d act and d up (3·T·f): two (T, f) buffers more at the MLP instant
    from vramcalc.terms.activations import layer_backward_moments
    s = 2048
    uns = {m.name: m for m in layer_backward_moments(_ctx(seq_len=s))}
    ref = {m.name: m for m in layer_backward_moments(_ctx(seq_len=s, framework="reference",
                                                          precision="bf16"))}
    # the reference profile has no QLoRA-specific MLP work beyond the same dequant instant
    assert ref["mlp"].work - uns["mlp"].work == 2 * s * F * 2


def test_explain_describes_the_fused_loss(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", "--model", "llama3-8b", "--gpus", "1xH100", "--framework",
                 "unsloth", "--finetune", "qlora", "--precision", "bf16", "--seq-len", "32768"])
    out = capsys.readouterr().out
    assert code == 0 and "fused cross entropy" in out and "4 chunks" in out
    assert "fp32 log-probabilities (kept" not in out  # not the plain loss's formula


def test_adapters_stored_in_fp32() -> None:
    # prepare_model_for_training (float32_mixed_precision=True for a bf16 model) casts every
    # trainable parameter to fp32: Llama-3-8B's r-32 adapters on all seven linears are
    # 32 · (2·(h+h) + 2·(h+1024) + 3·(h+f)) = 2,621,440 parameters a layer, 4 bytes each
    from vramcalc.analytic import estimate

    scn = build_scenario({"model": "llama3-8b", "gpus": "1xRTX4090", "precision": "bf16",
                          "framework": "unsloth", "finetune": "qlora", "lora_rank": 32,
                          "lora_targets": "all-linear", "seq_len": 1024})
    per_layer = 32 * (2 * (H + H) + 2 * (H + 1024) + 3 * (H + F))
    assert per_layer == 2_621_440
    assert estimate(scn).subterms["weights/adapters"] == L * per_layer * 4


def test_embedding_output_held_through_the_step() -> None:
    # enable_input_require_grads makes the embedding output a leaf that requires grad; the
    # first checkpoint node's edge to it is an AccumulateGrad, which holds the tensor, so the
    # pinned copy does not free it: T·h bf16 for the whole step. Under torch's own checkpoint
    # (small inputs) or without recompute the layer keeps it anyway: no extra tensor
    from vramcalc.terms.activations import embedding_saved

    s = 4096
    held = [t for t in embedding_saved(_ctx(seq_len=s)) if t.name == "unsloth.embedding_output"]
    assert len(held) == 1 and held[0].nbytes == s * H * 2
    for ctx in (_ctx(seq_len=256), _ctx(seq_len=s, recompute="none")):
        assert not [t for t in embedding_saved(ctx) if t.name.startswith("unsloth.")]


def test_recomputed_input_is_the_reload_buffer() -> None:
    # UnslothCheckpointFunction.backward re-runs the layer on `x = buffer.detach()` (the
    # persistent reload buffer; the last layer on its kept input): the input the first norm
    # saves is no new tensor, so each backward instant holds the layer's saved set less it
    from vramcalc.terms.activations import layer_backward_moments, without_recompute

    s = 2048
    ctx = _ctx(seq_len=s)
    saved = {t.name: t.nbytes for t in layer_saved(without_recompute(ctx))}
    moments = {m.name: m for m in layer_backward_moments(ctx)}
    # at the MLP instant: every saved tensor but the aliased input, plus the re-run's output
    # (T·h), which the backward binds until torch.autograd.backward returns
    assert saved["input_norm.input"] == s * H * 2
    mlp_held = sum(saved.values()) - saved["input_norm.input"] + s * H * 2
    assert moments["mlp"].held == mlp_held


# ---- --unsloth-version 2024.12.4 (unsloth d9ed4bef09, unsloth-zoo 9c643b66,
# ml-cross-entropy 24.12.1 1f3ebdb), each value from the lines the docstrings cite -------
OLD = "2024.12.4"


def test_old_release_loss_is_cut_cross_entropy() -> None:
    # b·s > 1024: LinearCrossEntropyFunction keeps e (T·h bf16), lse (T fp32), the valid
    # index (T int64) and logit_avg (V fp32), beside the shifted labels (T int64); its
    # backward makes de = zeros_like(e), dc = zeros_like(c) (V·h bf16, the frozen head's),
    # de_locks (T int32 at h/64 = 64 columns), dc_locks (V int32) and argsort(logit_avg)
    s = 4096
    ctx = _ctx(seq_len=s, unsloth_version=OLD)
    kept = _alloc(s * H * 2) + _alloc(s * 4) + _alloc(s * 8) + _alloc(s * 8) + _alloc(V * 4)
    assert lg.logits_saved_bytes(ctx) == kept
    assert lg.logits_forward_peak_bytes(ctx) == kept  # no logits
    back = _alloc(s * H * 2) + _alloc(V * H * 2) + _alloc(s * 4) + 2 * _alloc(V * 4)
    assert lg.logits_backward_peak_bytes(ctx) == kept + back


@pytest.mark.parametrize(("release", "s"), [("2024.12.5", 1000), ("2025.10.7", 1000),
                                            ("2024.11.7", 4096), ("2024.8", 4096)])
def test_logits_path_keeps_bf16_logits(release: str, s: int) -> None:
    # before cut cross-entropy (2024.11.8), and for b·s <= 1024 from 2024.12.5 (RETURN_LOGITS)
    # until 2025.10.8: the bf16 logits go to Fast_CrossEntropyLoss, which keeps them and its
    # logsumexp (T fp32) and writes the gradient into them; then lm_head's dX. The model
    # returns them, and the Trainer's bf16 mixed precision (accelerate's
    # convert_outputs_to_fp32) makes a T·V fp32 copy at the end of forward
    from vramcalc.terms import unsloth as u

    ctx = _ctx(seq_len=s, unsloth_version=release)
    assert u.loss_path(ctx) == "logits"
    kept = _alloc(s * V * 2) + _alloc(s * 4) + _alloc(s * 8)
    assert lg.logits_saved_bytes(ctx) == kept
    assert lg.logits_forward_peak_bytes(ctx) == kept + _alloc(s * V * 4)
    assert lg.logits_backward_peak_bytes(ctx) == kept + _alloc(s * H * 2)


@pytest.mark.parametrize(("release", "s", "path"), [
    ("2024.11.8", 1000, "cce"),  # the first release with cut cross-entropy, any length
    ("2024.12.4", 1000, "cce"),  # its wheel lacks d9ed4bef09's RETURN_LOGITS lines
    ("2024.12.5", 4096, "cce"),
    ("2025.8.5", 1000, "logits"),  # the fused loss, but b·s <= 1024 still returns logits
    ("2025.8.5", 4096, "fused"),
    ("2025.10.8", 1000, "fused")])
def test_loss_path_by_release(release: str, s: int, path: str) -> None:
    from vramcalc.terms import unsloth as u

    assert u.loss_path(_ctx(seq_len=s, unsloth_version=release)) == path


def test_old_release_reloads_into_new_tensors() -> None:
    # Unsloth_Offloaded_Gradient_Checkpointer: every layer's input goes to the host whatever
    # its size (no MINIMUM_SIZE, no kept last layer) and comes back with .to("cuda:0"), a new
    # tensor the re-run saves: no persistent buffer, no aliasing
    from vramcalc.terms.activations import layer_backward_moments, without_recompute

    for s in (256, 2048):
        ctx = _ctx(seq_len=s, unsloth_version=OLD)
        assert layer_saved(ctx) == []
        assert not [t for t in head_saved(ctx) if t.name == "unsloth.last_layer_input"]
        assert "transients/unsloth_gc_buffer" not in persistent_parts(ctx, None)
        assert activation_host_bytes(ctx) == L * s * H * 2
    s = 2048
    ctx = _ctx(seq_len=s, unsloth_version=OLD)
    saved = sum(t.nbytes for t in layer_saved(without_recompute(ctx)))
    moments = {m.name: m for m in layer_backward_moments(ctx)}
    assert moments["mlp"].held == saved + s * H * 2  # + the re-run's bound output


def test_old_release_lora_sum_temporary() -> None:
    # matmul_lora: `out += (X @ A) @ (s * B)` makes DW's LoRA product, a second (T, f)
    # tensor, before the in-place add (2026: out.addmm_)
    from vramcalc.terms.activations import layer_backward_moments

    s = 2048
    old = {m.name: m for m in layer_backward_moments(_ctx(seq_len=s, unsloth_version=OLD))}
    new = {m.name: m for m in layer_backward_moments(_ctx(seq_len=s))}
    assert old["mlp"].work - new["mlp"].work == s * F * 2


@pytest.mark.parametrize(("s", "rows"), [(4096, 8192), (40000, 40960)])
def test_old_release_rope_caches_per_layer(s: int, rows: int) -> None:
    # each attention module's rotary embedding caches cos and sin for min(4·8192, 8192)
    # positions of Llama-3-8B (max_position_embeddings 8192) in bf16, the model one more;
    # extend_rope_embedding regrows every layer's to whole steps of 8192 positions (40000
    # tokens: 5 steps, 40960 rows), not the model's
    from vramcalc.terms.activations import embedding_saved

    ctx = _ctx(seq_len=s, unsloth_version=OLD)
    assert ctx.spec.max_position_embeddings == 8192
    assert persistent_parts(ctx, None)["transients/unsloth_rope_caches"] == 2 * (
        L * _alloc(rows * 128 * 2) + _alloc(8192 * 128 * 2))
    assert "transients/unsloth_dequant_buffer" not in persistent_parts(ctx, None)
    assert not [t for t in embedding_saved(ctx) if t.name == "rope.cos_sin"]


@pytest.mark.parametrize("flags", [
    ["--unsloth-version", "2024.7.1"],
    ["--unsloth-version", "2024.12.4", "--framework", "hf"],
    ["--unsloth-version", "latest"]])
def test_unsloth_version_refusals(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "--model", "llama3-8b", "--gpus", "1xRTX4090", "--framework",
            "unsloth", "--finetune", "qlora", "--precision", "bf16"]
    code = main(base + flags)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "unsloth" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(("release", "fused_ce", "gc_buffer", "addmm", "global_buf", "shared_rope"), [
    ("2024.8", False, False, False, False, False),  # the first PyPI release
    ("2024.12.4", False, False, False, False, False),
    ("2025.1.1", False, False, False, False, True),  # 63782ea3af: one rotary embedding
    ("2025.2.2", False, False, False, True, True),  # 144190bd06: use_global_buffer=True
    ("2025.3.1", False, True, True, True, True),  # UnslothCheckpointFunction; addmm_
    ("2025.8.4", False, True, True, True, True),
    ("2025.8.5", True, True, True, True, True),  # 806bee2433: unsloth_fused_ce_loss
    (None, True, True, True, True, True)])  # 2026.8.19, the release modelled
def test_release_boundaries(release: str | None, fused_ce: bool, gc_buffer: bool, addmm: bool,
                            global_buf: bool, shared_rope: bool) -> None:
    # the first PyPI release of each change, each found in that release's wheel and not in
    # the one before it (2024.12.12, 2025.1.8, 2025.2.15, 2025.8.4)
    from vramcalc.terms import unsloth as u
    from vramcalc.terms.activations import layer_backward_moments

    s = 4096
    ctx = _ctx(seq_len=s, unsloth_version=release)
    parts = persistent_parts(ctx, None)
    assert (u.loss_path(ctx) == "fused") is fused_ce
    assert u.reload_buffer(ctx) is gc_buffer
    assert ("transients/unsloth_gc_buffer" in parts) is gc_buffer
    assert ("transients/unsloth_dequant_buffer" in parts) is global_buf
    assert ("transients/unsloth_rope_caches" not in parts) is shared_rope
    new = {m.name: m for m in layer_backward_moments(_ctx(seq_len=s))}
    work = {m.name: m for m in layer_backward_moments(ctx)}["mlp"].work
    # the MLP instant's work: the 2026 kernels' DW (new["mlp"]), plus the sum's (T, f)
    # temporary before addmm_, less nothing else
    assert work - new["mlp"].work == (0 if addmm else s * F * 2)
