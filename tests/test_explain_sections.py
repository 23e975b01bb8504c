"""`vramcalc explain` has a section for every term: logits and loss, transients (with the
optimizer step's formula) and overhead, and the megatron profile lists its saved tensors.

Hand derivations in each test; model facts from the model cards' config.json
(Llama-2-7B: 6,738,415,616 parameters, tests/test_catalog.py; Llama-3-8B: vocabulary
128,256; GPT-2 medium: h 1024, 16 heads, FFN 4096) and Korthikanti et al. 2022
(arXiv:2205.05198) Table 2 / eq. 2 for Megatron's per-layer activations.
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from vramcalc.cli import app
from vramcalc.options import build_scenario
from vramcalc.rank import RankContext
from vramcalc.terms.megatron_layer import megatron_layer_bytes, megatron_layer_tensors

runner = CliRunner()


def _explain(*args: str) -> dict[str, list[str]]:
    result = runner.invoke(app, ["explain", *args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    return {s["title"]: s["lines"] for s in doc["sections"]}


def _last_gb(text: str) -> float:
    m = re.search(r"= ([\d,.]+) GB\.?$", text)
    assert m, text
    return float(m.group(1).replace(",", ""))


def test_the_optimizer_step_transient_of_a_7b_full_fine_tune_has_its_formula() -> None:
    """bf16 weights and grads, fp32 master and AdamW states, torch's foreach AdamW on one GPU:
    each bf16 gradient becomes an fp32 copy on its master (net 2 B/param), then
    _foreach_sqrt(exp_avg_sq) copies every second moment (4 B/param): 6 B x 6.74e9 = 40.4 GB."""
    sections = _explain("--model", "llama2-7b", "--gpus", "1xH200", "--seq-len", "2048")
    lines = sections["Transients"]
    text = next(line for line in lines if line.startswith("Optimizer-step transient"))
    params = 6_738_415_616
    assert _last_gb(text) == pytest.approx(6 * params / 1e9, rel=1e-3)
    assert any("_foreach_sqrt" in line and "4 B x 6,738,415,616" in line for line in lines)
    assert any("(4 − 2) B x 6,738,415,616" in line for line in lines)


def test_logits_section_substitutes_tokens_and_vocabulary() -> None:
    # N = b·s = 4096 tokens x V = 128,256: forward 2 fp32 buffers, backward 3 (12 B/logit)
    sections = _explain("--model", "llama3-8b", "--gpus", "8xH100", "--zero", "3")
    lines = sections["Logits and loss"]
    n = 4096 * 128_256
    assert any(f"= {n:,} logits" in line for line in lines), lines
    assert any(f"3 x {n:,} x 4 B = {12 * n / 1e9:,.3f} GB" in line for line in lines), lines


def test_logits_section_describes_ligers_fused_loss() -> None:
    # Llama-3-8B, 4096 tokens: ⌈128,256 / 4,096⌉ = 32, next_pow2(4096 / 32) = 128 tokens
    sections = _explain("--model", "llama3-8b", "--gpus", "1xH100", "--framework", "hf",
                        "--finetune", "lora", "--liger")
    text = " ".join(sections["Logits and loss"])
    assert "Liger's fused linear cross entropy" in text and "= 128 tokens" in text
    assert "fp32 upcast" not in text and "keeps the bf16 logits" not in text


def test_overhead_section_names_context_nccl_and_fragmentation() -> None:
    sections = _explain("--model", "llama3-8b", "--gpus", "8xH100", "--zero", "3")
    lines = " ".join(sections["Overhead"])
    # H100 profile: 534 MiB CUDA context (meta-pytorch/torchcomms#777); 8 ranks:
    # aiconfigurator's 392 MB of NCCL buffers
    assert "CUDA context" in lines and f"{534 * 2**20 / 1e9:,.3f} GB" in lines
    assert "0.392 GB" in lines and "fragmentation" in lines


def test_paged_optimizer_states_are_fp32_and_split_between_device_and_host() -> None:
    """bitsandbytes' PagedAdamW keeps two fp32 states per element (32-bit Optimizer2State),
    6,738,415,616 x 8 B = 53.907 GB for Llama-2-7B, less the small tensors' that stay in
    the allocator; what has no room on a 24 GB card is in host RAM."""
    sections = _explain("--model", "llama2-7b", "--framework", "torchtune", "--precision",
                        "bf16-pure", "--optimizer", "paged-adamw", "--optimizer-in-backward",
                        "--recompute", "full", "--gpus", "1xRTX4090", "--seq-len", "512")
    assert any("two fp32 states" in line and "unified memory" in line
               for line in sections["Optimizer states"])
    line = next(x for x in sections["Overhead"] if x.startswith("Paged optimizer states"))
    paged, resident, host = (float(g.replace(",", "")) for g in re.findall(
        r"([\d,.]+) GB", line)[:3])
    assert paged == pytest.approx(8 * 6_738_415_616 / 1e9, abs=0.01)
    assert 0 < resident < paged and host == pytest.approx(paged - resident, abs=0.002)

def test_megatron_profile_lists_its_tensors() -> None:
    sections = _explain("--model", "70b", "--gpus", "64xH100", "--tp", "8", "--pp", "2",
                        "--framework", "megatron", "--sequence-parallel", "--zero", "1")
    text = "\n".join(sections["Activations"])
    for name in ("QKV GEMM input", "fc1 input", "fc2 input", "flash softmax statistics"):
        assert name in text


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatron_tensors_add_up_to_korthikanti_eq_2(tp: int) -> None:
    """No sequence parallelism, unfused attention with dropout, a 4h GeLU MLP: the paper's
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes per layer."""
    s, b, h, a = 1024, 2, 1024, 16  # GPT-2 medium
    scn = build_scenario({"model": "gpt2-medium", "gpus": f"{tp}xH100", "tp": tp,
                          "framework": "megatron", "attention": "eager", "seq_len": s,
                          "micro_batch_size": b})
    ctx = RankContext(scn.model, scn.training, scn.parallel, 0)
    paper = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    tensors = megatron_layer_tensors(ctx)
    assert sum(t[2] for t in tensors) == pytest.approx(paper, abs=1)
    assert megatron_layer_bytes(ctx) == pytest.approx(paper, abs=1)
    assert {"softmax output", "attention dropout mask", "attention dropout output"} <= {
        t[0] for t in tensors}


def test_encoder_decoder_sections_write_out_both_stacks() -> None:
    """BART-large (h 1024, 16 heads, FFN 4096, 12 + 12 layers; facebook/bart-large
    config.json), bf16 weights, SDPA, b 4, 512 source / 128 target tokens: per encoder layer,
    by hand from modeling_bart.py (T = b·s = 2048 tokens): q, k, v and the kernel's output
    4·T·h·2 B, its fp32 logsumexp b·a·s·4 B, two (T, h) dropout masks, the two residual sums
    and two LayerNorm outputs (T·h·2 B each) with fp32 mean and 1/std (T·4 B each), fc1's
    output and the activation-dropout output (T·f·2 B each) and its (T, f) mask."""
    s = _explain("--model", "bart-large", "--seq-len", "512", "--target-len", "128",
                 "--micro-batch-size", "4", "--precision", "bf16")
    T, h, f = 4 * 512, 1024, 4096
    enc = (4 * T * h * 2 + 4 * 16 * 512 * 4 + 2 * T * h + 4 * T * h * 2 + 4 * T * 4
           + 2 * T * f * 2 + T * f)
    lines = s["Activations"]
    per_enc = next(x for x in lines if "encoder layers" in x)
    assert per_enc.startswith(f"= {enc / 1e9:.3f} GB per layer x 12 encoder layers"), per_enc
    assert any("cross.k" in x and "(b, a, k, d)" in x for x in lines)  # keys at s tokens
    assert any(x.startswith("Decoder layer over t=128") for x in lines)
    assert "25,735,680 logits" in s["Logits and loss"][0]  # b·t·V = 4·128·50,265
    # T5 under gradient checkpointing lists the checkpoints
    t5 = _explain("--model", "t5-base", "--seq-len", "512", "--recompute", "full")
    assert any("keeps only its inputs" in x for x in t5["Activations"])


def test_transients_name_the_edge_units_gathers() -> None:
    sections = _explain("--model", "llama3.1-70b", "--gpus", "8xA100-80GB", "--fsdp", "full",
                        "--fsdp-edge-units")
    lines = " ".join(sections["Transients"])
    # Llama-3.1-70B by hand, bf16: a block 855,654,400 elements (q, o 8192²; k, v 8192·1024;
    # gate, up, down 8192·28672; two norms), the head 128256·8192, the final norm 8192
    block, head, norm = 855_654_400 * 2, 128_256 * 8192 * 2, 8192 * 2
    assert f"at the head and the loss {(norm + head + block) / 1e9:,.3f} GB" in lines
    assert f"at the embedding's backward {(norm + head) / 1e9:,.3f} GB" in lines
