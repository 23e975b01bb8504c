"""The scenarios `vramcalc validate` runs through both engines (`default_grid`).

Full training on every shape, precision policy, optimizer, attention kernel and recompute
mode for both profiles; FSDP2 at world sizes 2-8 (vramcalc.trace.distributed).

Fine-tuning and low-memory cases (LoRA, QLoRA, DoRA, 8-bit and paged optimizers, chunked
cross entropy, activation offload), both profiles: `reference` traces vramcalc's LoRALinear /
NF4Linear (vramcalc/trace/lora.py, nf4.py); `hf` traces transformers + PEFT's get_peft_model
(with NF4Linear bases for QLoRA).

The torchtitan profile: every activation checkpointing mode on one rank, per-op SAC and
full AC under FSDP2 (`titan_grid`).

FP8 and QAT cases, the reference profile only (vramcalc/terms/lowprec.py says why): FP8
traces the Transformer Engine stand-in `FP8Linear`, QAT real torch fake-quant ops
(`QATLinear`), both in vramcalc/trace/lowprec.py.

Names extend the shape's name with the mode so they stay unique.
"""

from __future__ import annotations

from typing import Any

from vramcalc.parallel import ParallelConfig
from vramcalc.scenario import Scenario
from vramcalc.validate.shapes import scenario_for


