"""`vramcalc serve --engine vllm-v0`: vLLM's V0 engine of v0.6.4.post1 against the start-up log
its users published, and the rules read from that release's source.

The log: vllm-project/vllm issue #10517, comment by kaspersiminski (2024-12-02), `vllm serve
meta-llama/Llama-3.1-8B-Instruct` on one RTX 3090, with --max-model-len 20000 ("OK") and 29000
("BAD"); that log format ("Memory profiling results: total_gpu_memory=… initial_memory_usage=…
peak_torch_memory=…") is the one of v0.6.4 (vllm/worker/worker.py lines 232-243; v0.6.5
replaced it, PR #10511):

    Loading model weights took 14.9888 GB
    [20k] total_gpu_memory=23.58GiB initial_memory_usage=15.34GiB peak_torch_memory=17.06GiB
          memory_usage_post_profile=15.35GiB non_torch_memory=0.35GiB kv_cache_size=3.81GiB
          gpu_memory_utilization=0.90 / GPU blocks: 1952 / Maximum concurrency for 20000
          tokens per request: 1.56x
    [29k] … peak_torch_memory=17.98GiB … non_torch_memory=0.35GiB kv_cache_size=2.89GiB …
          # GPU blocks: 1478 / Maximum concurrency for 29000 tokens per request: 0.82x /
          The model's max seq len (29000) is larger than the maximum number of tokens that can
          be stored in KV cache (23648).

The source lines (vllm-project/vllm v0.6.4.post1, the release's sdist):
- worker.py 188-217 `determine_num_available_blocks`: peak = allocated_bytes.all.peak after
  profile_run, plus non-torch = (total − free) − torch allocated; KV = total × util − peak.
- model_runner.py 1071-1078 `load_model`: "Loading model weights took %.4f GB" prints
  torch memory / 2**30 (GiB); rotary_embedding.py 95-98: the cos/sin cache is a buffer in
  the model dtype.
- config.py 1103-1118, arg_utils.py 996-1020: without chunked prefill (max_model_len ≤ 32,768)
  max_num_batched_tokens = max(max_model_len, 2048); max_num_seqs 256 (arg_utils.py 123).
- models/llama.py 338-341: the model's loop keeps `hidden_states` (the layer's input) while the
  layer runs; llama.py 93-95: the MLP's gate_up and activation.
- sampler.py 269, 426-452: the fp32 logits and the top-k/top-p buffers; the sort's scratch
  from pytorch/pytorch aten/src/ATen/native/cuda/SortStable.cu and cub's radix sort.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from vramcalc.catalog import resolve_model
from vramcalc.cli import app
from vramcalc.hardware import Cluster, parse_gpus
from vramcalc.serve import ServeConfig, ServeReport, serve_estimate, vllm_v0

GiB = 2**30
runner = CliRunner()
LOGGED = {  # max_model_len: (peak_torch_memory, kv_cache_size, GPU blocks, concurrency)
    20000: (17.06, 3.81, 1952, 1.56),
    29000: (17.98, 2.89, 1478, 0.82),
}


def v0(max_model_len: int, cluster: Cluster | None = None) -> ServeReport:
    spec = resolve_model("llama3.1-8b")[0]
    return serve_estimate(spec, cluster or parse_gpus("RTX3090"),
                          ServeConfig(engine="vllm-v0", max_model_len=max_model_len))


def test_weights_as_logged() -> None:
    """"Loading model weights took 14.9888 GB" (GiB): the 8,030,261,248 bf16 parameters of
    Llama-3.1-8B (config.json: 32 layers, hidden 4096, intermediate 14336, 8 KV heads, vocab
    128,256, untied) plus one rotary cos/sin cache of max_position_embeddings 131,072 ×
    head dim 128 in bf16 (32 MiB)."""
    by_hand = 8_030_261_248 * 2 + 131_072 * 128 * 2
    assert round(by_hand / GiB, 4) == 14.9888
    assert v0(20000).terms.weights == by_hand


def test_profile_peak_as_logged() -> None:
    """peak_torch_memory = weights + the profiling run's peak: 17.06 GiB at 20,000 batched
    tokens, 17.98 GiB at 29,000. The peak sits in the MLP of every layer after the first:
    the loop's layer input, residual, the MLP's input (h each), gate_up (2f) and the
    activation (f) in bf16, plus 24 B of int64 inputs per token and PyTorch's 8,519,680-byte
    cuBLAS workspace (sm86)."""
    h, f = 4096, 14336
    per_token = (3 * h + 3 * f) * 2 + 24
    for tokens, (peak_gib, *_) in LOGGED.items():
        report = v0(tokens)
        by_hand = report.terms.weights + tokens * per_token + 8_519_680
        assert report.terms.activation_peak + report.terms.weights == by_hand
        assert round(by_hand / GiB, 2) == peak_gib
    # the two logs alone give the bytes per token (±0.01 GiB of rounding over 9,000 tokens):
    # one residual-stream tensor (h) more than the compiled V1 forward's 2h + 3f
    low, high = (0.92 - 0.01) * GiB / 9000, (0.92 + 0.01) * GiB / 9000
    assert low <= per_token <= high
    assert not low <= (2 * h + 3 * f) * 2 <= high


def test_budget_arithmetic_with_the_logged_terms() -> None:
    """With the logged device total (23.58 GiB) and non-torch memory (0.35 GiB, the CUDA
    context V0 counts inside the budget) the estimate gives the logged kv_cache_size and
    block count: the budget rule and the peak together, to the log's rounding."""
    gpu = parse_gpus("RTX3090").gpu.model_copy(update={
        "memory_total_bytes": int(23.58 * GiB), "context_overhead_bytes": int(0.35 * GiB)})
    cluster = Cluster(gpu=gpu, num_nodes=1, gpus_per_node=1)
    for tokens, (_, kv_gib, blocks, _) in LOGGED.items():
        report = v0(tokens, cluster)
        t = report.terms
        kv_memory = int(0.9 * gpu.memory_total_bytes) - t.weights - t.activation_peak - t.non_torch
        assert round(kv_memory / GiB, 2) == kv_gib
        assert abs(report.kv_capacity_blocks - blocks) <= 2  # the total is rounded in the log


