"""torchtitan's compiled blocks (torchtitan profile, --compile), and torchao's float8
linears inside them (--float8). Legend: vramcalc/terms/saved.py; N = b·s tokens, c = r =
bf16 under FSDP2's MixedPrecisionPolicy.

Source: pytorch/torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b (Dec 2024):
parallelize_llama.py `apply_compile` compiles each TransformerBlock (`fullgraph=True`)
after `apply_ac` wrapped it, and leaves the embedding, final norm, output projection and
loss eager; float8.py `Float8Handler.convert_to_float8_training` swaps every nn.Linear but
`output` for torchao's Float8Linear (pytorch/ao eab345c2268a7506355d506ebfc27b5d28e5e7d0,
torchao/float8/float8_linear.py: dynamic tensorwise casts of input and weight to e4m3,
`manual_float8_matmul_with_args_in_float8` saving both, the output's gradient cast to e5m2
in backward), with `enable_fsdp_float8_all_gather` off by default (config_manager.py
--float8.enable_fsdp_float8_all_gather: store_true), so FSDP2 all-gathers bf16 weights
(--float8-all-gather: fp8 gathers, vramcalc/terms/float8_fsdp.py).

Under torch.compile the forward keeps what AOTAutograd's min-cut partitioner picks, not
what each autograd function saves eagerly. vramcalc/trace/compiled.py `dynamo_saved`
runs torchtitan's block (vramcalc/trace/titan_model.py, with vramcalc/trace/
titan_float8.py's Float8Linear) through torch.compile with that partitioner on small CPU
tensors (tests/test_titan_compile.py):

| tensor | bf16 linears | float8 linears | float8, fp8 all-gather |
|---|---|---|---|
| block input (T, h) r | kept (graph input) | kept | kept |
| each norm's rstd (T) fp32 | kept | kept | kept |
| normed input of wq/wk/wv and of w1/w3 (N, h) c | kept | recomputed from the input and rstd | recomputed |
| rotated q; k, v (expanded when 1 < g < a); SDPA output (N, a·d) c; logsumexp | kept | kept | kept |
| wo output (N, h) c (the residual is recomputed from it) | kept | kept | kept |
| w1 and w3 outputs (N, f) c | kept | kept | kept |
| w2's input silu(w1 x)·w3 x (N, f) c | kept | recomputed | recomputed |
| fp8 copies of the weights | — | none: recast in backward | none |
| wo's input (the SDPA output) in fp8 (N, a·d) | — | kept | kept |
| per-tensor amax (bf16) and 1/scale (fp32) scalars | — | 10 and 11 | 3 and 11 (no weight amax) |

The sets are what `torch.compile` itself keeps (`dynamo_saved`: dynamo's capture, then the
same partitioner; tensor subclasses and autograd.Functions are traced as torch.compile
traces them, which AOTAutograd alone, `compiled_saved`, does not reproduce for float8: it
keeps column-major fp8 weight copies that torch.compile does not). The float8 casts are
torchao's `_ToFloat8ConstrFunc`, an autograd.Function whose backward hands the gradient
through; torchao 0.8.0's own `Float8Linear` (`convert_to_float8_training`) under
torch.compile keeps exactly the float8 column's set.

The kept bf16 weights are the all-gathered parameters FSDP2 holds anyway. Under full AC
(`ptd_checkpoint_wrapper` inside the compiled region) the partitioner recomputes the whole
block in the backward graph: the forward keeps the block input alone (the same test). Under
per-op SAC the policy's tags reach the partitioner (MUST_SAVE / PREFER_RECOMPUTE): the
forward keeps the block input and the MUST_SAVE outputs the backward graph reads — wq's
and wv's mm outputs, SDPA's output and logsumexp, w1's output — but not w2's output, which
no backward node reads (vramcalc/terms/torchtitan.py `op_sac_saved`,
tests/test_titan_compile.py); its backward recomputes the rest, holding the table's set
as under full AC. With --float8 the policy still sees `aten.mm` on torchao's Float8Tensor,
so the same outputs are kept plus the casts' 11 amax and 7 1/scale scalars (torchao
0.8.0's own Float8Linear under torch.compile); with --float8-all-gather it is not modelled.
Under TP (full AC only: vramcalc/parallel.py) the table is the rank's: (b, s, h) tensors of
the residual stream are the (T, h) sequence shard, the linears' inputs the all-gathered
(N, h), heads and ffn columns ÷ t; with float8 the gathered inputs exist only in fp8
(torchao's Float8ColwiseParallel casts before the all-gather, vramcalc/terms/
torchtitan_tp.py), so the recomputed block is taken to hold those two (N, h) fp8 tensors. In
backward, as for torchtune's compiled layers (vramcalc/terms/torchtune.py), the recomputed
block is taken to hold the table's set while its gradients run; the forward working set of
a checkpointed block and the gradient temporaries are the eager block's
(vramcalc/terms/torchtitan.py): inductor's fused kernels allocate no more than those.
"""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.float8_fsdp import float8_gather
from vramcalc.terms.saved import Saved, dims, repeats_kv_by_copy

