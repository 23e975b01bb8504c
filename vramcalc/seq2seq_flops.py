"""Training FLOPs of an encoder-decoder step (T5, mT5, BART) per source token, for the
speed model (vramcalc/speed.py) and through it `plan` and `size`.

A decoder's 6·N_mm + 12·L·s·A per token (PaLM, Chowdhery et al. 2022, App. B) assumes every
weight meets every token once. An encoder-decoder runs its encoder over the s source tokens
and its decoder over the t target tokens, and each decoder layer's cross-attention projects
queries at t tokens but keys and values of the encoder output at s. Per sequence, forward,
2 FLOPs per multiply-add and full products (the convention of the decoder formula):

    encoder     2·Le·(P_att + P_ff)·s + 4·Le·s²·A
    decoder     2·Ld·(P_att + P_ff)·t                 self-attention and feed-forward
                + 2·Ld·(P_q + P_o)·t + 2·Ld·(P_k + P_v)·s   cross-attention projections
                + 4·Ld·t²·A + 4·Ld·t·s·A              self- and cross-attention products
    head        2·V·h·t

with A = a·d, P_att = 4·h·A (q, k, v: h -> A, o: A -> h; P_q = P_k = P_v = P_o = h·A),
P_ff = 2·h·f (3·h·f for T5 v1.1's gated feed-forward); shapes as vramcalc/seq2seq_shapes.py
lists them (biases, norms and T5's relative-position bias are O(h) per token and left out,
as the decoder formula leaves them out). Training is three forwards (the backward computes
input and weight gradients, twice the forward); full recompute runs the layers' forward
once more, not the head. Per source token: the sequence's total / s, so that `plan`'s
tokens/s count the source tokens its global batch counts. With t = s this is 6·N_mm +
12·(Le + 2·Ld)·s·A: the decoder formula with every attention counted
(tests/test_seq2seq_plan.py).
"""

from __future__ import annotations

from vramcalc.model import ModelSpec


def seq2seq_flops(spec: ModelSpec, s: int, t: int) -> tuple[float, dict[str, float]]:
    """Training FLOPs per source token, and the hardware FLOPs per recompute mode (none,
    full; selective is not run for these models) (module docstring)."""
    h, f, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    A = spec.num_attention_heads * spec.head_size
    Le, Ld = spec.num_hidden_layers, spec.num_decoder_layers
    p_att = 4 * h * A
    p_ff = (3 if spec.mlp_kind == "gated" else 2) * h * f
    layers = (2.0 * Le * (p_att + p_ff) * s + 4.0 * Le * s * s * A
              + 2.0 * Ld * (p_att + p_ff) * t
              + 2.0 * Ld * (2 * h * A) * t + 2.0 * Ld * (2 * h * A) * s
              + 4.0 * Ld * t * t * A + 4.0 * Ld * t * s * A)
    head = 2.0 * V * h * t
    model = 3.0 * (layers + head) / s
    return model, {"none": model, "selective": model, "full": model + layers / s}
