"""Hugging Face transformers models for the `hf` profile, built from a ModelSpec.

`to_hf_config(spec)` picks the transformers config class whose architecture has exactly
the spec's parameters (checked against ModelSpec.num_params by the tests):

| spec                                          | config class     |
|-----------------------------------------------|------------------|
| LayerNorm + learned positions + 2-matrix MLP  | GPT2Config       |
| MoE with a gated shared expert (Qwen2-MoE)    | Qwen2MoeConfig   |
| MoE with qk_norm                              | Qwen3MoeConfig   |
| other MoE (no biases, no shared experts)      | MixtralConfig    |
| model_type phi3 / gemma / mistral             | Phi3 / Gemma / MistralConfig |
| qk_norm                                       | Qwen3Config      |
| q/k/v biases without an o bias                | Qwen2Config      |
| anything else Llama-like                      | LlamaConfig      |

Encoders (`spec.is_encoder`) map to BertConfig / RobertaConfig / ModernBertConfig and are built with
AutoModelForSequenceClassification or AutoModelForMaskedLM (`spec.task`), dropout from the
spec (vramcalc.terms.encoder `encoder_dropout`).

`build_hf_model` calls `AutoModelForCausalLM.from_config` (no hub, no remote code) with
attention "sdpa" (flash) or "eager", gradient checkpointing (use_reentrant as the scenario
says, False by default) for full recompute and, for selective recompute, an attention function registered with
transformers' AttentionInterface that checkpoints the attention core. transformers is
imported only when a model is built; without it InputError says how to install it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from vramcalc.errors import InputError, shown
from vramcalc.hf_config import ROBERTA_TYPES
from vramcalc.hf_stack import copies_shifted_logits, gpt2_shaped, loss_in_forward
from vramcalc.model import ModelSpec
from vramcalc.trace.hf_seq2seq import seq2seq_config
from vramcalc.training import TrainingConfig

HF_MISSING = "the hf profile needs transformers: pip install torch transformers"
SELECTIVE_PREFIX = "vramcalc_selective_"
# special token ids are irrelevant to memory; the config defaults may not fit a small vocab
NO_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise InputError(HF_MISSING) from None
    return transformers


def _unsupported(spec: ModelSpec, why: str) -> InputError:
    return InputError(f"{spec.name}: the hf profile cannot build this model ({why})")


def hf_family(spec: ModelSpec) -> str:
    """The transformers architecture that matches the spec's parameters (see module doc)."""
    if spec.is_encoder:
        if spec.model_type == "modernbert":
            return "modernbert"
        return "roberta" if spec.model_type in ROBERTA_TYPES else "bert"
    if spec.is_encoder_decoder:  # vramcalc/trace/hf_seq2seq.py
        return spec.model_type
    if spec.norm_kind == "layernorm" or spec.position_embedding == "learned" or (
            spec.mlp_kind == "standard"):
        if not gpt2_shaped(spec):
            raise _unsupported(spec, "only GPT-2-style LayerNorm models are supported")
        return "gpt2"
    if spec.is_moe:
        if spec.attention_bias != spec.attention_out_bias and not spec.num_shared_experts:
            raise _unsupported(spec, "MoE with q/k/v biases but no o bias")
        if spec.router_bias or spec.mlp_bias:
            raise _unsupported(spec, "router or expert biases")
        if spec.num_shared_experts:
            if spec.num_shared_experts != 1 or not spec.shared_expert_gate or spec.qk_norm:
                raise _unsupported(spec, "shared experts other than Qwen2-MoE's gated one")
            if spec.attention_out_bias:
                raise _unsupported(spec, "o-projection bias in a Qwen2-MoE model")
            return "qwen2_moe"
        if spec.shared_expert_gate:
            raise _unsupported(spec, "shared expert gate without a shared expert")
        if spec.qk_norm:
            return "qwen3_moe"
        if spec.num_dense_layers or spec.attention_bias:
            raise _unsupported(spec, "Mixtral has no dense layers and no biases")
        return "mixtral"
    if spec.model_type in ("phi3", "gemma", "mistral") and not (
            spec.attention_bias or spec.attention_out_bias or spec.mlp_bias or spec.qk_norm):
        return spec.model_type
    if spec.qk_norm:
        if spec.attention_bias != spec.attention_out_bias or spec.mlp_bias:
            raise _unsupported(spec, "qk_norm with partial or MLP biases")
        return "qwen3"
    if spec.attention_bias and not spec.attention_out_bias:
        if spec.mlp_bias:
            raise _unsupported(spec, "q/k/v biases together with MLP biases")
        return "qwen2"
    if spec.attention_out_bias and not spec.attention_bias:
        raise _unsupported(spec, "an o-projection bias without q/k/v biases")
    return "llama"


