"""The lightning profile (`--framework lightning`): LitGPT on Lightning Fabric, pinned by hand
from the stack's source (neither runs on the CPU here: lightning and litgpt are not
installed, so the trace engine refuses the profile).

Sources:
- LitGPT 8641822 (Lightning-AI/litgpt, the commit of tutorials/resource-tables.md):
  lit_gpt/model.py `CausalSelfAttention.forward` (one fused `attn` linear; q and k roped
  and `torch.cat` into new tensors; v a view of the fused output handed to SDPA),
  lit_gpt/rmsnorm.py (`x * torch.rsqrt(torch.mean(x * x) + eps)` in the input dtype, then
  `self.weight * x_normed`), lit_gpt/lora.py `LoRAQKVLinear.forward` (one
  `lora_dropout(x)`, A of shape (r·n_enabled, h), B through a grouped conv1d, `zero_pad`'s
  out-of-place `index_copy` when not all of q, k, v are adapted: torch's derivative for
  index_copy's source is `grad.index_select(dim, index).expand_as(source)`, so the source
  is kept),
  lit_gpt/lora.py `GPT.forward(lm_head_chunk_size=128)` (a list of head outputs per 128
  tokens), lit_gpt/utils.py `chunked_cross_entropy` (per-chunk F.cross_entropy,
  reduction="none"), finetune/lora.py (AdamW on the LoRA parameters, `fabric.
  no_backward_sync` while accumulating, FSDPStrategy on several devices).
- Lightning 2.1.0.rc0 (c98fb36b) src/lightning/fabric/plugins/precision/half.py
  `convert_output`: module outputs go back to the default dtype, fp32.

Legend: b = 1, s = 1304, h = 4096, f = 11008, a = 32 heads of d = 128, V = 32000, bf16
(--precision bf16-pure = Fabric's bf16-true), LoRA r = 8 on q and v, dropout 0.05.
"""

from __future__ import annotations

from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms import logits as lg
from vramcalc.terms.activations import layer_activation_bytes, layer_saved

S, H, F, A, V, R = 1304, 4096, 11008, 32, 32000, 8