FLOAT8_SCALARS = 11  # 1/scale scalars the partitioner keeps per block
FLOAT8_AMAX = 10  # amax scalars it keeps per block
FLOAT8_GATHERED_AMAX = 3  # with fp8 all-gather (no weight amax)


def compiled_block_saved(ctx: RankContext) -> list[Saved]:
    """What a compiled torchtitan block's forward keeps for backward (module table)."""
    x = dims(ctx)
    c, n = x.c, x.b * x.s
    f = x.f  # the rank's ffn columns (÷ t under TP)
    kv = x.a if repeats_kv_by_copy(x) else x.g  # repeat_kv copies when 1 < g < a
    f8 = ctx.training.float8
    # float8 under TP: the norms' outputs are cast on their (T, h) shard and all-gathered
    # in fp8 (vramcalc/terms/torchtitan_tp.py); the fp8 mm keeps that gathered input
    f8_gathered = f8 and ctx.parallel.tp > 1
    out = [Saved("input_norm.input", x.T * x.h, x.r, "(b, s, h)", "block input (graph "
                 "input)"),
           Saved("input_norm.rstd", x.T, "fp32", "(b, s, 1)", "rsqrt output")]
    if not f8:
        out.append(Saved("attn.input", n * x.h, c, "(b, s, h)", "normed input of wq, wk, wv"))
    elif f8_gathered:
        out.append(Saved("attn.input", n * x.h, "fp8", "(b, s, h)", "all-gathered fp8 input "
                         "of wq, wk, wv"))
    out += [Saved("attn.q", n * x.a * x.d, c, "(b, s, a, d)", "rotated q, SDPA input"),
            Saved("attn.k", n * kv * x.d, c, "(b, s, a, d)", "rotated k (repeat_kv copy)"),
            Saved("attn.v", n * kv * x.d, c, "(b, s, a, d)", "v (repeat_kv copy)"),
            Saved("attn.out", n * x.a * x.d, c, "(b, a, s, d)", "SDPA output"),
            Saved("attn.lse", x.b * x.a * x.s, "fp32", "(b, a, s)", "SDPA logsumexp"),
            Saved("post_norm.wo_out", x.T * x.h, c, "(b, s, h)", "wo's output: the residual "
                  "is recomputed from it"),
            Saved("post_norm.rstd", x.T, "fp32", "(b, s, 1)", "rsqrt output")]
    if not f8:
        out.append(Saved("mlp.input", n * x.h, c, "(b, s, h)", "normed input of w1, w3"))
    elif f8_gathered:
        out.append(Saved("mlp.input", n * x.h, "fp8", "(b, s, h)", "all-gathered fp8 input "
                         "of w1, w3"))
    out += [Saved("mlp.gate", n * f, c, "(b, s, f)", "w1 output (silu recomputed)"),
            Saved("mlp.up", n * f, c, "(b, s, f)", "w3 output")]
    if f8:
        out += [Saved("float8.wo_input", n * x.a * x.d, "fp8", "(N, a·d)", "wo's fp8 "
                      "input (the SDPA output cast)"),
                Saved("float8.amax", 1, "bf16", "()", "max(|x|) of a cast",
                      FLOAT8_GATHERED_AMAX if float8_gather(ctx) else FLOAT8_AMAX),
                Saved("float8.inv_scale", 1, "fp32", "()", "1/scale of a cast",
                      FLOAT8_SCALARS)]
    else:
        out.append(Saved("mlp.down_input", n * f, c, "(b, s, f)", "silu(w1 x) · w3 x, w2's "
                         "input"))
    return out
