"""benchmarks/calibration.py: record -> flags mapping on a small in-test sample.

Structure only: which flags a record becomes and that an inexpressible record says so. The
real calibration files live outside the repository and are never a target here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "calibration.py"


@pytest.fixture(scope="module")
def calib():
    spec = importlib.util.spec_from_file_location("calibration_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


MEGATRON_YAML = """\
meta: {schema_version: 1, count: 1}
cases:
- id: megatron-gpt3_mcore_te_tp2_pp2_fake__dev_dgx_h100
  platform: dgx_h100
  world_size: 8
  args:
    num-layers: 4
    hidden-size: 256
    num-attention-heads: 4
    micro-batch-size: 2
    global-batch-size: 16
    seq-length: 512
    max-position-embeddings: 512
    transformer-impl: transformer_engine
    tensor-model-parallel-size: 2
    pipeline-model-parallel-size: 2
    sequence-parallel: true
    use-distributed-optimizer: true
    bf16: true
    attention-backend: unfused
  derived:
    data_parallel_size: 2
    num_microbatches_per_iter: 4
    padded_vocab_size: 1024
    ffn_hidden_size_effective: 1024
    kv_channels_effective: 64
    num_query_groups_effective: 4
    sequence_parallel: true
    distributed_optimizer: true
    tied_embeddings: true
    position_embedding_type: learned_absolute
    normalization: LayerNorm
    activation: gelu
    add_bias_linear: true
    hidden_dropout: 0.1
    attention_dropout: 0.1
    optimizer: adam
    params_dtype: bf16
    fp8: null
    transformer_impl: transformer_engine
    attention_backend: unfused
  measured:
    max_allocated_all_iters: 1000000000
"""

MEASURED_YAML = """\
meta: {schema_version: 1, count: 1}
cases:
- id: fake-llama-lora-reserved
  kind: measured
  model: {name: fake, layers: 2, hidden: 256, heads: 4, kv_heads: 4, ffn: 512, vocab: 1000}
  seq_len: 256
  micro_batch: 1
  grad_accum: 1
  metric: peak memory reserved during training (torch.cuda.max_memory_reserved()/1e9)
  value: 1.50 GB
