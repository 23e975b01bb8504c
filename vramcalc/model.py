"""ModelSpec: a transformer's architecture (decoder or encoder) and its exact parameter count.

Field names follow Hugging Face `config.json`. Parameter counts are exact: every
matrix, bias and norm vector is counted, as `sum(p.numel() for p in model.parameters())`
would count it for the matching PyTorch model.

Legend: h = hidden_size, a = num_attention_heads, g = num_key_value_heads,
d = head_dim, f = intermediate_size, V = vocab_size, L = num_hidden_layers,
E = num_local_experts, fe = moe_intermediate_size.
Multi-latent attention (DeepSeek-V2/V3, `kv_lora_rank` set): qr = q_lora_rank (None: a plain
q projection), kr = kv_lora_rank, dn = qk_nope_head_dim, dr = qk_rope_head_dim,
dv = v_head_dim; q/k heads are dn + dr wide (head_dim), v heads dv.
Encoders (BERT, RoBERTa, ModernBERT): T = type_vocab_size, n = num_labels (see
`encoder_tensors`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vramcalc.encoder_shapes import encoder_rows
from vramcalc.errors import InputError, shown
from vramcalc.seq2seq_shapes import seq2seq_num_params

MAX_DIM = 10_000_000
MAX_LAYERS = 100_000
MAX_EXPERTS = 1024
# the activations whose saved tensors the engines model (transformers ACT2FN names; relu2 is
# ReLUSquaredActivation, Nemotron's and Megatron-LM's --squared-relu)
Activation = Literal["silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast",
                     "gelu_python_tanh", "relu", "relu2"]


class ModelSpec(BaseModel):
    """A decoder-only or encoder-only transformer; see the module docstring for the letters."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    model_type: str = "llama"
    hidden_size: int = Field(gt=0, le=MAX_DIM)
    num_hidden_layers: int = Field(gt=0, le=MAX_LAYERS)
    num_attention_heads: int = Field(gt=0, le=MAX_DIM)
    num_key_value_heads: int | None = Field(None, gt=0, le=MAX_DIM)
    head_dim: int | None = Field(None, gt=0, le=MAX_DIM)
    intermediate_size: int = Field(gt=0, le=MAX_DIM * 10)
    vocab_size: int = Field(gt=0, le=MAX_DIM * 10)
    max_position_embeddings: int = Field(4096, gt=0, le=100_000_000)
    mlp_kind: Literal["gated", "standard"] = "gated"
    hidden_act: Activation = "silu"
    norm_kind: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_bias: bool = False
    attention_bias: bool = False  # biases on q, k, v projections
    attention_out_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma3)
    position_embedding: Literal["rope", "learned", "relative"] = "rope"  # relative: T5
    # config.json rope_scaling.rope_type "llama3" (Llama 3.1 on): torchtune's Llama3ScaledRoPE
    rope_scaling: Literal["llama3"] | None = Field(None, exclude_if=lambda v: v is None)
    tie_word_embeddings: bool = False
    final_norm: bool = True
    # attention and MLP read the same block input and are added to it together
    # (x + attn(norm(x)) + mlp(norm'(x))): GPT-J, phi-1/1.5/2, GPT-NeoX use_parallel_residual,
    # Falcon parallel_attn; with num_layer_norms 1 both branches share one norm. Left out of
    # dumps when off, as lm_head_bias
    parallel_residual: bool = Field(False, exclude_if=lambda v: not v)
    lm_head_bias: bool = Field(False, exclude_if=lambda v: not v)  # phi, GPT-J: V more
    # Mixture of experts; num_local_experts == 0 means dense.
    # at most MAX_EXPERTS: the largest published MoE LLMs route over 256-384 experts
    # (DeepSeek-V3 256, Kimi K2 384); the engine's cost grows with the count
    num_local_experts: int = Field(0, ge=0, le=MAX_EXPERTS)
    num_experts_per_tok: int = Field(0, ge=0, le=MAX_EXPERTS)
    moe_intermediate_size: int | None = Field(None, gt=0, le=MAX_DIM * 10)
    num_shared_experts: int = Field(0, ge=0, le=1000)
    shared_expert_intermediate_size: int | None = Field(None, gt=0, le=MAX_DIM * 10)
    shared_expert_gate: bool = False  # Qwen2-MoE: a h->1 gate on the shared expert
    first_k_dense_replace: int = Field(0, ge=0, le=MAX_LAYERS)  # leading dense layers
    # indices of the MoE layers when they are interleaved with dense ones (Qwen2/3-MoE
    # decoder_sparse_step / mlp_only_layers, Llama-4 interleave_moe_layer_step / moe_layers);
    # None: every layer from first_k_dense_replace on (left out of dumps when None)
    moe_layers: tuple[int, ...] | None = Field(None, exclude_if=lambda v: v is None)
    router_bias: bool = False
    # Multi-latent attention (DeepSeek-V2/V3); kv_lora_rank None means ordinary attention.
    q_lora_rank: int | None = Field(None, gt=0, le=MAX_DIM)
    kv_lora_rank: int | None = Field(None, gt=0, le=MAX_DIM)
    qk_nope_head_dim: int | None = Field(None, ge=0, le=MAX_DIM)
    qk_rope_head_dim: int | None = Field(None, gt=0, le=MAX_DIM)
    v_head_dim: int | None = Field(None, gt=0, le=MAX_DIM)
    num_layer_norms: int = Field(2, ge=1, le=8)  # Gemma 2/3: 4 (pre/post attn and MLP)
    # Sliding-window attention (config.json `sliding_window`): None = every layer attends to
    # the whole context. With a window, `sliding_window_pattern` 0 makes every layer local
    # (Mistral 7B v0.1); N >= 2 makes layer i global when (i + 1) % N == 0 and local
    # otherwise (Gemma 2: N = 2, Gemma 3: N = 6, transformers `layer_types`).
    sliding_window: int | None = Field(None, gt=0, le=100_000_000)
    sliding_window_pattern: int = Field(0, ge=0, le=MAX_LAYERS)
    # encoders: post-LayerNorm, a classification / masked-LM head, the config's dropout
    architecture: Literal["decoder", "encoder", "encoder_decoder"] = "decoder"
    task: Literal["causal_lm", "sequence_classification", "masked_lm", "seq2seq_lm"] = (
        "causal_lm")
    # encoder-decoders (vramcalc/seq2seq_shapes.py): num_hidden_layers counts the encoder's
    num_decoder_layers: int = Field(0, ge=0, le=MAX_LAYERS, exclude_if=lambda v: not v)
    relative_attention_num_buckets: int = Field(0, ge=0, le=MAX_DIM, exclude_if=lambda v: not v)
    activation_dropout: float = Field(0.0, ge=0.0, lt=1.0, exclude_if=lambda v: not v)
    num_labels: int = Field(2, gt=0, le=1_000_000)
    type_vocab_size: int = Field(0, ge=0, le=MAX_DIM)
    hidden_dropout_prob: float = Field(0.0, ge=0.0, lt=1.0)
    attention_probs_dropout_prob: float = Field(0.0, ge=0.0, lt=1.0)
    # ModernBERT's heads (vramcalc/encoder_shapes.py); left out of dumps at their defaults
    classifier_pooling: Literal["cls", "mean"] = Field("cls", exclude_if=lambda v: v == "cls")
    classifier_bias: bool = Field(False, exclude_if=lambda v: not v)
    decoder_bias: bool = Field(True, exclude_if=lambda v: v)
    source: str = "custom"  # where the spec came from (preset, file path)

    @model_validator(mode="before")
    @classmethod
    def _untie_classifier(cls, data: Any) -> Any:
        """A classification head has no vocabulary projection to tie."""
        cls_head = isinstance(data, dict) and data.get("task") == "sequence_classification"
        return {**data, "tie_word_embeddings": False} if cls_head else data

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        g = self.kv_heads
        if self.num_attention_heads % g != 0:
            raise InputError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({g})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads != 0:
            raise InputError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); give head_dim explicitly"
            )
        if self.num_layer_norms == 1 and not self.parallel_residual:
            raise InputError("num_layer_norms 1 (one norm shared by attention and the MLP) "
                             "needs parallel_residual: true")
        if self.parallel_residual and (self.num_layer_norms > 2 or self.is_moe):
            raise InputError("parallel_residual is modelled for dense blocks with one or "
                             "two norms")
        if self.num_local_experts:
            if not 0 < self.num_experts_per_tok <= self.num_local_experts:
                raise InputError(
                    "num_experts_per_tok must be between 1 and num_local_experts "
                    f"({self.num_local_experts}), got {self.num_experts_per_tok}"
                )
            if self.first_k_dense_replace > self.num_hidden_layers:
                raise InputError("first_k_dense_replace exceeds num_hidden_layers")
        if self.moe_layers is not None:
            if not self.num_local_experts:
                raise InputError("moe_layers needs num_local_experts > 0")
            if list(self.moe_layers) != sorted(set(self.moe_layers)) or any(
                    not 0 <= i < self.num_hidden_layers for i in self.moe_layers):
                raise InputError(f"moe_layers must be increasing layer indices in [0, "
                                 f"{self.num_hidden_layers}), got {list(self.moe_layers)}")
            if self.first_k_dense_replace:
                raise InputError("give either moe_layers or first_k_dense_replace, not both")
        self._check_mla()
        if self.sliding_window_pattern == 1 or (
                self.sliding_window_pattern and self.sliding_window is None):
            raise InputError("sliding_window_pattern needs a sliding_window and must be 0 "
                             "(every layer local) or at least 2")
        self._check_encoder()
        return self

    def _check_encoder(self) -> None:
        if self.is_encoder_decoder != (self.task == "seq2seq_lm") or self.is_encoder_decoder != (
                self.num_decoder_layers > 0):
            raise InputError("encoder-decoders (T5, BART) take task seq2seq_lm and "
                             "num_decoder_layers > 0; other architectures neither")
        if self.is_encoder_decoder:
            return
        dropout = self.hidden_dropout_prob or self.attention_probs_dropout_prob
        if self.is_encoder == (self.task == "causal_lm") or dropout and not self.is_encoder:
            raise InputError("encoders take task sequence_classification or masked_lm, decoders "
                             "causal_lm; dropout probabilities are modelled for encoders only")
        modern = self.model_type == "modernbert"
        if self.is_encoder and (self.is_moe or self.is_mla or self.norm_kind != "layernorm"
                or self.qk_norm or self.num_layer_norms != 2 or (self.mlp_kind, (
                    self.position_embedding), self.final_norm) != (
                    ("gated", "rope", True) if modern else ("standard", "learned", False))):
            raise InputError("encoders are BERT-style (a 2-matrix MLP, learned positions, no "
                             "final norm) or ModernBERT-style (GeGLU, RoPE, a final norm): "
                             "LayerNorm, no MoE / MLA / qk_norm")
        if not modern and (self.classifier_pooling != "cls" or self.classifier_bias
                           or not self.decoder_bias):
            raise InputError("classifier_pooling, classifier_bias and decoder_bias are "
                             "ModernBERT's (model_type modernbert)")

    def _check_mla(self) -> None:
        mla = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if self.kv_lora_rank is None:
            if self.q_lora_rank is not None or any(v is not None for v in mla):
                raise InputError("multi-latent attention fields need kv_lora_rank")
            return
        if any(v is None for v in mla):
            raise InputError("multi-latent attention needs kv_lora_rank, qk_nope_head_dim, "
                             "qk_rope_head_dim and v_head_dim")
        if self.head_dim != self.qk_head_dim:
            raise InputError(f"multi-latent attention: head_dim ({self.head_dim}) must be "
                             f"qk_nope_head_dim + qk_rope_head_dim ({self.qk_head_dim})")
        if self.kv_heads != self.num_attention_heads:
            raise InputError("multi-latent attention: num_key_value_heads must equal "
                             "num_attention_heads")

    # ---- derived shapes -------------------------------------------------
    @property
    def is_encoder(self) -> bool:
        return self.architecture == "encoder"

    @property
    def is_encoder_decoder(self) -> bool:
        return self.architecture == "encoder_decoder"
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V2/V3): latent q and kv projections."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """MLA: width of a q or k head, qk_nope_head_dim + qk_rope_head_dim."""
        return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)

    def layer_is_sliding(self, i: int) -> bool:
        """Whether layer i (0-based) attends only to the last `sliding_window` tokens."""
        if self.sliding_window is None:
            return False
        n = self.sliding_window_pattern  # ModernBERT: layer i global when i % n == 0
        return n == 0 or (i + (self.model_type != "modernbert")) % n != 0

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.layer_is_sliding(i) for i in range(self.num_hidden_layers))

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (0-based) is a mixture-of-experts layer: listed in moe_layers, or
        at or after first_k_dense_replace when moe_layers is None."""
        if not self.is_moe:
            return False
        if self.moe_layers is not None:
            return i in self.moe_layers
        return i >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        if self.moe_layers is not None:
            return len(self.moe_layers)
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    @property
    def expert_ffn(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def shared_ffn(self) -> int:
        return self.shared_expert_intermediate_size or self.expert_ffn

    # ---- parameter counts (exact) --------------------------------------
    def _norm_params(self, width: int) -> int:
        return width * (2 if self.norm_bias else 1)

    def _mlp_params(self, ffn: int) -> int:
        """One MLP: gated = gate, up (h->f) and down (f->h); standard = fc (h->f), proj (f->h)."""
        h = self.hidden_size
        if self.mlp_kind == "gated":
            return 3 * h * ffn + (2 * ffn + h if self.mlp_bias else 0)
        return 2 * h * ffn + (ffn + h if self.mlp_bias else 0)

    @cached_property
    def attention_params(self) -> int:
        """Per layer: q (h->a·d), k and v (h->g·d), o (a·d->h), their biases, q/k norms.
        Multi-latent attention: the tensors of `mla_tensors`."""
        if self.is_mla:
            return sum(numel for _, numel, _, _ in mla_tensors(self))
        h, a, g, d = self.hidden_size, self.num_attention_heads, self.kv_heads, self.head_size
        n = h * a * d + 2 * h * g * d + a * d * h
        if self.attention_bias:
            n += a * d + 2 * g * d
        if self.attention_out_bias:
            n += h
        if self.qk_norm:
            n += 2 * self._norm_params(d)
        return n

    @cached_property
    def dense_mlp_params(self) -> int:
        return self._mlp_params(self.intermediate_size)

    @cached_property
    def expert_params(self) -> int:
        """One routed expert's MLP."""
        return self._mlp_params(self.expert_ffn) if self.is_moe else 0

    @cached_property
    def router_params(self) -> int:
        if not self.is_moe:
            return 0
        return self.hidden_size * self.num_local_experts + (
            self.num_local_experts if self.router_bias else 0
        )

    @cached_property
    def shared_expert_params(self) -> int:
        if not self.num_shared_experts:
            return 0
        n = self.num_shared_experts * self._mlp_params(self.shared_ffn)
        return n + (self.hidden_size if self.shared_expert_gate else 0)

    @cached_property
    def layer_norm_params(self) -> int:
        """The norms of one layer: before attention and before the MLP (Gemma 2/3: four)."""
        return self.num_layer_norms * self._norm_params(self.hidden_size)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False
                   ) -> ModelSpec:
        """Copy with changes, validated like a new spec (a changed shape must still divide;
        the cached parameter counts are computed afresh)."""
        return type(self)(**{**self.model_dump(), **(update or {})})

    @cached_property
    def dense_layer_params(self) -> int:
        return self.attention_params + self.dense_mlp_params + self.layer_norm_params

    @cached_property
    def moe_layer_params(self) -> int:
        return (
            self.attention_params
            + self.num_local_experts * self.expert_params
            + self.router_params
            + self.shared_expert_params
            + self.layer_norm_params
        )

    @cached_property
    def embedding_params(self) -> int:
        """Token embedding V·h plus learned position embedding P·h when used."""
        n = self.vocab_size * self.hidden_size
        if self.position_embedding == "learned":
            n += self.max_position_embeddings * self.hidden_size
        return n + sum(t.numel for t in encoder_tensors(self) if t.group == "embedding")

    @cached_property
    def head_params(self) -> int:
        """Output projection h->V (zero when tied to the embedding) and its bias (encoders:
        their head)."""
        if self.is_encoder:
            return sum(t.numel for t in encoder_tensors(self) if t.group == "head")
        bias = self.vocab_size if self.lm_head_bias else 0
        return bias + (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)

    @cached_property
    def final_norm_params(self) -> int:
        return self._norm_params(self.hidden_size) if self.final_norm else 0

    @cached_property
    def num_params(self) -> int:
        """Exact total parameter count (encoder-decoders: vramcalc/seq2seq_shapes.py)."""
        if self.is_encoder_decoder:
            return seq2seq_num_params(self)
        return (
            self.embedding_params
            + self.num_dense_layers * self.dense_layer_params
            + self.num_moe_layers * self.moe_layer_params
            + self.final_norm_params
            + self.head_params
            - (self._norm_params(self.hidden_size) if self.model_type == "modernbert" else 0)
        )  # ModernBERT's layer 0 has no attn_norm (nn.Identity)

    @cached_property
    def num_active_params(self) -> int:
        """Parameters touched per token (MoE: top-k routed experts only)."""
        if not self.is_moe:
            return self.num_params
        inactive = (self.num_local_experts - self.num_experts_per_tok) * self.expert_params
        return self.num_params - self.num_moe_layers * inactive

    def summary(self) -> str:
        kind = "MoE" if self.is_moe else "dense"
        return (
            f"{self.name}: {self.num_params / 1e9:.2f}B params ({kind}), L={self.num_hidden_layers}, "
            f"h={self.hidden_size}, heads={self.num_attention_heads}/{self.kv_heads}, "
            f"ffn={self.intermediate_size}, vocab={self.vocab_size}"
        )


