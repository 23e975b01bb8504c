"""`vramcalc serve`: KV bytes per token derived by hand from each model's config.json, the
engines' block arithmetic against published start-up logs, the quantized layouts counted
from the engines' `create_weights`, and the command's exit codes.

Sources of the published figures (each test names its own):
- vllm-project/vllm PR #10511 (youkaichao, 2024-12-13): `vllm serve meta-llama/Meta-Llama-3-8B`
  on one H100 (79.22 GiB), gpu_memory_utilization 0.90: "model weights take 14.96GiB",
  "available_kv_cache_memory 53.29GiB"; with -tp 2 "model weights take 7.48GiB".
- vllm-project/vllm issue #10517 (kaspersiminski, 2024-12-02): Llama-3.1-8B-Instruct on an
  RTX 3090, max-model-len 20000: "kv_cache_size=3.81GiB", "# GPU blocks: 1952",
  "Maximum concurrency for 20000 tokens per request: 1.56x"; at 29000: "kv_cache_size=2.89GiB",
  "# GPU blocks: 1478", "... maximum number of tokens that can be stored in KV cache (23648)".
- kubernetes-sigs/gateway-api-inference-extension PR #550 (liu-cong, 2025-03-21): vLLM serving
  meta-llama/Llama-2-7b-hf on one H100: "model weights take 12.55GiB", "the rest of the memory
  reserved for KV Cache is 56.18GiB", "# cuda blocks: 7191".
- vllm-project/vllm issue #21348 (MMuzzammil1, 2025-07-22): Qwen3-235B-A22B-FP8 on 4xH100,
  SGLang --tp 4: "KV Cache is allocated. #tokens: 367404, K size: 8.23 GB" (SGLang prints GiB
  as "GB"); vLLM --tensor-parallel-size 4: "Available KV cache memory: 8.11 GiB",
  "GPU KV cache size: 178,880 tokens".
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tests.test_catalog import DEEPSEEK_V3, GEMMA2_9B
from vramcalc.catalog import resolve_model
from vramcalc.cli import app
from vramcalc.errors import InputError
from vramcalc.hardware import parse_gpus
from vramcalc.hf_config import from_hf_config
from vramcalc.model import ModelSpec
from vramcalc.serve import ServeConfig, serve_estimate
from vramcalc.serve.kv import (
    block_groups,
    blocks_per_request,
    kv_layout,
    layer_token_bytes,
    stage_layers,
)
from vramcalc.serve.weights import quantized_matrix_bytes, stage_weight_bytes

GiB = 2**30
runner = CliRunner()


def kv_per_token(model: str | ModelSpec, tp: int = 1, dtype_bytes: int = 2) -> int:
    spec = resolve_model(model)[0] if isinstance(model, str) else model
    return kv_layout(spec, tp, 0, spec.num_hidden_layers, dtype_bytes).bytes_per_token


# ---- KV bytes per token, by hand from config.json -----------------------------------------
@pytest.mark.parametrize(("model", "expected"), [
    # meta-llama/Llama-3.1-8B: 32 layers, 8 KV heads, 4096 / 32 = 128 head dim, K and V, bf16
    ("llama3.1-8b", 32 * 8 * 128 * 2 * 2),  # 131,072 B = 128 KiB
    # meta-llama/Llama-3.1-70B: 80 layers, 8 KV heads, 8192 / 64 = 128
    ("llama3.1-70b", 80 * 8 * 128 * 2 * 2),  # 327,680 B = 320 KiB
    # Qwen/Qwen2.5-7B: 28 layers, 4 KV heads, 3584 / 28 = 128
    ("qwen2.5-7b", 28 * 4 * 128 * 2 * 2),  # 57,344 B = 56 KiB
    # mistralai/Mistral-7B-v0.1: 32 layers, 8 KV heads, 4096 / 32 = 128 (each layer local)
    ("mistral-7b", 32 * 8 * 128 * 2 * 2),
    # google/gemma-2-9b: 42 layers, 8 KV heads, head_dim 256
    ("gemma2-9b", 42 * 8 * 256 * 2 * 2),  # 344,064 B = 336 KiB
    # deepseek-ai/DeepSeek-V3: 61 layers, one latent of kv_lora_rank 512 + qk_rope_head_dim
    # 64 per token and layer, no separate K and V
    ("deepseek-v3", 61 * (512 + 64) * 2),  # 70,272 B
])
def test_kv_bytes_per_token(model: str, expected: int) -> None:
    assert kv_per_token(model) == expected


def test_kv_from_config_files() -> None:
    gemma = from_hf_config(GEMMA2_9B, "gemma-2-9b/config.json")
    assert (gemma.sliding_window, gemma.num_sliding_layers) == (4096, 21)  # layers 0, 2, ...
    assert [gemma.layer_is_sliding(i) for i in range(4)] == [True, False, True, False]
    assert kv_per_token(gemma) == 42 * 8 * 256 * 2 * 2
    ds = from_hf_config(DEEPSEEK_V3, "DeepSeek-V3/config.json")
    assert kv_per_token(ds) == 61 * 576 * 2
    assert kv_per_token(ds, tp=8) == 61 * 576 * 2  # the latent is the same on every TP rank


def test_sliding_window_config_keys() -> None:
    base = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 32000}
    assert from_hf_config({**base, "sliding_window": 4096}, "m").sliding_window == 4096
    assert from_hf_config({**base, "sliding_window": None}, "m").sliding_window is None
    g3 = {**GEMMA2_9B, "model_type": "gemma3_text", "num_hidden_layers": 12,
          "sliding_window": 1024,
          "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2}
    spec = from_hf_config(g3, "g3")
    assert (spec.sliding_window, spec.sliding_window_pattern, spec.num_sliding_layers) == (
        1024, 6, 10)
    with pytest.raises(InputError, match="layer_types"):
        from_hf_config({**g3, "layer_types": ["full_attention", "sliding_attention"] * 6}, "g3")


def test_kv_heads_under_tensor_parallelism() -> None:
    spec = resolve_model("llama3.1-70b")[0]  # 8 KV heads
    per_head = 80 * 128 * 2 * 2
    assert kv_per_token(spec, tp=4) == 2 * per_head
    assert kv_per_token(spec, tp=8) == 1 * per_head
    assert kv_per_token(spec, tp=16) == 1 * per_head  # replicated: one head on every rank
    with pytest.raises(InputError, match="KV heads"):
        layer_token_bytes(spec, 3, 2)


def test_sequence_bytes_with_sliding_layers() -> None:
    # Mistral 7B v0.1: every layer keeps at most 4096 tokens; 4 KiB per layer and token
    mistral = resolve_model("mistral-7b")[0]
    layout = kv_layout(mistral, 1, 0, 32, 2)
    assert layout.sequence_bytes(8192) == 32 * 4096 * (8 * 128 * 2 * 2)
    # Gemma 2 9B: 21 global layers keep 8192 tokens, 21 local ones 4096; 8 KiB per layer-token
    gemma = resolve_model("gemma2-9b")[0]
    layout = kv_layout(gemma, 1, 0, 42, 2)
    assert layout.sequence_bytes(8192) == (21 * 8192 + 21 * 4096) * (8 * 256 * 2 * 2)


def test_vllm_block_groups() -> None:
    """kv_cache_utils.py: group size = the smaller type's layer count unless the larger is
    under 1.25 × it. Gemma 2 (21 + 21): two groups of 21. Gemma 3 27B (10 full + 52
    sliding): groups of 10, 1 full + 6 sliding (the last padded). A sliding group needs
    min(cdiv(window − 1 + batched, 16) + 1, cdiv(len, 16)) blocks per request."""
    gemma = resolve_model("gemma2-9b")[0]
    g = block_groups(kv_layout(gemma, 1, 0, 42, 2))
    assert (g.num_full_groups, g.num_sliding_groups, g.group_size) == (1, 1, 21)
    g3 = gemma.model_copy(update={"num_hidden_layers": 62, "sliding_window_pattern": 6})
    layout = kv_layout(g3, 1, 0, 62, 2)
    g = block_groups(layout)
    assert (g.num_full_groups, g.num_sliding_groups, g.group_size) == (1, 6, 10)
    # 32768-token requests, 2048 batched tokens: full 2048 blocks; local cdiv(6143, 16) + 1
    assert blocks_per_request(layout, g, 32768, 2048, 16) == 2048 + 6 * (384 + 1)


def test_pipeline_stages_like_vllm() -> None:
    # vLLM get_pp_indices: 61 layers over 4 stages -> 15 each, the remainder to stage 2
    assert [n for _, n in stage_layers(61, 4)] == [15, 15, 16, 15]
    assert stage_layers(32, 2) == ((0, 16), (16, 16))


# ---- block arithmetic against published vLLM and SGLang logs --------------------------------
def test_vllm_blocks_from_logged_kv_memory() -> None:
    """vllm#10517, Llama-3.1-8B: a block is 16 tokens × 128 KiB = 2 MiB, so the logged KV
    memory (rounded to 0.01 GiB) gives the logged block counts, and tokens = blocks × 16."""
    spec = resolve_model("llama3.1-8b")[0]
    layout = kv_layout(spec, 1, 0, 32, 2)
    block = layout.layer_token_bytes * 16 * block_groups(layout).group_size
    assert block == 2 * 2**20
    for logged_gib, blocks in ((3.81, 1952), (2.89, 1478)):
        low, high = int((logged_gib - 0.005) * GiB), int((logged_gib + 0.005) * GiB)
        assert low // block <= blocks <= high // block
    assert 1478 * 16 == 23648  # "maximum number of tokens that can be stored in KV cache"
    assert round(1952 / blocks_per_request(layout, block_groups(layout), 20000, 20000, 16),
                 2) == 1.56
    # gateway-api-inference-extension#550, Llama-2-7B (32 KV heads): 8 MiB blocks
    llama2 = resolve_model("llama2-7b")[0]
    layout = kv_layout(llama2, 1, 0, 32, 2)
    assert layout.layer_token_bytes * 16 * 32 == 8 * 2**20
    assert int(56.18 * GiB) // (8 * 2**20) == 7191


def test_vllm_capacity_llama3_8b_h100() -> None:
    """vLLM PR #10511: Meta-Llama-3-8B on one H100, utilization 0.90, default max-model-len
    8192 (its max_position_embeddings; V0 then ran the profile at max_model_len tokens and
    256 sequences, its max_num_seqs default): weights 14.96 GiB, available KV 53.29 GiB.
    Predicted within 5 %."""
    spec = resolve_model("llama3-8b")[0]
    report = serve_estimate(spec, parse_gpus("1xH100"),
                            ServeConfig(max_num_batched_tokens=8192, max_num_seqs=256))
    assert round(report.terms.weights / GiB, 2) == 14.96
    assert report.terms.kv_cache == pytest.approx(53.29 * GiB, rel=0.05)
    tp2 = serve_estimate(spec, parse_gpus("2xH100"), ServeConfig(tp=2))
    assert round(tp2.terms.weights / GiB, 2) == 7.48
    assert round(serve_estimate(resolve_model("llama2-7b")[0], parse_gpus("1xH100"),
                                ServeConfig()).terms.weights / GiB, 2) == 12.55


def qwen3_235b() -> ModelSpec:
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, 64 heads, 4 KV heads, head_dim 128
    return from_hf_config({
        "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
    }, "Qwen3-235B-A22B/config.json")


def test_sglang_cell_size_qwen3_235b() -> None:
    """vllm#21348: SGLang TP 4 allocated 367,404 tokens with K = 8.23 GiB. A cell is one KV
    head per rank (4 heads / 4) × 128 × 2 B per layer for K, and as much for V."""
    spec = qwen3_235b()
    cell = kv_layout(spec, 4, 0, 94, 2).bytes_per_token
    assert cell == 94 * 1 * 128 * 2 * 2
    assert round(367404 * cell / 2 / GiB, 2) == 8.23
    # vLLM, same model and TP: 8.11 GiB of KV memory -> tokens within 5 % of 178,880
    layout = kv_layout(spec, 4, 0, 94, 2)
    blocks = int(8.11 * GiB) // (layout.layer_token_bytes * 16 * 94)
    assert blocks * 16 == pytest.approx(178880, rel=0.05)


# ---- quantized weights -------------------------------------------------------------------
def test_quantized_layouts_by_hand() -> None:
    out, inp = 4096, 4096
    n = out * inp
    assert quantized_matrix_bytes(out, inp, "none") == 2 * n
    assert quantized_matrix_bytes(out, inp, "fp8") == n + 4
    assert quantized_matrix_bytes(out, inp, "int8") == n + 4 * out
    # AWQ (awq.py): qweight int32 (4096, 4096/8), qzeros int32 (4096/128, 4096/8),
    # scales fp16 (4096/128, 4096)
    awq = 4096 * 512 * 4 + 32 * 512 * 4 + 32 * 4096 * 2
    assert quantized_matrix_bytes(out, inp, "awq") == awq
    # GPTQ (gptq.py): the same plus g_idx int32 (4096,)
    assert quantized_matrix_bytes(out, inp, "gptq") == awq + 4096 * 4
    # bitsandbytes NF4 (Params4bit, double quantization): packed 4-bit data, uint8 absmax per
    # 64 values, fp32 absmax per 256 of those, the 256-entry fp32 code, an fp32 offset and the
    # 16-entry NF4 table; each small tensor a 512-byte allocator block
    nf4 = n // 2 + n // 64 + 4 * (n // 64 // 256) + 256 * 4 + 512 + 512
    assert quantized_matrix_bytes(out, inp, "bnb-nf4") == nf4


def test_unquantized_weights_are_the_parameters() -> None:
    for model in ("llama3-8b", "mixtral-8x7b", "deepseek-v3", "gemma2-9b", "qwen2.5-7b"):
        spec = resolve_model(model)[0]
        w = stage_weight_bytes(spec, 1, 0, spec.num_hidden_layers, 1, 0, "none")
        assert w.total == 2 * spec.num_params


def test_sharding_never_undercounts() -> None:
    spec = resolve_model("mixtral-8x7b")[0]
    whole = 2 * spec.num_params
    for tp in (2, 4, 8):
        for ep in (False, True):
            per_rank = stage_weight_bytes(spec, tp, 0, 32, 1, 0, "none", ep).total
            assert tp * per_rank >= whole
            assert per_rank < whole / tp * 1.2  # only norms, routers and padding repeat
    stages = [stage_weight_bytes(spec, 1, f, n, 2, s, "none").total
              for s, (f, n) in enumerate(stage_layers(32, 2))]
    assert sum(stages) == whole


# ---- the estimate's behaviour -------------------------------------------------------------
def test_fp8_kv_doubles_capacity_and_batched_tokens_cost_kv() -> None:
    spec, h100 = resolve_model("llama3.1-8b")[0], parse_gpus("1xH100")
    auto = serve_estimate(spec, h100, ServeConfig(max_model_len=8192))
    fp8 = serve_estimate(spec, h100, ServeConfig(max_model_len=8192, kv_cache_dtype="fp8"))
    assert fp8.kv_capacity_blocks in (2 * auto.kv_capacity_blocks,
                                      2 * auto.kv_capacity_blocks + 1)
    big = serve_estimate(spec, h100, ServeConfig(max_model_len=8192,
                                                 max_num_batched_tokens=32768))
    assert big.terms.activation_peak > auto.terms.activation_peak
    assert big.kv_capacity_blocks < auto.kv_capacity_blocks


def test_terms_add_up_and_verdict() -> None:
    spec = resolve_model("llama3.1-70b")[0]
    report = serve_estimate(spec, parse_gpus("1xH100"), ServeConfig(max_model_len=8192))
    assert not report.fits and report.reasons
    assert report.device_total_bytes == sum(report.terms.as_dict().values())
    ok = serve_estimate(spec, parse_gpus("4xH100"), ServeConfig(tp=4, max_model_len=8192))
    assert ok.fits and ok.max_concurrent_seqs >= 1


# ---- the command ---------------------------------------------------------------------------
def test_cli_json_and_exit_codes() -> None:
    res = runner.invoke(app, ["serve", "--model", "llama3.1-8b", "--gpus", "1xH100",
                              "--max-model-len", "8192", "--json"])
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert doc["kv"]["bytes_per_token"] == 131072
    assert doc["kv"]["num_layers"] == 32 and doc["kv"]["kv_heads_per_gpu"] == 8
    assert runner.invoke(app, ["serve", "--model", "llama3.1-70b", "--gpus", "1xH100",
                               "--max-model-len", "8192"]).exit_code == 1
    md = runner.invoke(app, ["serve", "--model", "gemma2-9b", "--markdown"])
    assert "| KV cache |" in md.stdout and "sliding window" in md.stdout


@pytest.mark.parametrize("args", [
    ["--model", "llama3-8b", "--tp", "3", "--gpus", "3xH100"],  # 32 heads
    ["--model", "llama3-8b", "--quantization", "int3"],
    ["--model", "llama3-8b", "--engine", "tgi"],
    ["--model", "llama3-8b", "--kv-cache-dtype", "int4"],
    ["--model", "llama3-8b", "--gpu-memory-utilization", "0"],
    ["--model", "llama3-8b", "--max-model-len", "1000000"],
    ["--model", "llama3-8b", "--pp", "64", "--gpus", "64xH100"],
    ["--model", "llama3-8b", "--engine", "hf", "--tp", "2", "--gpus", "2xH100"],
    ["--model", "nope"],
    [],
])
def test_cli_bad_input(args: list[str]) -> None:
    res = subprocess.run([sys.executable, "-m", "vramcalc", "serve", *args],
                         capture_output=True, text=True)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_aliases_run_serve_without_torch() -> None:
    code = ("import sys; from vramcalc.cli import main; "
            "rc = main(['infer', '--model', 'llama3-8b', '--json']); "
            "rc2 = main(['estimate', '--model', 'llama3-8b', '--mode', 'inference', "
            "'--seq-len', '4096', '--json']); "
            "assert rc == 0 and rc2 == 0, (rc, rc2); assert 'torch' not in sys.modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    docs = [json.loads(d) for d in res.stdout.replace("}\n{", "}\n\x00{").split("\x00")]
    assert docs[1]["max_model_len"] == 4096 and docs[0]["engine"] == "vllm"


def test_hf_static_cache_by_hand() -> None:
    """HF generate, static cache: 4 sequences × 4096 tokens × 128 KiB (Llama-3-8B) = 2 GiB
    allocated up front; Gemma 2's local layers keep min(window, max_cache_len) positions."""
    spec = resolve_model("llama3-8b")[0]
    r = serve_estimate(spec, parse_gpus("RTX4090"),
                       ServeConfig(engine="hf", max_model_len=4096, max_num_seqs=4))
    assert r.terms.kv_cache == 4 * 4096 * 131072 == 2 * GiB
    assert r.terms.weights == 2 * spec.num_params
    gemma = resolve_model("gemma2-9b")[0]
    r = serve_estimate(gemma, parse_gpus("H100"),
                       ServeConfig(engine="hf", max_model_len=8192, max_num_seqs=1))
    assert r.terms.kv_cache == (21 * 8192 + 21 * 4096) * 8 * 256 * 2 * 2