def _alloc(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def _ctx(**kw: object) -> RankContext:
    values: dict[str, object] = {
        "model": "llama2-7b", "gpus": "1xA100-40GB", "precision": "bf16-pure",
        "framework": "lightning", "finetune": "lora", "lora_dropout": 0.05, "seq_len": S,
        "litgpt_norm": "input"}  # 8641822 precedes 6178c7cc's fp32 RMSNorm
    values.update(kw)
    scn = build_scenario(values).resolved()
    return RankContext(scn.model, scn.training, scn.parallel, 0)


def test_lora_layer_saved_hand_derived() -> None:
    bsh = _alloc(S * H * 2)
    expected = (
        2 * (bsh + _alloc(S * 2))  # norm_1 and norm_2: input x (x·x, x·rsqrt) + rsqrt (b, s, 1)
        # (x̂ is not kept: `weight * x_normed` has a frozen weight)
        + _alloc(S * 3 * H * 2)  # fused qkv output, alive through SDPA's v view
        + 2 * bsh  # the roped q and k (torch.cat copies), SDPA inputs
        + bsh + _alloc(A * S * 4)  # SDPA output (proj's input is a view of it), logsumexp
        + 3 * _alloc(S * F * 2)  # fc_1 out (silu input), silu out and fc_2 out (the product)
        # (frozen fc_1 / fc_2 / proj / attn keep no input)
        + _alloc(S * H) + bsh  # one lora_dropout for the fused linear: mask + output
        + _alloc(S * 2 * R * 2)  # A's output (r rows per enabled slice: q and v)
        # zero_pad (k has no adapter): index_copy keeps its source, B's (T, 2h) output,
        # for expand_as, and lora_ind (2h int64)
        + _alloc(S * 2 * H * 2) + _alloc(2 * H * 8)
    )
    assert layer_activation_bytes(_ctx()) == expected


def test_single_dropout_on_the_fused_qkv() -> None:
    """PEFT puts one dropout on each of q_proj and v_proj; LitGPT one on the fused linear."""
    lit = [t.name for t in layer_saved(_ctx())]
    ref = [t.name for t in layer_saved(_ctx(framework="reference", litgpt_norm=None))]
    assert lit.count("lora.qkv.dropout_mask") == 1 and not any(
        n.startswith(("lora.q.", "lora.v.")) for n in lit)
    assert "lora.q.dropout_mask" in ref and "lora.v.dropout_mask" in ref


def test_full_finetune_norm_keeps_xhat() -> None:
    names = [t.name for t in layer_saved(_ctx(finetune="full"))]
    assert "input_norm.xhat" in names and "attn.input" in names


def test_chunked_head_fp32_outputs_hand_derived() -> None:
    """11 head chunks (10 of 128 tokens, one of 24), each returned in fp32 by Fabric and
    all alive in the loop's list; each chunk's log_softmax saves its fp32 output."""
    ctx = _ctx()
    chunks = [128] * 10 + [24]
    assert sum(chunks) == S
    per_chunk = sum(_alloc(n * V * 4) for n in chunks)
    saved = 2 * per_chunk + _alloc(S * 4) + 512  # + per-token losses (cat) and the mean
    assert lg.logits_saved_bytes(ctx) == saved
    assert lg.logits_forward_peak_bytes(ctx) == saved
    # backward: the last chunk's dL/dlogprobs and dL/dlogits in fp32, and 3 scalars
    assert lg.logits_backward_peak_bytes(ctx) == saved + 2 * _alloc(128 * V * 4) + 3 * 512


def test_phi15_parallel_block_hand_derived() -> None:
    """LitGPT's phi-1.5 (8641822 lit_gpt/config.py: shared_attention_norm, parallel_residual,
    LayerNorm, GptNeoxMLP with tanh GELU, biases): `x + attn(n_1) + mlp(n_1)` with one
    norm; under LoRA on q and v with dropout the frozen fused qkv and fc keep no input."""
    from vramcalc.model import ModelSpec

    phi = ModelSpec(
        name="phi-1.5", model_type="phi", hidden_size=2048, num_hidden_layers=24,
        num_attention_heads=32, intermediate_size=8192, vocab_size=51200,
        mlp_kind="standard", hidden_act="gelu_pytorch_tanh", norm_kind="layernorm",
        norm_bias=True, attention_bias=True, attention_out_bias=True, mlp_bias=True,
        num_layer_norms=1, parallel_residual=True, lm_head_bias=True)
    assert phi.num_params == 1_418_270_720  # transformers' PhiForCausalLM (test_parallel_residual)
    from vramcalc.scenario import Scenario
    from vramcalc.training import TrainingConfig

    s, h, f, a = 1044, 2048, 8192, 32
    scn = Scenario(model=phi, training=TrainingConfig(
        seq_len=s, precision="bf16-pure", framework="lightning", finetune="lora",
        lora_dropout=0.05, litgpt_norm="input")).resolved()
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    expected = (
        _alloc(s * h * 2) + 2 * _alloc(s * 4)  # nn.LayerNorm: input, fp32 mean and rstd
        + _alloc(s * 3 * h * 2) + 2 * _alloc(s * h * 2)  # qkv (v's view), roped q and k
        + _alloc(s * h * 2) + _alloc(a * s * 4)  # SDPA output and logsumexp
        + _alloc(s * f * 2)  # fc output, kept by GELU (proj is frozen: no input kept)
        + _alloc(s * h) + _alloc(s * h * 2) + _alloc(s * 2 * R * 2)  # the one LoRA dropout
        + _alloc(s * 2 * h * 2) + _alloc(2 * h * 8)  # zero_pad's index_copy source, index
    )
    assert layer_activation_bytes(ctx) == expected


# ---- LitGPT since lit-gpt 6178c7cc (2023-10-24; litgpt 00af8b0d of September 2024) ---------
# litgpt/model.py RMSNorm.forward: `x = x.float()`, `norm_x = torch.mean(x * x, ...)`,
# `x_normed = x * torch.rsqrt(norm_x + self.eps)`, `(x_normed * weight.float()).to(dtype)`;
# litgpt/scripts/convert_hf_checkpoint.py: a checkpoint without lm_head.weight gets
# `state_dict["lm_head.weight"] = state_dict["transformer.wte.weight"]` (no tying);
# litgpt/finetune/lora.py `fit`: `logits = model(input_ids, lm_head_chunk_size=128)` stays
# bound until the next call returns; lightning fabric/plugins/precision/bitsandbytes.py
# `_Linear4bit.quantize`: `weight.contiguous().to(device=device, dtype=torch.half)`;
# bitsandbytes 0.42.0 autograd/_functions.py MatMul4Bit.forward: `ctx.tensors = (A, B)`,
# `F.dequantize_4bit(B, quant_state).to(A.dtype)`.


def test_current_rmsnorm_keeps_the_fp32_input() -> None:
    """Two norms per layer: each keeps x.float() (T·h fp32) and its fp32 rsqrt (T), not the
    bf16 input; x̂ (fp32) only when the norm's weight trains."""
    old, new = _ctx(), _ctx(litgpt_norm=None)
    per_norm = _alloc(S * H * 4) + _alloc(S * 4) - (_alloc(S * H * 2) + _alloc(S * 2))
    assert layer_activation_bytes(new) - layer_activation_bytes(old) == 2 * per_norm
    full = [t.name for t in layer_saved(_ctx(litgpt_norm=None, finetune="full"))]
    assert "input_norm.x_fp32" in full and "input_norm.xhat_fp32" in full
    assert "input_norm.xhat_fp32" not in [t.name for t in layer_saved(new)]


def test_a_tied_checkpoint_gets_its_own_head() -> None:
    """Llama-3.2-1B ties lm_head to the embedding; LitGPT loads a copy (V·h more)."""
    values = {"model": "llama3.2-1b", "gpus": "1xA10G", "precision": "bf16-pure",
              "seq_len": 512, "finetune": "lora"}
    tied = build_scenario({**values, "framework": "reference"}).resolved()
    lit = build_scenario({**values, "framework": "lightning"}).resolved()
    assert tied.model.tie_word_embeddings and not lit.model.tie_word_embeddings
    assert lit.model.num_params - tied.model.num_params == 128256 * 2048
    assert "LitGPT keeps lm_head apart" in (lit.model_note or "")


def test_the_previous_micro_batch_is_held_until_the_model_returns() -> None:
    """LoRA: the previous fp32 logits list; QLoRA on bitsandbytes 0.42.0: also every 4-bit
    linear's input of the previous graph (none with 0.43.2, which frees them in backward)."""
    from vramcalc.terms.litgpt_loop import previous_held_bytes, previous_logits_bytes

    chunks = [128] * 10 + [24]
    fp32_list = sum(_alloc(n * V * 4) for n in chunks)
    assert previous_logits_bytes(_ctx()) == fp32_list
    assert previous_held_bytes(_ctx()) == 0
    assert previous_logits_bytes(_ctx(framework="reference", litgpt_norm=None)) == 0
    q = {"finetune": "qlora", "litgpt_norm": None, "nf4_double_quant": False}
    # q/k/v's input (norm_1's bf16 output), fc_1/fc_2's (norm_2's output), the MLP proj's
    # (the SwiGLU product) and the attention proj's: a view of SDPA's output (the flash
    # kernel writes it (b, s, a, d)-major, so LitGPT's `y.transpose(1, 2).reshape` copies
    # nothing), whose storage SDPA's node released in backward and the proj's `ctx.tensors`
    # still holds; layer 0's q/k/v input needs no gradient (`ctx.tensors = (None, None)`)
    per_layer = 3 * _alloc(S * H * 2) + _alloc(S * F * 2)
    held = previous_held_bytes(_ctx(**q, bnb_version="0.42.0"))
    assert held == 32 * per_layer - _alloc(S * H * 2)
    assert previous_held_bytes(_ctx(**q, bnb_version="0.43.2")) == 0
    # a 4-bit head: its chunks are views of the final norm's output, which it holds too
    head = previous_held_bytes(_ctx(**q, bnb_version="0.42.0", quantize_head=True))
    assert head - held == _alloc(S * H * 2)


def test_a_4bit_head_runs_beside_its_earlier_chunks() -> None:
    """LitGPT's last 128-token head chunk (24 tokens here) dequantizes the V·h weight to fp16,
    casts it to bf16 (both alive during `.to`; the fp32 absmax of single quantization is read
    as it is), while the ten earlier chunks' bf16 outputs
    wait in the list `GPT.forward` returns. In backward autograd runs every loss and fp32
    cast node (created after the head's) first, so the last chunk's head node runs beside
    every chunk's bf16 gradient and the fp32 list the loop holds; there it dequantizes
    again, then the bf16 weight meets dL/dx (24, h)."""
    q = {"finetune": "qlora", "litgpt_norm": None, "nf4_double_quant": False,
         "bnb_version": "0.42.0", "quantize_head": True}
    ctx = _ctx(**q)
    w, earlier = V * H, 10 * _alloc(128 * V * 2)
    fwd = earlier + max(2 * _alloc(w * 2), _alloc(w * 2) + _alloc(24 * V * 2))
    assert lg.nf4_head_forward_bytes(ctx) == fwd
    fp32_list = 10 * _alloc(128 * V * 4) + _alloc(24 * V * 4)
    grads = earlier + _alloc(24 * V * 2)
    bwd = fp32_list + grads + max(2 * _alloc(w * 2), _alloc(w * 2) + _alloc(24 * H * 2))
    assert lg.logits_backward_peak_bytes(ctx) == bwd  # above the loss's own backward


def test_lightning_dequantizes_through_fp16() -> None:
    """The bf16 matmul of an fp16-quantized weight: fp16 dequantization, then its bf16 copy
    (both alive during `.to`), beside the decoded fp32 absmax (no double quantization: the
    absmax is fp32 already, nothing to decode)."""
    from vramcalc.qlora import dequant_transient_bytes

    q = {"finetune": "qlora", "litgpt_norm": None, "nf4_double_quant": False,
         "bnb_version": "0.42.0"}
    lit, ref = _ctx(**q).training.nf4, _ctx(**q, framework="reference").training.nf4
    assert lit.quant_dtype == "fp16" and ref.quant_dtype is None
    n = F * H
    assert dequant_transient_bytes(n, "bf16", lit) == _alloc(n * 2) + _alloc(n * 2)
    assert dequant_transient_bytes(n, "bf16", ref) == _alloc(n * 2)


def test_lightning_precision_names_are_taken() -> None:
    """Fabric's plugin names (Lightning 2.1 lightning/fabric/plugins/precision/precision.py
    `_PRECISION_INPUT_STR`; half.py: bf16-true converts the model to bf16; amp.py: the
    -mixed plugins autocast over fp32 weights) select the same policies as vramcalc's
    names for them."""
    for lightning, ours in (("bf16-true", "bf16-pure"), ("BF16-Mixed", "amp-bf16"),
                            ("32-true", "fp32"), ("16-mixed", "amp-fp16")):
        base = {"model": "llama2-7b", "gpus": "1xA100", "framework": "lightning"}
        assert (build_scenario({**base, "precision": lightning})
                == build_scenario({**base, "precision": ours}))