def test_capacity_within_five_percent_end_to_end() -> None:
    """The shipped RTX 3090 profile (25,327,697,920 B, a 500 MiB context planning default)
    against the logged kv_cache_size, GPU blocks and concurrency: within 5 %; 20k starts and
    29k is refused, as logged."""
    for tokens, (_, kv_gib, blocks, concurrency) in LOGGED.items():
        report = v0(tokens)
        t = report.terms
        kv_memory = (int(0.9 * report.memory_total_bytes) - t.weights - t.activation_peak
                     - t.non_torch)
        assert kv_memory == pytest.approx(kv_gib * GiB, rel=0.05)
        assert report.kv_capacity_blocks == pytest.approx(blocks, rel=0.05)
        assert round(blocks * 16 / tokens, 2) == concurrency  # the log's own arithmetic
        assert report.max_concurrency == pytest.approx(blocks * 16 / tokens, rel=0.05)
        assert report.kv_capacity_tokens == report.kv_capacity_blocks * 16
        assert (report.max_num_seqs, report.max_num_batched_tokens) == (256, tokens)
    assert v0(20000).fits
    refused = v0(29000)
    assert not refused.fits and "0.78 sequences" in refused.reasons[0]


def test_defaults_and_refusals() -> None:
    """config.py 1103-1118 / arg_utils.py 996-1020: chunked prefill by default above 32,768
    tokens (512 batched tokens) except for sliding-window models; config.py 1164: fewer batched
    tokens than sequences is refused; MLA models are not modelled for V0."""
    llama, mistral = resolve_model("llama3.1-8b")[0], resolve_model("mistral-7b")[0]
    assert vllm_v0.batch_defaults(llama, 4096) == (256, 4096)
    assert vllm_v0.batch_defaults(llama, 1024) == (256, 2048)
    assert vllm_v0.batch_defaults(llama, 35000) == (256, 512)
    assert vllm_v0.batch_defaults(mistral.model_copy(update={"max_position_embeddings": 65536}),
                                  40000) == (256, 40000)
    # _get_max_graph_batch_size: 1, 2, 4, then multiples of 8 up to 8192
    assert [vllm_v0.graph_batch(n) for n in (1, 3, 5, 256, 257, 10_000)] == [
        1, 4, 8, 256, 264, 8192]
    for args in (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"],
                 ["--model", "deepseek-v3"]):
        argv = ["serve", "--model", "llama3.1-8b", "--engine", "vllm-v0", *args]
        res = subprocess.run([sys.executable, "-m", "vramcalc", *argv], capture_output=True,
                             text=True)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert lines[0].startswith("error: ") and "vllm-v0" in lines[0]