def default_grid() -> list[tuple[str, Scenario]]:
    """The validation grid: (name, scenario) pairs, both profiles, every policy and kernel."""
    grid: list[tuple[str, Scenario]] = []
    for profile in ("reference", "hf"):
        fw = {"framework": profile}
        # every precision policy, on the GQA shape
        for prec in ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure"):
            grid.append(scenario_for("llama-gqa", **fw, precision=prec))
        # optimizers
        for opt in ("adam", "sgd", "sgd-momentum", "lion", "adafactor", "adamw-8bit"):
            grid.append(scenario_for("llama-gqa", **fw, optimizer=opt))
        # attention kernels x recompute modes
        for att in ("flash", "eager"):
            for rec in ("none", "selective", "full"):
                grid.append(scenario_for("llama-mha", **fw, attention=att, recompute=rec,
                                 seq_len=2048, micro_batch_size=1))
        # micro-batch, sequence and gradient accumulation
        grid.append(scenario_for("llama-gqa", **fw, micro_batch_size=4, seq_len=512))
        grid.append(scenario_for("llama-gqa", **fw, micro_batch_size=1, seq_len=4096))
        grid.append(scenario_for("llama-gqa", **fw, grad_accum=4, micro_batch_size=1))
        grid.append(scenario_for("llama-gqa", **fw, precision="amp-bf16", attention="eager",
                         seq_len=512))
        # other families
        grid.append(scenario_for("gpt2", **fw))
        grid.append(scenario_for("gpt2", **fw, precision="amp-bf16", attention="eager", seq_len=512))
        grid.append(scenario_for("gpt2", **fw, recompute="selective", optimizer="sgd-momentum"))
        grid.append(scenario_for("qwen2-bias", **fw, seq_len=2048))
        grid.append(scenario_for("qwen3-qknorm", **fw, precision="bf16-pure", optimizer="lion"))
        grid.append(scenario_for("moe", **fw))
        grid.append(scenario_for("moe", **fw, recompute="full", micro_batch_size=4))
        grid.append(scenario_for("moe-shared", **fw, precision="bf16-pure", attention="eager",
                         seq_len=512))
        grid.append(scenario_for("moe-interleaved", **fw, seq_len=2048))
        # a small vocabulary: the peak moves into the layers' backward
        grid.append(scenario_for("llama-deep", **fw, seq_len=2048))
        grid.append(scenario_for("llama-deep", **fw, precision="amp-bf16", attention="eager",
                         recompute="selective", micro_batch_size=1))
    # relu and squared-relu MLPs (relu keeps its output; the square runs in fp32 under
    # autocast)
    for prec in ("bf16-pure", "amp-bf16"):
        grid.append(scenario_for("gpt2-relu", framework="hf", precision=prec))
        grid.append(scenario_for("nemotron-relu2", precision=prec))
    grid.append(scenario_for("gpt2-relu", finetune="qlora", lora_targets="all-linear"))
    grid.append(scenario_for("nemotron-relu2", finetune="lora", recompute="selective"))
    for shape in ("gpt2", "phi3-fused", "gemma-mqa"):
        grid.append(scenario_for(shape, framework="hf", attention="eager", seq_len=1024))
    grid.append(scenario_for("phi3-fused", framework="hf", precision="amp-bf16", recompute="selective"))
    grid.append(scenario_for("moe", precision="amp-bf16", recompute="selective"))
    grid.append(scenario_for("llama-gqa", optimizer="paged-adamw-8bit"))
    # autocast with a frozen or 4-bit base where the layer's own work is the peak (small
    # vocabulary): QLoRA's fp32 MLP, LoRA's recomputed weight casts
    grid.append(scenario_for("llama-deep", framework="hf", precision="amp-bf16",
                             finetune="qlora", recompute="full"))
    grid.append(scenario_for("llama-deep", precision="amp-bf16", finetune="lora",
                             recompute="full"))
    # torch.optim.Muon on the layers' matrices beside AdamW (vramcalc/trace/optim.py)
    grid.append(scenario_for("llama-deep", optimizer="muon"))
    grid.append(scenario_for("moe", optimizer="muon", precision="amp-bf16"))
    # the optimizer step's implementation (the hf profile's AdamW is fused by default)
    for impl, prec in (("fused", "bf16"), ("loop", "bf16"), ("loop", "fp32"),
                       ("fused", "amp-bf16")):
        grid.append(scenario_for("llama-gqa", precision=prec, optimizer_impl=impl))
    grid.append(scenario_for("gpt2", framework="hf", optimizer_impl="foreach"))
    grid.append(scenario_for("llama-deep", framework="hf", optimizer_impl="loop"))
    # HF Trainer's optim names: transformers' own AdamW loop (adamw_hf), torch's foreach
    grid.append(scenario_for("llama-gqa", framework="hf", precision="fp32", hf_optim="adamw_hf"))
    grid.append(scenario_for("llama-deep", framework="hf", hf_optim="adamw_hf"))
    grid.append(scenario_for("gpt2", framework="hf", hf_optim="adamw_torch"))
    # HF gradient checkpointing with torch's reentrant checkpoint (transformers 4.35-4.57)
    grid.append(scenario_for("llama-deep", framework="hf", recompute="full", seq_len=2048,
                             use_reentrant=True))
    grid.append(scenario_for("moe", framework="hf", recompute="full", micro_batch_size=4,
                             use_reentrant=True))
    grid.append(scenario_for("gpt2", precision="fp32", optimizer="adafactor", seq_len=1024))
    # HF Trainer's use_liger_kernel: the trace runs stand-ins of Liger's kernels
    # (vramcalc/trace/liger.py), allocation for allocation
    grid.append(scenario_for("qwen2-bias", framework="hf", precision="amp-bf16", liger=True))
    grid.append(scenario_for("llama-gqa", framework="hf", precision="bf16-pure", liger=True,
                             recompute="full", finetune="lora", micro_batch_size=4))
    grid.append(scenario_for("llama-deep", framework="hf", liger=True, grad_accum=2))
    grid += finetune_grid()  # LoRA / QLoRA / DoRA, 8-bit and paged optimizers
    grid += lowprec_grid()  # FP8 (Transformer Engine stand-in) and QAT
    grid += fsdp_grid()
    grid += titan_grid()
    grid += tune_grid()
    grid += encoder_grid()
    grid += seq2seq_grid()
    return grid


