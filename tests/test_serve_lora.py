"""vLLM's LoRA slots (`serve --enable-lora`), derived by hand from the shapes vLLM v0.12.0's
`create_lora_weights` allocates (vllm/lora/layers/): per slot, a linear holds A = R × its
input on the rank and B = its output on the rank × R (column-parallel layers keep the whole
input, row-parallel ones the whole output), the embedding A = vocabulary × R and B = h × R,
the head A = R × h and B = vocabulary × R, all in the model dtype (2 B)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from vramcalc.catalog import resolve_model
from vramcalc.cli import app
from vramcalc.model_tensors import param_tensors
from vramcalc.serve.command import parse_serve_command
from vramcalc.serve.lora import stage_lora_bytes
from vramcalc.serve.weights import rank_rows_cols

runner = CliRunner()
B = 2  # bf16


def test_llama31_8b_four_slots_of_rank_64_by_hand() -> None:
    L, R, h, V = 4, 64, 4096, 128256
    q, kv, f = 4096, 1024, 14336
    per_layer = R * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
    ends = 2 * R * (V + h)  # embedding and head: Llama declares embedding_modules
    expected = L * (32 * per_layer + ends) * B
    assert expected == 1_477_705_728
    spec = resolve_model("llama3.1-8b")[0]
    assert stage_lora_bytes(spec, 1, 0, 32, 1, 0, L, R) == expected
    # TP 2: q, k, v, gate, up keep the whole input and half their output; o and down half
    # their input and the whole output; the vocabulary stays whole on every rank
    per_layer_tp2 = R * ((h + q // 2) + 2 * (h + kv // 2) + (q // 2 + h)
                         + 2 * (h + f // 2) + (f // 2 + h))
    assert stage_lora_bytes(spec, 2, 0, 32, 1, 0, L, R) == L * (
        32 * per_layer_tp2 + ends) * B == 1_041_498_112


def test_qwen_has_no_embedding_or_head_slots() -> None:
    # vllm/model_executor/models/qwen2.py declares no embedding_modules
    R, h, q, kv, f = 16, 3584, 28 * 128, 4 * 128, 18944
    per_layer = R * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
    spec = resolve_model("qwen2.5-7b")[0]
    assert stage_lora_bytes(spec, 1, 0, 28, 1, 0, 1, R) == 28 * per_layer * B == 80_740_352


def test_mixtral_experts_router_and_expert_parallel_by_hand() -> None:
    R, h, kv, f, E = 16, 4096, 1024, 14336, 8
    attn = R * ((h + h) + 2 * (h + kv) + (h + h))
    router = R * (h + E)  # a ReplicatedLinear, a LinearBase like the others
    experts = E * 3 * R * (h + f)
    ends = 2 * R * (32000 + h)
    spec = resolve_model("mixtral-8x7b")[0]
    assert stage_lora_bytes(spec, 1, 0, 32, 1, 0, 1, R) == (
        32 * (attn + router + experts) + ends) * B
    # expert parallelism over 2 ranks: 4 whole experts each, attention split as TP 2
    attn2 = R * ((h + h // 2) + 2 * (h + kv // 2) + (h // 2 + h))
    assert stage_lora_bytes(spec, 2, 0, 32, 1, 0, 1, R, ep=True) == (
        32 * (attn2 + router + 4 * 3 * R * (h + f)) + ends) * B


def test_pipeline_stages_split_the_slots() -> None:
    spec = resolve_model("llama3.1-8b")[0]
    whole = stage_lora_bytes(spec, 1, 0, 32, 1, 0, 2, 16)
    stages = [stage_lora_bytes(spec, 1, 0, 16, 2, 0, 2, 16),
              stage_lora_bytes(spec, 1, 16, 16, 2, 1, 2, 16)]
    assert sum(stages) == whole and stages[0] == stages[1]  # embedding on 0, head on 1


def test_the_slots_come_out_of_the_kv_cache() -> None:
    base = ["serve", "--model", "llama3.1-8b", "--gpus", "H100", "--max-model-len", "8192",
            "--json"]
    plain = json.loads(runner.invoke(app, base).stdout)
    lora = json.loads(runner.invoke(app, [*base, "--enable-lora", "--max-loras", "4",
                                          "--max-lora-rank", "64"]).stdout)
    slots = lora["terms"]["lora_slots"]
    assert slots == 1_477_705_728 and plain["terms"]["lora_slots"] == 0
    assert plain["terms"]["weights"] == lora["terms"]["weights"]
    block = 16 * 131_072  # 16 tokens × 128 KiB
    lost = plain["terms"]["kv_cache"] - lora["terms"]["kv_cache"]
    assert slots - block < lost <= slots + block
    assert lora["device_total_bytes"] - plain["device_total_bytes"] in range(
        -block, block + 1)  # the budget is the same; only its split moves


def test_table_shows_the_slots_only_when_enabled() -> None:
    args = ["serve", "--model", "llama3.1-8b", "--max-model-len", "8192"]
    assert "LoRA slots" not in runner.invoke(app, args).output
    out = runner.invoke(app, [*args, "--enable-lora"]).output
    assert "LoRA slots" in out and "come out of the KV cache" in " ".join(out.split())


@pytest.mark.parametrize("args", [
    ["--max-loras", "4"],
    ["--enable-lora", "--max-lora-rank", "48"],
    ["--enable-lora", "--engine", "sglang"],
    ["--enable-lora", "--max-loras", "0"],
])
def test_bad_lora_options(args: list[str]) -> None:
    res = subprocess.run([sys.executable, "-m", "vramcalc", "serve", "--model", "llama3.1-8b",
                          *args], capture_output=True, text=True)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_vllm_command_line_lora_flags() -> None:
    model, values = parse_serve_command(["vllm", "serve", "meta-llama/Llama-3.1-8B",
                                         "--enable-lora", "--max-loras", "4",
                                         "--max-lora-rank=64", "-tp", "2"])
    assert model == "meta-llama/Llama-3.1-8B"
    assert values == {"engine": "vllm", "enable_lora": True, "max_loras": 4,
                      "max_lora_rank": 64, "tp": 2}


def test_row_and_column_parallel_shapes() -> None:
    # vLLM: q/k/v and gate/up are ColumnParallelLinear (output split), o_proj and down_proj
    # RowParallelLinear (input split); a 2-matrix MLP's output projection is row-parallel
    spec = resolve_model("llama3.1-8b")[0]
    shapes = {t.name: rank_rows_cols(t, spec, 2, False)[:2] for t in param_tensors(spec)}
    assert shapes["attn.q_proj.weight"] == (2048, 4096)
    assert shapes["mlp.gate_proj.weight"] == (7168, 4096)
    assert shapes["attn.o_proj.weight"] == (4096, 2048)
    assert shapes["mlp.down_proj.weight"] == (4096, 7168)
    gpt2 = resolve_model("gpt2")[0]
    shapes = {t.name: rank_rows_cols(t, gpt2, 2, False)[:2] for t in param_tensors(gpt2)}
    assert shapes["mlp.proj.weight"] == (768, 1536) and shapes["mlp.fc.weight"] == (1536, 768)
