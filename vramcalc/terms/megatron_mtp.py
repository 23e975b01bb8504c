"""Megatron-LM's multi-token prediction (`--mtp-layers N`, Megatron's --mtp-num-layers) on
the last pipeline stage: what each depth keeps beyond its transformer layer, and how many
losses the stage holds. Its parameters are vramcalc/sharding.py `mtp_tensors` and its
layers are layers of the last stage (`pipeline_chunks`)."""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.terms.saved import Saved, dims


def mtp_depths(ctx: RankContext) -> int:
    """MTP depths this rank computes: all of them on the last stage, none elsewhere."""
    return ctx.parallel.mtp_layers if ctx.is_last_stage else 0


def mtp_saved(ctx: RankContext) -> list[Saved]:
    """What each MTP depth keeps for backward besides its transformer layer, per micro-batch;
    NVIDIA/Megatron-LM d98e8a64 megatron/core/transformer/multi_token_prediction.py
    MultiTokenPredictionLayer (T = the rank's tokens, s·b/t under sequence parallelism):

    - `_get_embeddings`: the shared embedding of the tokens rolled by one; enorm (TENorm)
      keeps it, T·h;
    - `_concat_embeddings`: hnorm keeps its input (depth 1: the decoder's output after its
      final norm; depth k: depth k − 1's final-norm output), T·h; `torch.cat((enorm(e),
      hnorm(x)), -1)` is eh_proj's input, kept by the column-parallel linear, 2·T·h (its
      output is gathered and scattered back to the sequence shard: the layer's input,
      counted in the layer);
    - `_postprocess`: final_layernorm keeps its input, T·h;
    - MultiTokenPredictionBlock.forward `torch.cat(hidden_states_list, dim=0)` joins the
      decoder's output and every depth's output; process_mtp_loss `torch.chunk`s it and
      the output layer keeps each chunk as its input, views of the one cat storage: T·h
      more per depth (the main loss's chunk replaces the decoder output it kept alone).

    Under `--recompute full` (`forward`: recompute_granularity == 'full' ->
    `_checkpointed_forward`, uniform with one layer) one `tensor_parallel.checkpoint` runs
    `_proj_and_transformer_layer` (the concat, eh_proj, the layer and the final norm) and
    keeps its inputs: the depth's hidden states (its layer's checkpoint input, counted in
    the layer) and the embedding (enorm's input); the output layer still keeps its chunk.

    The norms' fp32 statistics and the embedding dropout's mask are not counted, as for the
    decoder (methodology §4)."""
    n = mtp_depths(ctx)
    if not n:
        return []
    x = dims(ctx)
    T, h, c = x.T, x.h, x.c
    out_chunk = Saved("mtp.output_layer.input", T * h, c, "(s, b, h)",
                      "this depth's chunk of the cat of all outputs", n)
    if ctx.training.recompute == "full":
        return [Saved("mtp.checkpoint.decoder_input", T * h, c, "(s, b, h)",
                      "embedding of the rolled tokens, a checkpoint input", n), out_chunk]
    # FP8: `_concat_embeddings` runs in the FP8 context, so eh_proj (a TE linear) keeps its
    # 1-byte copy and a (1,) fp32 scale_inverse (vramcalc/terms/lowprec.py, TE's rule)
    fp8 = ctx.training.precision == "fp8"
    eh = [Saved("mtp.eh_proj.input", 2 * T * h, "fp8" if fp8 else c, "(s, b, 2h)",
                "cat(enorm, hnorm)", n)]
    if fp8:
        eh.append(Saved("mtp.eh_proj.scale_inv", 1, "fp32", "(1,)", "FP8 scale_inverse", n))
    return [Saved("mtp.enorm.input", T * h, c, "(s, b, h)", "embedding of the rolled tokens",
                  n),
            Saved("mtp.hnorm.input", T * h, c, "(s, b, h)", "the previous depth's output", n),
            *eh,
            Saved("mtp.final_layernorm.input", T * h, c, "(s, b, h)", "the layer's output", n),
            out_chunk]