def seq2seq_grid() -> list[tuple[str, Scenario]]:
    """Encoder-decoders (vramcalc/terms/seq2seq.py, vramcalc/analytic_seq2seq.py):
    transformers' T5 and BART with their dropout, 512 source and 128 target tokens, eager
    attention; fp32, bf16 weights and autocast, gradient accumulation, T5 v1.1's gated-gelu FF, full
    recompute, and small vocabularies that move the peak from the tied embedding's backward
    into the layers. BART and T5 also with SDPA (`--attention flash`, transformers' default;
    T5's position bias reaches it as a float mask: CUDA's memory-efficient kernel)."""
    cases: list[tuple[str, dict[str, Any]]] = [
        ("t5", {"precision": "fp32"}), ("t5", {"precision": "amp-bf16"}),
        ("t5", {"precision": "fp32", "grad_accum": 2}), ("t5-v1k", {"precision": "amp-bf16"}),
        ("t5", {"precision": "bf16"}), ("bart-v1k", {"precision": "bf16"}),
        ("t5-v11", {"precision": "amp-bf16"}), ("t5-v11", {"precision": "fp32"}),
        ("bart", {"precision": "amp-bf16"}), ("bart", {"precision": "fp32"}),
        ("bart-v1k", {"precision": "amp-fp16"}),
        # gradient checkpointing (transformers' GradientCheckpointingLayer, non-reentrant)
        ("t5", {"precision": "fp32", "recompute": "full"}),
        ("t5-v1k", {"precision": "amp-bf16", "recompute": "full"}),
        ("bart", {"precision": "amp-bf16", "recompute": "full"}),
        ("bart-v1k", {"precision": "fp32", "recompute": "full"})]
    flash: list[tuple[str, dict[str, Any]]] = [
        ("bart", {"precision": "amp-bf16"}), ("bart-v1k", {"precision": "bf16"}),
        ("bart-v1k", {"precision": "amp-fp16"}),
        ("bart-v1k", {"precision": "amp-bf16", "recompute": "full"}),
        ("bart", {"precision": "fp32", "recompute": "full"}),
        # T5 under SDPA: the position bias as attn_mask, CUDA's memory-efficient kernel
        ("t5", {"precision": "bf16"}), ("t5-v1k", {"precision": "amp-bf16"}),
        ("t5-v11", {"precision": "amp-bf16"}),
        ("t5-v1k", {"precision": "bf16", "recompute": "full"}),
        ("t5", {"precision": "amp-bf16", "recompute": "full"})]
    return [scenario_for(shape, framework="hf", seq_len=512, target_len=128,
                         attention=attention, **kw)
            for attention, group in (("eager", cases), ("flash", flash)) for shape, kw in group]


def encoder_grid() -> list[tuple[str, Scenario]]:
    """Encoders (vramcalc/terms/encoder.py), transformers' BERT / RoBERTa with dropout 0.1
    and ModernBERT (vramcalc/terms/modernbert.py, no dropout):
    both attention kernels, fp32, autocast and 16-bit weights, full recompute with gradient
    accumulation, classification and masked-LM heads; and zero_grad(set_to_none=False)."""
    out: list[tuple[str, Scenario]] = []
    cases: list[tuple[str, dict[str, Any]]] = [
        ("bert", {"precision": "fp32", "attention": "eager", "seq_len": 512,
                  "micro_batch_size": 4}),
        ("bert", {"precision": "amp-fp16", "attention": "eager", "seq_len": 512,
                  "micro_batch_size": 4}),
        ("bert", {"precision": "fp32", "attention": "eager", "recompute": "full",
                  "seq_len": 512, "grad_accum": 4}),
        ("bert", {"precision": "amp-bf16", "recompute": "full", "seq_len": 512}),
        ("bert", {"precision": "bf16", "seq_len": 512}),
        ("roberta-mlm", {"precision": "amp-bf16", "seq_len": 512}),
        ("roberta-mlm", {"precision": "fp32", "attention": "eager", "seq_len": 256}),
        ("roberta-mlm", {"precision": "bf16-pure", "seq_len": 256}),  # a 16-bit loss
        # ModernBERT (vramcalc/terms/modernbert.py): local layers' SDPA bias and eager mask
        ("modernbert", {"precision": "fp32", "attention": "eager", "seq_len": 512,
                        "micro_batch_size": 4}),
        ("modernbert", {"precision": "amp-bf16", "seq_len": 1024, "micro_batch_size": 2}),
        ("modernbert", {"precision": "bf16", "seq_len": 512, "micro_batch_size": 4}),
        ("modernbert-mlm", {"precision": "amp-bf16", "seq_len": 512}),
        ("modernbert-mlm", {"precision": "fp32", "attention": "eager", "seq_len": 256}),
        ("modernbert", {"precision": "amp-bf16", "recompute": "full", "seq_len": 1024,
                        "grad_accum": 2}),
        ("modernbert-mlm", {"precision": "fp32", "attention": "eager", "recompute": "full",
                            "seq_len": 512}),
    ]
    for shape, kw in cases:
        out.append(scenario_for(shape, framework="hf", **kw))
    # zero_grad(set_to_none=False): gradients kept through forward (torch < 2.0's default)
    for shape, kw in (("bert", {"precision": "fp32", "attention": "eager", "seq_len": 512,
                                "micro_batch_size": 4}),
                      ("llama-gqa", {"precision": "amp-bf16"})):
        name, scn = scenario_for(shape, framework="hf", set_to_none=False, **kw)
        out.append((name + "/no-set-to-none", scn))
    return out