"""


@pytest.fixture()
def sample(tmp_path: Path) -> Path:
    (tmp_path / "megatron.yaml").write_text(MEGATRON_YAML)
    (tmp_path / "measured.yaml").write_text(MEASURED_YAML)
    return tmp_path


def test_megatron_record_becomes_flags(calib, sample: Path) -> None:
    records = calib.load_records(sample)
    assert [src for src, _ in records] == ["megatron", "measured"]
    m = calib.map_record(*records[0])
    assert m.expressible and m.family == "megatron" and m.metric == calib.ALLOCATED
    assert m.measured_bytes == 1_000_000_000
    assert m.flags == {
        "model": "megatron-gpt-4l-h256-v1024.yaml", "gpus": "8xH100",
        "framework": "megatron", "precision": "bf16", "optimizer": "adam",
        "attention": "eager", "recompute": "none", "seq_len": 512, "micro_batch_size": 2,
        "tp": 2, "pp": 2, "sequence_parallel": True, "zero": 1, "num_microbatches": 4,
    }
    fields = m.model_fields
    assert fields["vocab_size"] == 1024 and fields["mlp_kind"] == "standard"
    assert fields["position_embedding"] == "learned" and fields["tie_word_embeddings"]
    assert "--tp 2 --pp 2 --sequence-parallel" in calib.cli_flags(m.flags)


def test_reserved_record_needs_only_a_mapping(calib, sample: Path) -> None:
    m = calib.map_record(*calib.load_records(sample)[1])
    assert not m.expressible and m.metric == calib.RESERVED
    assert m.missing == ["no reviewed mapping for this record"]


def test_reserved_record_is_compared_with_peak_reserved(calib, sample: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from vramcalc.analytic import estimate
    from vramcalc.options import build_scenario

    flags = {"model": "gpt2", "gpus": "1xH100", "finetune": "lora"}
    monkeypatch.setitem(calib.MEASURED_TABLE, "fake-llama-lora-reserved", {"flags": flags})
    row = calib.run(sample)[1]
    assert row.mapping.expressible and row.mapping.metric == calib.RESERVED
    scn = build_scenario({**flags, "seq_len": 256, "micro_batch_size": 1, "grad_accum": 1})
    # the trace engine replays its allocations through the allocator model: its reserved
    # high-water mark is compared, not the analytic floor
    from vramcalc.trace.engine import run_trace

    traced = run_trace(scn)
    assert row.engine == "trace" and row.estimate_bytes == traced.peak_reserved_bytes
    assert row.estimate_bytes != estimate(scn).peak_reserved_bytes  # not the packing floor
    assert traced.peak_reserved_bytes > traced.peak_allocated_bytes


def test_table_and_summary_structure(calib, sample: Path) -> None:
    rows = calib.run(sample)
    assert [r.mapping.expressible for r in rows] == [True, False]
    assert rows[0].estimate_bytes is not None and rows[1].estimate_bytes is None
    md = calib.render_markdown(rows).splitlines()
    assert md[0] == "| record | flags | engine | estimate GiB | measured GiB | error |"
    assert "not expressible: no reviewed mapping for this record" in md[3]
    assert any(line.startswith("expressed 1/2;") for line in md)
    assert "torchtitan — (n=0)" in calib.summary(rows)


def test_missing_mechanisms_are_named(calib) -> None:
    case = yaml.safe_load(MEGATRON_YAML)["cases"][0]
    case["derived"].update(hidden_dropout=0.0, num_experts=4, moe_router_topk=1,
                           moe_ffn_hidden_size_effective=1024,
                           expert_tensor_parallel_size_effective=1,
                           moe_token_dispatcher_type_effective="allgather")
    case["args"]["multi-latent-attention"] = True
    missing = calib.megatron_mapping(case).missing
    assert "hidden dropout 0.0 with attention dropout 0.1 (--dropout sets both)" in missing
    assert not any("token dispatcher" in s for s in missing)  # allgather is modelled
    assert "unreviewed Megatron argument --multi-latent-attention" in missing


def test_expert_tensor_parallel_is_expressed(calib) -> None:
    # Megatron's --expert-tensor-parallel-size (derived: expert_tensor_parallel_size_effective)
    # becomes --etp when it differs from tp; equal to tp it is the profile's default
    case = yaml.safe_load(MEGATRON_YAML)["cases"][0]
    tp = case["args"].get("tensor-model-parallel-size", 1)
    case["derived"].update(num_experts=4, moe_router_topk=1, moe_ffn_hidden_size_effective=1024,
                           expert_tensor_parallel_size_effective=tp)
    assert "etp" not in calib.megatron_mapping(case).flags
    other = 1 if tp > 1 else 2
    case["derived"]["expert_tensor_parallel_size_effective"] = other
    case["args"]["expert-tensor-parallel-size"] = other
    m = calib.megatron_mapping(case)
    assert m.flags["etp"] == other
    assert not any("expert-tensor" in s for s in m.missing)


def test_moe_dispatcher_is_expressed(calib) -> None:
    case = yaml.safe_load(MEGATRON_YAML)["cases"][0]
    case["derived"].update(num_experts=4, moe_router_topk=1, moe_ffn_hidden_size_effective=1024,
                           moe_token_dispatcher_type_effective="allgather")
    m = calib.megatron_mapping(case)
    assert "moe_dispatcher" not in m.flags  # Megatron's allgather: the profile's default
    assert not any("dispatcher" in s for s in m.missing)
    case["derived"]["moe_token_dispatcher_type_effective"] = "alltoall"
    assert calib.megatron_mapping(case).flags["moe_dispatcher"] == "alltoall"
    case["derived"]["moe_token_dispatcher_type_effective"] = "flex"
    assert any("flex token dispatcher" in s for s in calib.megatron_mapping(case).missing)
    case["derived"]["moe_grouped_gemm"] = True
    case["args"]["deterministic-mode"] = True
    m = calib.megatron_mapping(case)
    assert any("grouped GEMM" in s for s in m.missing)
    assert m.flags["deterministic"] is True  # index_add_/index_put_ are modelled


def test_dropout_off_is_expressed_with_dropout_0(calib) -> None:
    case = yaml.safe_load(MEGATRON_YAML)["cases"][0]
    assert "dropout" not in calib.megatron_mapping(case).flags  # Megatron's 0.1: the default
    case["derived"].update(hidden_dropout=0.0, attention_dropout=0.0)
    m = calib.megatron_mapping(case)
    assert m.flags["dropout"] == 0.0
    assert not any("dropout" in s for s in m.missing)


def test_measured_table_entry_takes_shape_from_the_record(calib) -> None:
    case = {"id": "litgpt-llama2-7b-lora-mb1-a100", "seq_len": 300, "micro_batch": 2,
            "grad_accum": 4, "value": "10.0 GB",
            "metric": "torch.cuda.max_memory_allocated() / 1e9"}
    m = calib.measured_mapping(case)
    assert m.expressible and m.metric == calib.ALLOCATED and m.family == "others"
    assert m.measured_bytes == 10_000_000_000
    assert m.flags["seq_len"] == 300 and m.flags["micro_batch_size"] == 2
    assert m.flags["grad_accum"] == 4 and m.flags["framework"] == "lightning"
    assert "chunked_ce" not in m.flags  # the lightning profile chunks LitGPT's head itself
    assert m.flags["finetune"] == "lora" and m.flags["model"] == "llama2-7b"


def test_absent_folder_is_one_line(calib, tmp_path: Path, capsys) -> None:
    assert calib.main(["--calibration-dir", str(tmp_path / "nope")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no calibration folder" in out


# PEFT's MetaMathQA benchmark (huggingface/peft 5d602fd method_comparison/MetaMathQA): the
# two Llama-3.2-3B results and the counts their results JSON logs
_PEFT_MC = {
    "peft-mc-llama32-3b-full-ft-l40s": 38_868_615_168,
    "peft-mc-llama32-3b-lora-r32-qv-l40s": 22_292_725_760,
}
_LLAMA32_3B_PARAMS = 3_212_749_824  # results JSON num_total_params of the full run
_LORA_R32_QV_PARAMS = 9_175_040  # results JSON num_trainable_params of the LoRA run


def _peft_mc_case(rid: str) -> dict:
    return {"id": rid, "seq_len": "<=768 (dynamic padding, length-bucketed)",
            "micro_batch": 4, "grad_accum": 1, "value_bytes": _PEFT_MC[rid],
            "metric": "torch.cuda.max_memory_reserved() at end of run"}


def test_padded_record_takes_the_entrys_length_bound(calib) -> None:
    # the record states its length in words: the entry's 768 (the run's truncation) is used
    for rid in _PEFT_MC:
        m = calib.measured_mapping(_peft_mc_case(rid))
        assert m.expressible and m.metric == calib.RESERVED, m.missing
        assert m.flags["seq_len"] == 768 and m.flags["micro_batch_size"] == 4
        assert m.flags["grad_accum"] == 1 and m.flags["recompute"] == "none"
        assert any("768" in n and "CHAR_LIMIT" in n for n in m.notes)
    # a record without such an entry is still refused
    case = {**_peft_mc_case("peft-mc-llama32-3b-full-ft-l40s"),
            "id": "litgpt-llama2-7b-lora-mb1-a100"}
    assert not calib.measured_mapping(case).expressible


def test_peft_metamathqa_counts_match_the_results_json(calib) -> None:
    from vramcalc.analytic import estimate
    from vramcalc.options import build_scenario

    full = estimate(build_scenario(
        calib.measured_mapping(_peft_mc_case("peft-mc-llama32-3b-full-ft-l40s")).flags))
    # bf16 weights and torch AdamW's two states in the parameters' dtype (zeros_like)
    assert full.terms.weights == 2 * _LLAMA32_3B_PARAMS
    assert full.terms.optimizer_states == 2 * 2 * _LLAMA32_3B_PARAMS
    lora = estimate(build_scenario(
        calib.measured_mapping(_peft_mc_case("peft-mc-llama32-3b-lora-r32-qv-l40s")).flags))
    # hand: 28 layers x r 32 x (q: 3072 + 3072, v: 3072 + 1024) = 9,175,040, the JSON's count
    assert 28 * 32 * ((3072 + 3072) + (3072 + 1024)) == _LORA_R32_QV_PARAMS
    assert lora.terms.optimizer_states == 2 * 4 * _LORA_R32_QV_PARAMS  # fp32 adapters


def test_peft_metamathqa_eval_generation_stays_below_the_training_step(calib) -> None:
    """run.py `evaluate` generates at batch_size_eval 50 to max_length <= 800 (DynamicCache)
    while the last step's gradients and AdamW states are still allocated (zero_grad runs at
    the start of a step): even with 800-token prompts that is below the training step, and
    the figures the record notes quote are these."""
    from vramcalc.analytic import estimate
    from vramcalc.catalog import resolve_model
    from vramcalc.hardware import parse_gpus
    from vramcalc.options import build_scenario
    from vramcalc.serve import ServeConfig, serve_estimate

    gen = serve_estimate(resolve_model("llama3.2-3b")[0], parse_gpus("1xL40S"),
                         ServeConfig(engine="hf", hf_cache="dynamic", max_model_len=800,
                                     max_num_seqs=50))
    # hand: 28 layers x (K, V) x 8 KV heads x head dim 128 x 2 B, 50 sequences x 800 tokens
    kv = 28 * 2 * 8 * 128 * 2 * 50 * 800
    assert gen.terms.kv_cache == kv == 4_587_520_000
    held = {  # weights + gradients + AdamW states at the end of a step
        "peft-mc-llama32-3b-full-ft-l40s": 2 * _LLAMA32_3B_PARAMS * 4,
        "peft-mc-llama32-3b-lora-r32-qv-l40s": 2 * _LLAMA32_3B_PARAMS
        + 4 * _LORA_R32_QV_PARAMS * 4,
    }
    for rid, held_bytes in held.items():
        m = calib.measured_mapping(_peft_mc_case(rid))
        train = estimate(build_scenario(m.flags))
        assert train.phases["optimizer"] >= held_bytes  # the step holds at least these
        bound = held_bytes + kv + gen.terms.activation_peak
        assert bound < train.peak_allocated_bytes
        assert any(f"{bound / 2**30:.2f} GiB" in n for n in m.notes)


def test_torchtitan_70b_2d_record_is_expressed_as_its_config(calib) -> None:
    # torchtitan 9dec370 train_configs/llama3_70b.toml: tensor_parallel_degree 8,
    # data_parallel_shard_degree -1 (the rest of the world: 256 / 8 = 32), AC 'full', seq
    # 8192, AdamW; the benchmark row (Table 4, 2D): torch.compile + Float8, local batch 16
    from vramcalc.options import build_scenario

    case = {"id": "torchtitan-llama31-70b-fsdp32-tp8-fullac-h100", "seq_len": 8192,
            "micro_batch": 16, "grad_accum": 1, "value": "71.9 GiB",
            "metric": "max_reserved_gib (torch.cuda.max_memory_reserved / 2**30)"}
    m = calib.measured_mapping(case)
    assert m.expressible and m.metric == calib.RESERVED and m.family == "torchtitan"
    scn = build_scenario(m.flags)
    par, tr = scn.parallel, scn.training
    assert (par.tp, par.dp_degree, par.fsdp, par.sequence_parallel) == (8, 32, "full", True)
    assert (tr.recompute, tr.compile, tr.float8, tr.seq_len, tr.micro_batch_size) == (
        "full", True, True, 8192, 16)


def test_a_capacity_record_is_compared_with_its_budget(calib, tmp_path: Path) -> None:
    """A largest-fitting-length record: the device total at that length (the fit check's
    figure: the trace's fit where the trace runs it, docs/trace.md "The fit") against the
    budget its entry states; without a budget, refused."""
    case = {"id": "unsloth-hf-fa2-llama31-8b-qlora-r32-maxctx-24gb",
            "metric": "max context length fitting in the VRAM budget (OOM boundary)",
            "seq_len": "5,789 tokens", "micro_batch": 1, "grad_accum": None,
            "value": "5,789 tokens fit in 24 GB"}
    m = calib.measured_mapping(case)
    assert m.expressible and m.metric == calib.CAPACITY, m.missing
    assert m.measured_bytes == 24 * 2**30 and m.flags["seq_len"] == 5789
    row = calib.estimate_row(m, tmp_path)
    scn = calib.build_scenario(dict(m.flags))
    from vramcalc.trace.distributed import trace_any

    assert row.engine == "trace"
    assert row.estimate_bytes == trace_any(scn).device_total_bytes
    # the trace's fit is at least the analytic floor
    assert row.estimate_bytes >= calib.estimate(scn).device_total_bytes
    other = calib.measured_mapping({**case, "id": "no-such-record"})
    assert not other.expressible
    assert calib.METRIC_MISSING[calib.CAPACITY] in other.missing
