"""`vramcalc explain` for encoder-decoders (T5, mT5, BART): the activation and loss sections
written out from the engine's own tables (vramcalc/terms/seq2seq.py; docs/methodology.md
§22). The other sections (weights, gradients, optimizer states, transients, overhead, peak,
fit) are the decoders' (vramcalc/explain.py)."""

from __future__ import annotations

from vramcalc.rank import RankContext
from vramcalc.report import MemoryReport
from vramcalc.terms import seq2seq as s2
from vramcalc.terms.saved import Saved
from vramcalc.units import GB


def _gb(n: float) -> str:
    return f"{n / GB:,.3f} GB"


def _rows(saved: list[Saved]) -> list[str]:
    return [f"  {t.name:<24} {t.shape:<16} {t.dtype:<5} {_gb(t.nbytes)}"
            + (f" ({t.count} of them)" if t.count > 1 else "") for t in saved]


def _total(saved: list[Saved]) -> int:
    return sum(t.nbytes for t in saved)


def seq2seq_activation_lines(ctx: RankContext, report: MemoryReport) -> list[str]:
    """What each encoder and decoder layer and the stacks' edges keep for backward."""
    x = s2.s2s_dims(ctx)
    tr = ctx.training
    enc, dec, edges = s2.encoder_layer_saved(x), s2.decoder_layer_saved(x), s2.edges_saved(x)
    head = (f"micro-batch b={x.b}, attention '{tr.attention}', recompute '{tr.recompute}', "
            f"profile '{tr.framework}'")
    lines = [f"Encoder layer over s={x.s} source tokens ({head}), kept for backward:",
             *_rows(enc), f"= {_gb(_total(enc))} per layer x {x.Le} encoder layers "
             "(layer 0 also keeps what computes T5's position bias)." if x.t5 else
             f"= {_gb(_total(enc))} per layer x {x.Le} encoder layers.",
             f"Decoder layer over t={x.t} target tokens (causal self-attention over t, "
             f"cross-attention of t queries over the s encoder outputs):",
             *_rows(dec), f"= {_gb(_total(dec))} per layer x {x.Ld} decoder layers.",
             "Outside the layers (ids, labels, both embeddings, final norms, the head's input):",
             *_rows(edges), f"= {_gb(_total(edges))}."]
    if x.full:
        ck = s2.checkpoint_saved(x)
        lines += ["Under gradient checkpointing every layer keeps only its inputs; backward "
                  "re-runs one layer at a time and holds its table above meanwhile:",
                  *_rows(ck), f"= {_gb(_total(ck))}."]
    lines.append(f"One micro-batch keeps {_gb(s2.microbatch_activation_bytes(x))} at the end "
                 f"of its forward; at the peak ({report.peak_phase}) the report counts "
                 f"{_gb(report.terms.activations)} of activations.")
    return lines


def seq2seq_logits_lines(ctx: RankContext, report: MemoryReport) -> list[str]:
    """The LM head's logits over the target tokens and CrossEntropyLoss's buffers."""
    x = s2.s2s_dims(ctx)
    n = x.b * x.t * x.V
    return [
        f"N = b·t = {x.b * x.t:,} target tokens x V = {x.V:,} vocabulary entries = {n:,} "
        f"logits per micro-batch, in {s2.logits_dtype(x)}"
        + ("" if x.t5 else " (BART adds final_logits_bias, a buffer in the weights' dtype)")
        + "; CrossEntropyLoss takes them as they are (no .float()).",
        f"Kept for backward (log-probabilities and two scalars): "
        f"{_gb(s2.logits_saved_bytes(x))}; forward peak with the logits "
        f"{_gb(s2.logits_forward_peak_bytes(x))}; backward peak (log-probabilities, their "
        f"gradient, the logits' gradient) {_gb(s2.logits_backward_peak_bytes(x))} "
        "(vramcalc/terms/seq2seq.py).",
        f"At the peak ({report.peak_phase}) the report counts {_gb(report.terms.logits)} of "
        "logits.",
    ]