def titan_grid() -> list[tuple[str, Scenario]]:
    """The torchtitan profile (vramcalc/terms/torchtitan.py; the trace runs its SAC policy
    through torch's selective-checkpoint contexts): one rank in fp32 with every activation
    checkpointing mode, and FSDP2 with bf16 mixed precision."""
    out: list[tuple[str, Scenario]] = []
    modes: tuple[tuple[str, int | None], ...] = (
        ("none", None), ("full", None), ("selective", None), ("selective", 2))
    for shape in ("llama-gqa", "llama-mha"):
        for rec, every in modes:
            name, scn = scenario_for(shape, framework="torchtitan", precision="fp32",
                                     recompute=rec, recompute_every=every)
            out.append((name + (f"/every{every}" if every else ""), scn))
    for rec in ("selective", "full"):
        name, scn = scenario_for("llama-gqa", framework="torchtitan", precision="amp-bf16",
                                 recompute=rec)
        par = ParallelConfig(dp=4, fsdp="full")
        out.append((f"{name}/fsdp-full4", scn.model_copy(update={"parallel": par})))
    return out


def tune_grid() -> list[tuple[str, Scenario]]:
    """The torchtune profile (terms/torchtune.py; the trace: trace/tune.py): full training,
    LoRA with the chunked loss, QLoRA, the 0.1 recipe, main's LinearCrossEntropyLoss, LoRA on
    two FSDP2 ranks, QLoRA with a small vocabulary (the peak is the final norm's backward),
    q/k norms, QLoRA on interleaved MoE layers and on a 2-matrix MLP."""
    g, qkvo = "llama-gqa", {"lora_targets": "q,k,v,o", "seq_len": 512}
    cases: tuple[tuple[str, str, dict[str, Any]], ...] = (
        (g, "", {}), (g, "lora/chunked4", {"finetune": "lora", "recompute": "full", "chunked_ce": 4}),
        (g, "qlora", {"finetune": "qlora", "recompute": "full"}),
        (g, "lora/v0.1", {"finetune": "lora", "torchtune_version": "0.1.0"}),
        (g, "chunked4/main", {"recompute": "full", "chunked_ce": 4, "torchtune_version": "0.7.0"}),
        (g, "lora/chunked4/main", {"finetune": "lora", "recompute": "full", "chunked_ce": 4,
                                   "torchtune_version": "0.7.0"}),
        ("llama-deep", "qlora", {"finetune": "qlora", "seq_len": 2048}),
        ("qwen3-qknorm", "lora", {"finetune": "lora", **qkvo}),
        ("moe-interleaved", "qlora", {"finetune": "qlora", **qkvo}),
        ("gpt2-relu", "qlora/fp32", {"finetune": "qlora", "precision": "fp32", **qkvo}))
    out: list[tuple[str, Scenario]] = []
    for shape, tag, kw in cases:
        name, scn = scenario_for(shape, framework="torchtune", **{"precision": "bf16-pure", **kw})
        out.append((name + (f"/{tag}" if tag else ""), scn))
    name, scn = scenario_for(g, framework="torchtune", precision="bf16-pure",
                             finetune="lora", recompute="full")
    out.append((f"{name}/lora/fsdp-full2", scn.model_copy(
        update={"parallel": ParallelConfig(dp=2, fsdp="full", fsdp_impl="fsdp2")})))
    return out