def encoder_config(spec: ModelSpec, training: TrainingConfig | None = None) -> Any:
    """BertConfig / RobertaConfig with the spec's shapes and the dropout the run keeps.

    Under --attention flash the attention-probability dropout runs inside the fused kernel
    on CUDA, which keeps only its RNG seed and offset (FlashAttention-2 / PyTorch's
    memory-efficient kernel: `philox_seed`, `philox_offset`), no mask; the CPU SDPA the
    trace runs would fall back to the math path and keep a (b, a, s, s) mask, so the trace
    builds that dropout at 0, as the CUDA kernel's memory behaves."""
    from vramcalc.terms.encoder import encoder_dropout

    tf = _transformers()
    if spec.model_type == "modernbert":
        return modernbert_config(tf, spec)
    hidden, attn = encoder_dropout(spec, training)
    if training is not None and training.attention == "flash":
        attn = 0.0
    cls = tf.RobertaConfig if hf_family(spec) == "roberta" else tf.BertConfig
    return cls(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
               num_hidden_layers=spec.num_hidden_layers,
               num_attention_heads=spec.num_attention_heads,
               intermediate_size=spec.intermediate_size, hidden_act=spec.hidden_act,
               max_position_embeddings=spec.max_position_embeddings,
               type_vocab_size=spec.type_vocab_size, hidden_dropout_prob=hidden,
               attention_probs_dropout_prob=attn, num_labels=spec.num_labels,
               tie_word_embeddings=spec.tie_word_embeddings)


def modernbert_config(tf: Any, spec: ModelSpec) -> Any:
    """ModernBertConfig with the spec's shapes, biases, head and layer pattern (every dropout
    0, vramcalc/hf_modernbert.py); sliding_window is local_attention // 2 in transformers."""
    every = spec.sliding_window_pattern if spec.sliding_window else 1
    return tf.ModernBertConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, hidden_activation=spec.hidden_act,
        max_position_embeddings=spec.max_position_embeddings, norm_bias=spec.norm_bias,
        attention_bias=spec.attention_bias, mlp_bias=spec.mlp_bias,
        decoder_bias=spec.decoder_bias, classifier_bias=spec.classifier_bias,
        classifier_pooling=spec.classifier_pooling, num_labels=spec.num_labels,
        tie_word_embeddings=spec.tie_word_embeddings,
        local_attention=spec.sliding_window or 128, global_attn_every_n_layers=every,
        cls_token_id=None, sep_token_id=None, **NO_TOKENS)


def to_hf_config(spec: ModelSpec) -> Any:
    """A transformers config object with the spec's shapes (dropout off, no cache)."""
    if spec.is_encoder:
        return encoder_config(spec)
    tf = _transformers()
    if spec.is_encoder_decoder:
        return seq2seq_config(tf, spec)
    if spec.final_norm is False:
        raise _unsupported(spec, "no final norm")
    from transformers.activations import ACT2FN

    if spec.hidden_act not in ACT2FN:  # transformers' own table of activation names
        raise _unsupported(spec, f"hidden_act {shown(spec.hidden_act)} is not one of "
                           "transformers' activations")
    family = hf_family(spec)
    if family == "gpt2":
        return tf.GPT2Config(
            vocab_size=spec.vocab_size, n_positions=spec.max_position_embeddings,
            n_embd=spec.hidden_size, n_layer=spec.num_hidden_layers,
            n_head=spec.num_attention_heads, n_inner=spec.intermediate_size,
            activation_function=spec.hidden_act, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False, tie_word_embeddings=True, **NO_TOKENS)
    common: dict[str, Any] = {
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.kv_heads, "hidden_act": spec.hidden_act,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings, "attention_dropout": 0.0,
        "use_cache": False, **NO_TOKENS,
    }
    head_dim = {"head_dim": spec.head_size}
    default_head = spec.hidden_size // spec.num_attention_heads
    if family in ("qwen2", "phi3", "qwen2_moe") and spec.head_size != default_head:
        raise _unsupported(spec, f"{family} derives head_dim from hidden_size")
    if family == "llama":
        return tf.LlamaConfig(**common, **head_dim, intermediate_size=spec.intermediate_size,
                              attention_bias=spec.attention_bias, mlp_bias=spec.mlp_bias)
    if family == "mistral":
        return tf.MistralConfig(**common, **head_dim, intermediate_size=spec.intermediate_size,
                                sliding_window=None)
    if family == "gemma":
        return tf.GemmaConfig(**common, **head_dim, intermediate_size=spec.intermediate_size)
    if family == "phi3":
        return tf.Phi3Config(**common, intermediate_size=spec.intermediate_size,
                             resid_pdrop=0.0, embd_pdrop=0.0)
    if family == "qwen2":
        return tf.Qwen2Config(**common, intermediate_size=spec.intermediate_size)
    if family == "qwen3":
        return tf.Qwen3Config(**common, **head_dim, intermediate_size=spec.intermediate_size,
                              attention_bias=spec.attention_bias)
    if family == "mixtral":
        return tf.MixtralConfig(**common, **head_dim, intermediate_size=spec.expert_ffn,
                                num_local_experts=spec.num_local_experts,
                                num_experts_per_tok=spec.num_experts_per_tok,
                                router_jitter_noise=0.0)
    moe: dict[str, Any] = {
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.expert_ffn, "num_experts": spec.num_local_experts,
        "num_experts_per_tok": spec.num_experts_per_tok, "norm_topk_prob": True,
        "decoder_sparse_step": 1,  # the dense layers are listed (ModelSpec.is_moe_layer)
        "mlp_only_layers": [i for i in range(spec.num_hidden_layers) if not spec.is_moe_layer(i)],
    }
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, **moe, qkv_bias=spec.attention_bias,
                                 shared_expert_intermediate_size=spec.shared_ffn)
    return tf.Qwen3MoeConfig(**common, **head_dim, **moe, attention_bias=spec.attention_bias)