# ---- validation at the boundary ------------------------------------------------------
def validation_message(err: Any, allowed: list[str]) -> str:
    """First pydantic error as one line: `field: message` (+ a suggestion for typos)."""
    # Unknown fields first: a missing field is often a typo of one.
    errors = sorted(err.errors(), key=lambda e: e.get("type") != "extra_forbidden")
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        close = difflib.get_close_matches(loc, allowed, n=1)
        msg = f"unknown field '{loc}'" + (f" (did you mean '{close[0]}'?)" if close else "")
    else:
        cause = (first.get("ctx") or {}).get("error")
        text = str(cause) if isinstance(cause, Exception) else first.get("msg", "invalid")
        if first.get("type") == "literal_error":  # name the value given
            loc = f"{loc} {shown(first.get('input'))}"
        msg = f"{loc}: {text}" if loc else text
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return " ".join(msg.split())


def spec_from_fields(fields: dict[str, Any], where: str) -> ModelSpec:
    """ModelSpec(**fields), with every validation failure turned into a one-line InputError
    prefixed by `where` (the file or preset the fields came from)."""
    try:
        return ModelSpec(**fields)
    except ValidationError as err:
        raise InputError(
            f"{where}: {validation_message(err, list(ModelSpec.model_fields))}"
        ) from None


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor shape, repeated `count` times in the model.

    `group` says where it lives: embedding, layer (per dense or moe layer), expert,
    final (final norm) or head. `tp_split` says whether tensor parallelism splits it.
    """

    name: str
    numel: int
    count: int
    group: str
    tp_split: bool = True
    rows: int = 0  # first dimension of a matrix (0 for vectors); cols = numel // rows


def mla_tensors(spec: ModelSpec) -> tuple[tuple[str, int, int, bool], ...]:
    """Multi-latent attention's parameters of one layer as (name, numel, rows, tp_split).

    transformers modeling_deepseek_v3.py `DeepseekV3Attention.__init__`: q_a_proj (h->qr,
    bias=attention_bias), q_a_layernorm (qr), q_b_proj (qr->a·(dn+dr)), or q_proj
    (h->a·(dn+dr), no bias) when q_lora_rank is None; kv_a_proj_with_mqa (h->kr+dr,
    bias=attention_bias), kv_a_layernorm (kr), kv_b_proj (kr->a·(dn+dv)), o_proj (a·dv->h,
    bias=attention_bias). Under TP, Megatron-LM's MLASelfAttention (multi_latent_attention.py
    @ d98e8a64) splits the up-projections and linear_proj by heads and keeps the
    down-projections (TELinear parallel_mode="duplicated") and the latent norms whole.
    """
    h, a = spec.hidden_size, spec.num_attention_heads
    qr, kr = spec.q_lora_rank, spec.kv_lora_rank or 0
    dq, dr = spec.qk_head_dim, spec.qk_rope_head_dim or 0
    dn, dv = spec.qk_nope_head_dim or 0, spec.v_head_dim or 0
    bias = spec.attention_bias
    out: list[tuple[str, int, int, bool]] = []
    if qr:
        out.append(("q_a_proj.weight", h * qr, qr, False))
        if bias:
            out.append(("q_a_proj.bias", qr, 0, False))
        out += [("q_a_layernorm.weight", qr, 0, False),
                ("q_b_proj.weight", qr * a * dq, a * dq, True)]
    else:
        out.append(("q_proj.weight", h * a * dq, a * dq, True))
    out.append(("kv_a_proj_with_mqa.weight", h * (kr + dr), kr + dr, False))
    if bias:
        out.append(("kv_a_proj_with_mqa.bias", kr + dr, 0, False))
    out += [("kv_a_layernorm.weight", kr, 0, False),
            ("kv_b_proj.weight", kr * a * (dn + dv), a * (dn + dv), True),
            ("o_proj.weight", a * dv * h, h, True)]
    if spec.attention_out_bias:
        out.append(("o_proj.bias", h, 0, False))
    return tuple(out)


@lru_cache(maxsize=256)
def encoder_tensors(spec: ModelSpec) -> tuple[ParamTensor, ...]:
    """An encoder's parameters outside its layers (none for a decoder):
    vramcalc/encoder_shapes.py `encoder_rows`."""
    return tuple(ParamTensor(name, numel, 1, group, tp_split=False, rows=rows)
                 for name, numel, group, rows in encoder_rows(spec))