# ---- plan --serve / size --serve ----------------------------------------------------------
def test_serve_plan_ranks_layouts_that_hold_the_concurrency() -> None:
    from vramcalc.serve.plan import serve_options

    spec = resolve_model("llama3.1-70b")[0]
    gpu = parse_gpus("H100").gpu
    base = ServeConfig(max_model_len=8192)
    options = serve_options(spec, [gpu], base, 100)
    assert options == serve_options(spec, [gpu], base, 100)  # deterministic
    assert [o.num_gpus for o in options] == sorted(o.num_gpus for o in options)
    for o in options:
        assert o.report.fits and o.replicas * o.report.max_concurrent_seqs >= 100
        assert (o.replicas - 1) * o.report.max_concurrent_seqs < 100  # no spare copy
    # 141 GB of bf16 weights (2 × 70,553,706,496 parameters) cannot sit on one 85 GB GPU
    assert min(o.gpus_per_copy for o in options) >= 2


def test_size_serve_costs_per_month() -> None:
    res = runner.invoke(app, ["size", "--serve", "--model", "llama3-8b", "--gpu", "H100",
                              "--gpu", "A100-80GB", "--concurrency", "300", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert {r["gpu"] for r in rows} == {"h100_sxm", "a100_80gb"}
    for r in rows:
        price = parse_gpus(r["gpu"]).gpu.price_usd_per_hour
        assert r["usd_per_month"] == pytest.approx(price * r["num_gpus"] * 730)
        assert r["replicas"] * r["seqs_per_copy"] >= 300
    res = subprocess.run([sys.executable, "-m", "vramcalc", "plan", "--serve", "--model",
                          "llama3-8b", "--concurrency", "0"], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("error: --concurrency")


# ---- probe --run --compare serve -----------------------------------------------------------
def test_engine_command_lines_read_as_serve_options() -> None:
    from vramcalc.serve.command import parse_serve_command

    model, values = parse_serve_command(
        ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--max-model-len", "8192", "-tp", "2",
         "--enforce-eager", "--gpu-memory-utilization=0.85", "--kv-cache-dtype", "fp8_e4m3",
         "--quantization", "awq_marlin"])
    assert model == "meta-llama/Llama-3.1-8B"
    assert values == {"engine": "vllm", "max_model_len": 8192, "tp": 2, "enforce_eager": True,
                      "gpu_memory_utilization": 0.85, "kv_cache_dtype": "fp8",
                      "quantization": "awq"}
    model, values = parse_serve_command(
        ["python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-7B", "--tp",
         "4", "--mem-fraction-static", "0.8", "--context-length", "32768"])
    assert (model, values["engine"], values["tp"]) == ("Qwen/Qwen2.5-7B", "sglang", 4)
    assert values["gpu_memory_utilization"] == 0.8 and values["max_model_len"] == 32768
    for bad in (["python", "train.py"], ["vllm", "serve", "m", "--max-model-len", "lots"],
                ["vllm", "serve", "m", "--quantization", "gguf"]):
        with pytest.raises(InputError):
            parse_serve_command(bad)


def test_probe_compare_serve_estimate() -> None:
    from vramcalc.cli.probe import _serve_estimate_for_command

    doc = _serve_estimate_for_command(
        ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--max-model-len", "8192"], "H100", None)
    serve = doc["serve"]
    terms = serve["terms"]
    assert doc["peak_allocated_bytes"] == (terms["weights"] + terms["activation_peak"]
                                           + terms["kv_cache"])
    assert serve["model"] == "llama3.1-8b" and serve["max_model_len"] == 8192


@pytest.mark.parametrize("engine", ["vllm", "vllm-v0", "sglang"])
def test_a_cache_too_small_names_the_longest_max_model_len(engine: str) -> None:
    # as vLLM's start-up check does ("the estimated maximum model length is N"): the cache's
    # capacity in tokens, which then fits, and one block more does not
    base = ["serve", "--model", "llama3.1-8b", "--gpus", "RTX4090", "--engine", engine]
    doc = json.loads(runner.invoke(app, [*base, "--max-model-len", "131072", "--json"]).stdout)
    longest = doc["kv_capacity_tokens"]
    assert not doc["fits"] and 1024 < longest < 131072
    assert any(f"lower --max-model-len to at most {longest} " in r for r in doc["reasons"])
    step = 1 if engine == "sglang" else 16  # SGLang keeps one cell per token
    at = json.loads(runner.invoke(app, [*base, "--max-model-len", str(longest), "--json"]).stdout)
    over = json.loads(runner.invoke(
        app, [*base, "--max-model-len", str(longest + step), "--json"]).stdout)
    assert (at["fits"], over["fits"]) == (True, False)