def fsdp_grid() -> list[tuple[str, Scenario]]:
    """FSDP2 data parallelism at world sizes 2, 4, 8 (vramcalc.trace.distributed)."""
    cases: list[tuple[str, int, Any, dict[str, Any]]] = [
        ("llama-gqa", 2, "full", {"precision": "amp-bf16"}),
        ("llama-gqa", 4, "full", {"precision": "amp-bf16", "grad_accum": 2}),
        ("llama-gqa", 8, "full", {"precision": "bf16"}),
        ("gpt2", 2, "full", {"precision": "amp-bf16", "framework": "hf"}),
        # HF Trainer's no_sync() accumulation: unsharded gradients in the reduce dtype
        ("gpt2", 2, "full", {"precision": "amp-bf16", "framework": "hf", "grad_accum": 4}),
        ("llama-gqa", 2, "full", {"precision": "bf16-pure", "framework": "hf", "grad_accum": 2}),
        ("qwen2-bias", 4, "grad-op", {"precision": "amp-bf16"}),
        ("llama-mha", 8, "hybrid", {"precision": "amp-bf16", "recompute": "selective"}),
        ("moe", 8, "full", {"precision": "bf16-pure"}),
        # a tied embedding: autograd sums the unsharded head and embedding shares (a view:
        # three copies) before the root's reduce-scatter; Gemma's embed_scale buffer
        ("gemma-mqa", 2, "full", {"precision": "bf16", "framework": "hf", "seq_len": 128}),
    ]
    out = []
    for shape, world, fsdp, kw in cases:
        name, scn = scenario_for(shape, **kw)
        par = ParallelConfig(dp=world, fsdp=fsdp,
                             shard_group=world // 2 if fsdp == "hybrid" else None)
        out.append((f"{name}/fsdp-{fsdp}{world}", scn.model_copy(update={"parallel": par})))
    return out



# (shape, framework, training options)
FINETUNE_CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("llama-gqa", "reference", {"finetune": "lora"}),
    ("llama-gqa", "reference", {"finetune": "qlora", "lora_targets": "all-linear"}),
    ("llama-gqa", "reference", {"finetune": "lora", "lora_targets": "all-linear",
                                "lora_dropout": 0.1, "precision": "amp-bf16"}),
    ("llama-gqa", "reference", {"finetune": "qlora", "precision": "amp-bf16"}),
    ("llama-deep", "reference", {"finetune": "qlora", "lora_targets": "all-linear",
                                 "lora_dropout": 0.05, "seq_len": 2048}),
    ("llama-mha", "reference", {"finetune": "lora", "attention": "eager",
                                "recompute": "selective", "lora_targets": "q,k,v,o"}),
    ("llama-gqa", "reference", {"finetune": "qlora", "recompute": "full", "lora_rank": 64,
                                "optimizer": "paged-adamw-8bit", "lora_targets": "all-linear"}),
    ("llama-gqa", "reference", {"finetune": "dora"}),
    ("gpt2", "reference", {"finetune": "lora", "lora_targets": "all-linear"}),
    # transformers' bitsandbytes integration quantizes GPT-2's Conv1D; NewGELU in fp32
    ("gpt2", "hf", {"finetune": "qlora", "lora_targets": "all-linear", "precision": "amp-bf16"}),
    ("gpt2", "hf", {"finetune": "qlora", "precision": "amp-bf16", "recompute": "selective"}),
    # DoRA's re-run weight copies (dropout, full recompute); eager's returned probabilities
    ("qwen3-moe", "hf", {"finetune": "dora", "recompute": "full", "lora_dropout": 0.1}),
    ("llama-deep", "hf", {"finetune": "dora", "recompute": "selective", "attention": "eager",
                          "precision": "fp32", "lora_dropout": 0.1, "lora_targets": "all-linear"}),
    ("moe-shared", "reference", {"finetune": "qlora", "lora_targets": "all-linear"}),
    # 4-bit experts return fp32 under autocast; DoRA's sum cast back to the base's dtype
    ("moe", "reference", {"finetune": "qlora", "lora_targets": "all-linear",
                          "precision": "amp-bf16", "seq_len": 512}),
    ("llama-deep", "reference", {"finetune": "dora", "precision": "amp-bf16", "seq_len": 512,
                                 "recompute": "selective", "lora_targets": "q,k,v,o"}),
    # the dense layers' DoRA work below the top MoE layer (terms/profile.py other_forward)
    ("moe-interleaved", "reference", {"finetune": "dora", "precision": "amp-bf16",
                                      "recompute": "selective", "attention": "eager",
                                      "lora_dropout": 0.1, "lora_targets": "all-linear",
                                      "seq_len": 512, "micro_batch_size": 1}),
    ("llama-gqa", "hf", {"finetune": "lora"}),
    ("llama-gqa", "hf", {"finetune": "qlora", "lora_targets": "all-linear",
                         "optimizer": "adamw-8bit"}),
    ("llama-deep", "hf", {"finetune": "lora", "lora_targets": "all-linear", "lora_dropout": 0.05}),
    ("llama-gqa", "hf", {"finetune": "dora", "lora_targets": "all-linear"}),
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "amp-bf16", "recompute": "full"}),
    ("llama-gqa", "hf", {"finetune": "qlora", "attention": "eager", "optimizer": "paged-adamw"}),
    ("moe", "hf", {"finetune": "qlora"}),
    ("qwen3-moe", "hf", {"finetune": "lora", "lora_targets": "all-linear", "seq_len": 256,
                         "precision": "bf16-autocast"}),  # PEFT's fused experts: peft_moe.py
    ("qwen3-moe", "hf", {"finetune": "lora", "lora_targets": "q,v,gate,up,down", "seq_len": 256,
                         "recompute": "full"}),
    ("moe", "hf", {"finetune": "lora", "lora_targets": "all-linear", "seq_len": 256,
                   "precision": "bf16-pure"}),
    # a tied embedding under LoRA is frozen: no V x h gradient at the end of backward (short
    # sequences put the peak there if one were counted)
    ("gemma-mqa", "hf", {"finetune": "lora", "seq_len": 128, "micro_batch_size": 1}),
    # PEFT's prepare_model_for_kbit_training run by the trace itself (fp32 upcast, reentrant
    # gradient checkpointing, input grads); tied embeddings, all-linear targets, eager
    ("llama-gqa", "hf", {"finetune": "qlora", "precision": "amp-bf16", "recompute": "full",
                         "kbit_prepare": True}),
    # PEFT's lora.Embedding on embed_tokens: its gradient reaches the first layer
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "amp-bf16", "lora_embedding": True}),
    ("llama-deep", "hf", {"finetune": "lora", "seq_len": 2048, "lora_embedding": True}),
    # PEFT's lora.Linear on lm_head: fp32 (tokens x vocab) sums (the forward peak in fp32)
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "fp32", "lora_head": True}),
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "amp-bf16", "lora_head": True,
                         "lora_dropout": 0.1}),
    ("llama-deep", "hf", {"finetune": "qlora", "seq_len": 2048, "lora_head": True,
                          "lora_embedding": True}),
    # PEFT's modules_to_save: trained copies of the head and the embedding
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "amp-bf16",
                         "modules_to_save": "lm_head"}),
    ("llama-deep", "hf", {"finetune": "lora", "precision": "amp-bf16", "seq_len": 2048,
                          "modules_to_save": "embed_tokens,lm_head"}),
    ("llama-gqa", "hf", {"finetune": "qlora", "precision": "amp-bf16", "recompute": "full",
                         "kbit_prepare": True, "modules_to_save": "lm_head"}),
    ("qwen2-bias", "hf", {"finetune": "qlora", "precision": "amp-bf16", "recompute": "full",
                          "kbit_prepare": True, "lora_targets": "all-linear",
                          "attention": "eager", "seq_len": 512}),
    # fused projections under PEFT: GPT-2's c_attn (Conv1D), Phi-3's qkv_proj / gate_up_proj
    ("gpt2", "hf", {"finetune": "lora"}),
    ("gpt2", "hf", {"finetune": "lora", "lora_targets": "all-linear", "lora_dropout": 0.1,
                    "attention": "eager"}),
    ("phi3-fused", "hf", {"finetune": "lora"}),
    ("phi3-fused", "hf", {"finetune": "qlora", "lora_targets": "all-linear"}),
    ("phi3-fused", "hf", {"finetune": "lora", "lora_targets": "q,k,v,o,gate,up",
                          "precision": "amp-bf16", "recompute": "selective"}),
    ("phi3-fused", "hf", {"finetune": "dora", "lora_targets": "k,up"}),
    # chunked cross entropy and activation offload (vramcalc/terms/lowmem.py)
    ("llama-deep", "reference", {"chunked_ce": 16, "seq_len": 2048}),
    ("llama-gqa", "reference", {"chunked_ce": 4, "precision": "amp-bf16"}),
    ("llama-gqa", "hf", {"finetune": "lora", "chunked_ce": 8, "lora_targets": "all-linear"}),
    ("llama-deep", "reference", {"activation_offload": True, "seq_len": 2048}),
    ("llama-deep", "reference", {"finetune": "qlora", "activation_offload": True,
                                 "lora_targets": "all-linear", "seq_len": 2048}),
    ("llama-gqa", "hf", {"finetune": "lora", "activation_offload": True, "lora_dropout": 0.1}),
    ("llama-mha", "reference", {"finetune": "lora", "activation_offload": True,
                                "attention": "eager", "chunked_ce": 4}),
    # torchtune's recipes: the hooks wrap the model's forward, outside every checkpoint
    ("llama-gqa", "torchtune", {"finetune": "lora", "precision": "bf16-pure", "recompute": "full",
                                "activation_offload": True, "lora_targets": "all-linear"}),
    ("llama-deep", "torchtune", {"finetune": "full", "precision": "bf16-pure",
                                 "recompute": "full", "activation_offload": True}),
    # HF Trainer's autocast over a 16-bit model: only the adapters' matmuls cast
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "bf16-autocast",
                         "lora_targets": "all-linear", "lora_dropout": 0.05}),
    ("llama-deep", "hf", {"finetune": "qlora", "precision": "bf16-autocast",
                          "lora_targets": "all-linear"}),
    ("gemma-mqa", "hf", {"finetune": "dora", "precision": "fp16-autocast"}),
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "bf16-autocast", "liger": True,
                         "lora_targets": "all-linear"}),
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "bf16-autocast",
                         "recompute": "full", "lora_head": True}),
    ("moe", "hf", {"finetune": "full", "precision": "bf16-autocast"}),
    # TRL SFTTrainer's chunked_nll (trace/trl.py restates it): one chunk, several, a tied head
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "bf16-autocast", "trl_chunked_ce": True,
                         "lora_targets": "all-linear"}),
    ("llama-gqa", "hf", {"finetune": "qlora", "precision": "amp-bf16", "kbit_prepare": True,
                         "recompute": "full", "trl_chunked_ce": True}),
    ("llama-gqa", "hf", {"finetune": "full", "precision": "bf16-autocast", "trl_chunked_ce": True}),
    ("qwen2-bias", "hf", {"finetune": "full", "precision": "amp-bf16", "trl_chunked_ce": True}),
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "bf16-pure", "trl_chunked_ce": True,
                         "seq_len": 200, "micro_batch_size": 1}),
    # adapters in the model's dtype: TRL's QLoRA recipe (4-bit, bf16 adapters, dropout 0.05,
    # checkpointing, chunked_nll) and PEFT's autocast_adapter_dtype=False
    ("llama-gqa", "hf", {"finetune": "qlora", "precision": "bf16-autocast", "adapters_16bit": True,
                         "lora_targets": "all-linear", "lora_dropout": 0.05, "recompute": "full",
                         "trl_chunked_ce": True}),
    ("qwen2-bias", "hf", {"finetune": "lora", "precision": "bf16-pure", "adapters_16bit": True,
                          "lora_targets": "all-linear"}),
    # MLP-only adapters: the first layer records nothing before its first adapter; the
    # forward peaks at up's adapter, after gate and act exist
    ("llama-deep", "hf", {"finetune": "lora", "precision": "bf16-pure", "lora_targets": "up"}),
    ("llama-gqa", "reference", {"finetune": "lora", "lora_targets": "gate,up,down",
                                "lora_dropout": 0.1}),
    # full recompute with a small vocabulary: the layers hold the peak, in the checkpointed
    # forward (locals and adapter temporaries, nothing saved) and in backward's re-run
    # (saves again beside the waiting gradients; stops early at the down adapter)
    ("llama-deep", "hf", {"finetune": "lora", "precision": "bf16-pure", "recompute": "full",
                          "lora_targets": "all-linear", "seq_len": 2048}),
    ("llama-deep", "hf", {"finetune": "lora", "precision": "amp-bf16", "recompute": "full",
                          "lora_targets": "all-linear", "seq_len": 2048}),
    ("llama-deep", "hf", {"finetune": "lora", "precision": "bf16-autocast", "recompute": "full",
                          "lora_targets": "all-linear", "lora_dropout": 0.1, "seq_len": 2048}),
    ("llama-deep", "hf", {"finetune": "qlora", "precision": "bf16-pure", "recompute": "full",
                          "lora_targets": "all-linear", "seq_len": 2048}),
    ("llama-gqa", "hf", {"finetune": "lora", "precision": "bf16-pure", "recompute": "full",
                         "liger": True, "lora_targets": "all-linear"}),
    ("llama-deep", "hf", {"finetune": "dora", "precision": "bf16-pure", "recompute": "full",
                          "lora_targets": "all-linear", "seq_len": 2048}),
    ("llama-deep", "torchtune", {"finetune": "dora", "precision": "bf16-pure",
                                 "recompute": "full", "lora_targets": "all-linear",
                                 "seq_len": 2048}),
)