def test_sampler_by_hand() -> None:
    """A short profiling run (512 tokens, 256 sequences: chunked prefill's default) peaks in
    the sampler's sort (sampler.py 431; pytorch SortStable.cu `segmented_sort_pairs` for 128
    rows or more): bf16 logits (2 B), their fp32 copy (4), the sorted values (4) and int64
    indices (8), the int64 reverse indices (8) and cub's third key and value buffers (4 + 8)
    per logit, beside the forward's output and the inputs; plus the cuBLAS workspace. The
    later scatter holds 32 B per logit; 2 to 127 rows sort through two int2 arrays, a key
    output and cub's buffers (50 B)."""
    spec = resolve_model("llama3.1-8b")[0]
    report = serve_estimate(spec, parse_gpus("RTX3090"),
                            ServeConfig(engine="vllm-v0", max_model_len=35000))
    assert report.max_num_batched_tokens == 512
    by_hand = 256 * 128_256 * (2 + 4 + 4 + 8 + 8 + 4 + 8) + 512 * (4096 * 2 + 24) + 8_519_680
    assert report.terms.activation_peak == by_hand
    assert report.terms.context_nccl == 0  # inside non-torch for V0
    assert report.terms.non_torch == parse_gpus("RTX3090").gpu.context_overhead_bytes
    assert [vllm_v0.sampler_bytes_per_logit(r) for r in (1, 2, 127, 128)] == [38, 50, 50, 38]


@pytest.mark.parametrize("tp", [1, 2])
def test_profile_peak_against_vllm_pr_10511(tp: int) -> None:
    """vllm PR #10511 (youkaichao, 2024-12-13), `vllm serve meta-llama/Meta-Llama-3-8B` on
    H100s (V0, the release after v0.6.4; its profile_run, sampler.py and llama.py forward are
    unchanged from v0.6.4.post1, torch 2.5.1 in both): "PyTorch activation peak memory
    1.26GiB" with -tp 1 and -tp 2 alike. 8,192 batched tokens, 256 sequences: the sampler's
    sort (256 × 128,256 logits × 38 B) outweighs the forward, and the driver gathers the
    whole vocabulary at TP 2 too, so the peak does not halve; plus H100's 32 MiB cuBLAS
    workspace."""
    spec = resolve_model("llama3-8b")[0]
    report = serve_estimate(spec, parse_gpus(f"{tp}xH100"),
                            ServeConfig(engine="vllm-v0", tp=tp))
    by_hand = 256 * 128_256 * 38 + 8192 * (4096 * 2 + 24) + 32 * 2**20
    assert report.terms.activation_peak == by_hand
    assert round(by_hand / GiB, 2) == 1.26
    # "model weights take 14.96GiB" / "7.48GiB", the rotary buffer (8192 × 128 × 2) included
    assert round(report.terms.weights / GiB, 2) == {1: 14.96, 2: 7.48}[tp]


def test_cli_json() -> None:
    result = runner.invoke(app, ["serve", "--model", "llama3.1-8b", "--gpus", "RTX3090",
                                 "--engine", "vllm-v0", "--max-model-len", "20000", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["engine"] == "vllm-v0" and doc["kv_capacity_blocks"] == v0(20000).kv_capacity_blocks
    assert "v0.6.4" in doc["engine_source"]


def test_no_room_for_the_cache() -> None:
    """worker.py 226-230: blocks = max(budget // block, 0); a budget below the torch peak and
    the non-torch memory leaves none (worker.py 493 then refuses: "No available memory for the
    cache blocks"); exit code 1."""
    result = runner.invoke(app, ["serve", "--model", "llama3.1-8b", "--gpus", "RTX3090",
                                 "--engine", "vllm-v0", "--gpu-memory-utilization", "0.5",
                                 "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["kv_capacity_blocks"] == 0
    assert doc["reasons"][0].endswith("after weights and the profiling peak")