def _register_selective(tf: Any) -> None:
    """Attention functions that checkpoint the attention core (selective recompute)."""
    from torch.utils.checkpoint import checkpoint
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    def selective(kind: str) -> Any:
        def attention(module: Any, *args: Any, **kwargs: Any) -> Any:
            if kind == "sdpa":
                core = sdpa_attention_forward
            else:  # each modeling file defines its own eager_attention_forward
                core = sys.modules[type(module).__module__].eager_attention_forward
            return checkpoint(core, module, *args, use_reentrant=False, **kwargs)
        return attention

    for kind, mask in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        AttentionInterface.register(SELECTIVE_PREFIX + kind, selective(kind))
        AttentionMaskInterface.register(SELECTIVE_PREFIX + kind, mask)


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """Run `F.dropout` as CUDA does while active: ATen's `dropout`
    (aten/src/ATen/native/Dropout.cpp) takes the fused `native_dropout` kernel on CUDA for
    0 < p < 1, which keeps a bool mask (1 byte per element) for backward; on the CPU it
    takes the composite path, whose mask has the input's dtype. `F.dropout` is looked up at
    call time by nn.Dropout and transformers' attention functions (also when a checkpointed
    layer is recomputed in backward), so it is swapped for the duration."""
    import torch
    import torch.nn.functional as F

    original = F.dropout

    def dropout(x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if training and 0 < p < 1 and not inplace:
            return torch.native_dropout(x, p, True)[0]
        return original(x, p, training, inplace)

    F.dropout = dropout  # type: ignore[assignment]
    try:
        yield
    finally:
        F.dropout = original


@contextlib.contextmanager
def real_device_behaviour(dropout: bool = False, biased_sdpa: bool = False) -> Iterator[None]:
    """Make transformers take the branches it takes on a real device while a trace runs.

    transformers' masking code treats fake tensors as graph tracing
    (`import_utils.is_tracing(tensor)` checks `is_fake_tensor`) and then materialises a
    (b, 1, s, s) attention mask, which also turns off SDPA's native grouped-query path. On a
    GPU it checks the data instead (no packed sequences: no mask, `is_causal=True`); the
    tracker answers such data reads (`.item()`) with 1 / True. `biased_sdpa` (T5 under
    SDPA, whose position bias is a float attn_mask): CUDA's memory-efficient kernel runs
    those calls (vramcalc/trace/cuda_rules.py `cuda_biased_sdpa`).
    """
    _transformers()
    import transformers.masking_utils as masking

    original = masking.is_tracing
    masking.is_tracing = lambda tensor=None: original()
    try:
        with contextlib.ExitStack() as stack:
            if dropout:  # encoders train with dropout (`cuda_dropout`)
                stack.enter_context(cuda_dropout())
            if biased_sdpa:
                from vramcalc.trace.cuda_rules import cuda_biased_sdpa

                stack.enter_context(cuda_biased_sdpa())
            yield
    finally:
        masking.is_tracing = original


@contextlib.contextmanager
def _untruncated_init() -> Iterator[None]:
    """ModernBERT initialises with `init.trunc_normal_`, whose rejection loop in torch
    (nn/init.py `_no_grad_trunc_normal_`: `while mask.any()`) never ends on fake tensors (the
    tracker answers data reads with True). Initial values take no memory of their own: an
    in-place normal_ stands in while the model is built."""
    import torch
    import transformers.initialization as init

    original = init.trunc_normal_

    def normal(tensor: Any, mean: float = 0.0, std: float = 1.0, *args: Any, **kw: Any) -> Any:
        with torch.no_grad():
            return tensor.normal_(mean, std)

    init.trunc_normal_ = normal
    try:
        yield
    finally:
        init.trunc_normal_ = original


def shifted_logits_loss(logits: Any, labels: Any, vocab_size: int,
                        num_items_in_batch: Any = None, ignore_index: int = -100,
                        **kwargs: Any) -> Any:
    """The causal-LM loss of transformers 4.46-4.48 (`--transformers-version`), written from
    v4.46.0 loss/loss_utils.py `ForCausalLMLoss`: the fp32 upcast stays bound while a
    contiguous copy of the shifted logits and the sliced labels go to cross_entropy (summed
    and divided by num_items_in_batch when the Trainer passes it)."""
    from torch.nn import functional as F

    logits = logits.float()
    shifted = logits[..., :-1, :].contiguous().view(-1, vocab_size)
    targets = labels[..., 1:].contiguous().view(-1).to(shifted.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(shifted, targets, ignore_index=ignore_index, reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def upcast_output(module: Any, args: Any, output: Any) -> Any:
    """lm_head's output as transformers 4.31-4.45's causal-LM forwards bind it (v4.36.0
    modeling_llama.py: `logits = self.lm_head(hidden_states)`, `logits = logits.float()`):
    the compute-dtype logits are freed at once and the fp32 ones become the model output, so
    `shifted_logits_loss`'s own `.float()` returns them as they are."""
    return output.float()


def build_hf_model(spec: ModelSpec, training: TrainingConfig, dtype: Any) -> Any:
    """AutoModelForCausalLM.from_config for the spec, ready to train (call inside fake mode)."""
    tf = _transformers()
    cfg = encoder_config(spec, training) if spec.is_encoder else (
        seq2seq_config(tf, spec, training) if spec.is_encoder_decoder else to_hf_config(spec))
    attn = "sdpa" if training.attention == "flash" else "eager"
    if training.recompute == "selective":
        _register_selective(tf)
        attn = SELECTIVE_PREFIX + attn
    if training.kbit_prepare:  # loaded in the compute dtype; PEFT's prepare upcasts to fp32
        import torch

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(training.compute_dtype,
                                                                    dtype)
    auto = {"sequence_classification": tf.AutoModelForSequenceClassification,
            "masked_lm": tf.AutoModelForMaskedLM,
            "seq2seq_lm": tf.AutoModelForSeq2SeqLM}.get(spec.task, tf.AutoModelForCausalLM)
    with _untruncated_init():
        model = auto.from_config(cfg, attn_implementation=attn, dtype=dtype)
    if copies_shifted_logits(training) and not (spec.is_encoder or spec.is_encoder_decoder):
        model.loss_function = shifted_logits_loss
        if loss_in_forward(training):  # before 4.46: the forward's own upcast (hf_stack.py)
            model.get_output_embeddings().register_forward_hook(upcast_output)
    if training.recompute == "full" and training.finetune == "full":
        enable_checkpointing(model, training)
    return model


def enable_checkpointing(model: Any, training: Any) -> None:
    """HF Trainer's `gradient_checkpointing_enable` (renamed in transformers 5.x), which the
    Trainer calls on the model it trains: under PEFT after `get_peft_model` (the input
    embeddings it then makes require grad are the adapted module, if the embedding has an
    adapter), except with `--kbit-prepare`, whose preparation enables it before."""
    enable = getattr(model, "activation_checkpointing_enable", None) or (
        model.gradient_checkpointing_enable)
    enable({"use_reentrant": training.reentrant})


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """transformers' and PEFT's own warnings (deprecations, ignored config keys, an
    unrecognised loss type) are not the report's: a trace prints its report or one error
    line."""
    import logging
    import os
    import warnings

    hf_log = logging.getLogger("transformers")
    level, env = hf_log.level, os.environ.get("TRANSFORMERS_VERBOSITY")
    # transformers sets its logger's level from this variable when it is first imported
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_log.setLevel(logging.ERROR)
        try:
            yield
        finally:
            hf_log.setLevel(level)
            if env is None:
                del os.environ["TRANSFORMERS_VERBOSITY"]
            else:
                os.environ["TRANSFORMERS_VERBOSITY"] = env