# FSDP2 (vramcalc/trace/distributed.py): (shape, framework, world, training options). The
# small-vocabulary shape puts the peak in the layers' backward, where the gathered block,
# the prefetched next block and the adapters' reduce-scatter count; QLoRA gathers packed
# 4-bit weights (vramcalc.finetune.gathered_layer_bytes).
FINETUNE_FSDP_CASES: tuple[tuple[str, str, int, dict[str, Any]], ...] = (
    ("llama-deep", "reference", 4, {"finetune": "qlora", "precision": "bf16",
                                    "lora_targets": "all-linear"}),
    ("llama-deep", "hf", 2, {"finetune": "qlora", "precision": "bf16"}),
    ("llama-deep", "reference", 2, {"finetune": "qlora", "precision": "amp-bf16"}),
    ("llama-deep", "reference", 4, {"finetune": "lora", "precision": "amp-bf16",
                                    "lora_targets": "all-linear"}),
    ("llama-gqa", "hf", 2, {"finetune": "lora"}),
    ("llama-deep", "hf", 2, {"finetune": "lora", "precision": "bf16-pure", "adapters_16bit": True,
                             "lora_targets": "all-linear"}),
)


def finetune_grid() -> list[tuple[str, Scenario]]:
    """(name, scenario) pairs of the fine-tuning cases above (FSDP2 ones included)."""
    cases = [(shape, fw, 1, kw) for shape, fw, kw in FINETUNE_CASES] + list(FINETUNE_FSDP_CASES)
    out = []
    for shape, framework, world, kw in cases:
        name, scn = scenario_for(shape, framework=framework, **kw)
        if world > 1:
            scn = scn.model_copy(update={"parallel": ParallelConfig(dp=world, fsdp="full")})
            name += f"/fsdp-full{world}"
        tr = scn.training
        tag: str = tr.finetune
        if tr.finetune != "full":
            tag += f"-r{tr.lora_rank}-{tr.lora_targets.replace(',', '')}"
        if tr.lora_dropout:
            tag += f"-p{tr.lora_dropout:g}"
        tag += "".join(suffix for on, suffix in (
            (tr.chunked_ce > 1, f"-ce{tr.chunked_ce}"), (tr.activation_offload, "-offload"),
            (tr.lora_embedding, "-embed"), (tr.lora_head, "-head"), (tr.liger, "-liger"),
            (tr.trl_chunked_ce, "-trl"), (tr.adapters_16bit, "-a16"),
            (tr.modules_to_save, "-save-" + tr.modules_to_save.replace(",", "+"))) if on)
        out.append((f"{name}/{tag}", scn))
    return out


# (shape, training options)
LOWPREC_CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("llama-gqa", {"precision": "fp8"}),
    ("llama-gqa", {"precision": "fp8", "attention": "eager", "seq_len": 512}),
    ("llama-mha", {"precision": "fp8", "recompute": "selective", "seq_len": 2048,
                   "micro_batch_size": 1}),
    ("llama-mha", {"precision": "fp8", "attention": "eager", "recompute": "selective",
                   "seq_len": 2048, "micro_batch_size": 1}),
    ("llama-mha", {"precision": "fp8", "recompute": "full", "seq_len": 2048,
                   "micro_batch_size": 1}),
    ("llama-deep", {"precision": "fp8", "seq_len": 2048}),
    ("llama-deep", {"precision": "fp8", "attention": "eager", "micro_batch_size": 1}),
    ("qwen2-bias", {"precision": "fp8", "grad_accum": 2}),
    ("qwen3-qknorm", {"precision": "fp8", "optimizer": "lion"}),
    ("gpt2", {"precision": "fp8"}),
    ("llama-gqa", {"qat": "int8"}),
    ("llama-gqa", {"qat": "int4"}),
    ("llama-gqa", {"qat": "int4", "precision": "bf16-pure", "attention": "eager", "seq_len": 512}),
    ("llama-mha", {"qat": "int8", "recompute": "selective", "seq_len": 2048,
                   "micro_batch_size": 1}),
    ("llama-mha", {"qat": "int4", "attention": "eager", "recompute": "selective",
                   "seq_len": 2048, "micro_batch_size": 1}),
    ("llama-mha", {"qat": "int4", "recompute": "full", "seq_len": 2048,
                   "micro_batch_size": 1}),
    ("llama-deep", {"qat": "int4", "seq_len": 2048}),
    ("llama-deep", {"qat": "int8", "attention": "eager", "micro_batch_size": 1}),
    ("qwen2-bias", {"qat": "int8", "precision": "fp32", "seq_len": 512}),
    ("gpt2", {"qat": "int4", "grad_accum": 2}),
)


def lowprec_grid() -> list[tuple[str, Scenario]]:
    """(name, scenario) pairs of the FP8 / QAT cases above."""
    out = []
    for shape, kw in LOWPREC_CASES:
        name, scn = scenario_for(shape, **kw)
        tr = scn.training
        tag = "fp8" if tr.precision == "fp8" else f"qat-{tr.qat}"
        out.append((f"{name}/{tag}", scn))
    return out
