"""The megatron profile's MoE layers (`--moe-dispatcher allgather|alltoall`).

Expected bytes are derived by hand from NVIDIA/Megatron-LM d98e8a64 (never from the code's
output); per layer, one micro-batch, bf16, T = s·b/t tokens on the rank (sequence
parallel), n = T·t·k tokens at the rank's experts, E experts, f/t the expert FFN shard:
- the layer outside the MLP is Korthikanti et al. 2022 Table 2 (see
  test_megatron_dropout.py); of the MLP's 19 sbh only the norm output (2 sbh, the router's
  input: moe_utils.py RouterGatingLinearFunction `ctx.save_for_backward(inp, ...)`) and
  the bias-dropout-add mask (1 sbh) stay: 34 -> 18 sbh;
- router (moe_utils.py `topk_routing_with_score_function`): torch.topk's int64 indices and
  the fp32 softmax output, T·k·(8 + 4);
- allgather (token_dispatcher.py MoEAllGatherTokenDispatcher.dispatch_postprocess):
  masked_select keeps its (E/ep, T·t·ep) bf16 input and bool mask, 3·T·t·E; `permute`'s
  index_select its int64 indices, 8·n;
- alltoall (MoEAlltoAllTokenDispatcher.dispatch_preprocess -> `permute` with probs): the
  argsort positions (kept by the probabilities' indexing) and the token indices (kept by
  index_select), 2·8·T·k;
- experts (experts.py SequentialMLP.forward -> mlp.py MLP.forward, `per_token_scale`):
  fc1 input 2·n·h, probabilities 2·n, gelu input, gelu output (kept by · probs) and fc2
  input 3·2·n·f/t;
- `unpermute` (scatter_add_) keeps only the index; the collectives keep nothing.
Case: the calibration's MoE test (12L, h 512, 8 heads, 8 experts of f 2048, top-1, b 4,
s 1024, TP2 EP2 SP, unfused attention, dropout 0.1): T = 2048, n = 4096, f/t = 1024.
"""

from __future__ import annotations

import pytest
from megatron_models import GPT_MOE, GPT_SMALL

from vramcalc.errors import InputError
from vramcalc.options import build_scenario
from vramcalc.parallel import ParallelConfig
from vramcalc.rank import RankContext
from vramcalc.terms.activations import layer_activation_bytes
from vramcalc.terms.megatron_layer import megatron_layer_bytes
from vramcalc.training import TrainingConfig

B, S, H, A = 4, 1024, 512, 8
SBH = S * B * H  # 2_097_152
CORE = 5 * A * S * S * B  # unfused core: softmax 2 + mask 1 + dropout output 2, (b, a, s, s)


def _ctx(dispatcher: str | None = None, attention: str = "eager", recompute: str = "none",
         spec: object = GPT_MOE, deterministic: bool = False, **par: object) -> RankContext:
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision="bf16", framework="megatron",
                        attention=attention, recompute=recompute, moe_dispatcher=dispatcher,
                        deterministic=deterministic)
    return RankContext(spec, tr, ParallelConfig(**{"dp": 4, "tp": 2, "ep": 2,
                                                   "sequence_parallel": True, **par}))


# the calibration case, by hand
T, N, FT = 2048, 4096, 1024
ATTN = (18 * SBH + CORE) // 2  # 18 sbh + 5·as²b, all ÷ t under SP: 102_760_448
ROUTER = T * 1 * (8 + 4)  # 24_576
EXPERTS = 2 * N * H + 2 * N + 6 * N * FT  # 4_194_304 + 8_192 + 25_165_824
ALLGATHER = 3 * T * 2 * 8 + 8 * N  # 98_304 + 32_768
ALLTOALL = 2 * 8 * T * 1  # 32_768


def test_allgather_is_megatrons_default() -> None:
    assert megatron_layer_bytes(_ctx(), moe=True) == megatron_layer_bytes(
        _ctx("allgather"), moe=True)
    assert ATTN == 102_760_448 and EXPERTS == 29_368_320
    assert megatron_layer_bytes(_ctx("allgather"), moe=True) == (
        ATTN + ROUTER + ALLGATHER + EXPERTS) == 132_284_416


def test_alltoall() -> None:
    assert megatron_layer_bytes(_ctx("alltoall"), moe=True) == (
        ATTN + ROUTER + ALLTOALL + EXPERTS) == 132_186_112


def test_dense_layer_unchanged() -> None:
    # the dense Table 2 layer (f = 4h: 34 sbh), whatever the dispatcher
    dense = (34 * SBH + CORE) // 2
    assert megatron_layer_bytes(_ctx("alltoall", spec=GPT_SMALL)) == dense == 119_537_664
    assert megatron_layer_bytes(_ctx("alltoall"), moe=False) == dense
    # the layers of an MoE model are MoE layers
    assert layer_activation_bytes(_ctx()) == 132_284_416


def test_tp1_top2_flash() -> None:
    # t = 1, no SP, ep 1: T = n/k = s·b = 4096, k = 2, every expert local, f = 2048; flash
    # core: the fp32 logsumexp 4·a·s·b; allgather gathers nothing (tp = ep = 1) but still
    # masked_selects the (E, T) probabilities
    spec = GPT_MOE.model_copy(update={"num_experts_per_tok": 2})
    T1, k, n = 4096, 2, 8192
    attn = 18 * SBH + 4 * A * S * B
    experts = 2 * n * H + 2 * n + 6 * n * 2048
    router = T1 * k * 12
    got = {d: megatron_layer_bytes(_ctx(d, attention="flash", spec=spec, dp=1, tp=1, ep=1,
                                        sequence_parallel=False), moe=True)
           for d in ("allgather", "alltoall")}
    assert got["allgather"] == attn + router + 3 * T1 * 8 + 8 * n + experts == 147_210_240
    assert got["alltoall"] == attn + router + 16 * T1 * k + experts == 147_177_472


def test_recompute() -> None:
    # selective recomputes the attention core only; full keeps the (s/t, b, h) layer input
    assert megatron_layer_bytes(_ctx(recompute="selective"), moe=True) == (
        18 * SBH // 2 + ROUTER + ALLGATHER + EXPERTS)
    assert megatron_layer_bytes(_ctx("alltoall", recompute="full"), moe=True) == 2 * SBH // 2


def _scenario(**kw: object) -> object:
    return build_scenario({"model": "mixtral-8x7b", "gpus": "1xH100", **kw})


def test_other_profiles_refuse_the_option() -> None:
    for fw in ("reference", "hf"):
        _scenario(framework=fw)
        with pytest.raises(InputError, match="only the megatron profile models Megatron-LM's "
                                             "token dispatchers"):
            _scenario(framework=fw, moe_dispatcher="alltoall")
    _scenario(framework="megatron", moe_dispatcher="alltoall")
    with pytest.raises(InputError, match="--moe-dispatcher"):
        _scenario(framework="megatron", moe_dispatcher="flex")


def test_deterministic_mode() -> None:
    # torch.use_deterministic_algorithms(True) (moe_utils.py d98e8a64): unpermute's index_add_
    # keeps its source, the bf16 expert output it receives — allgather: the n = 4096 local
    # rows before the reduce-scatter; alltoall: the T·k = 2048 rows after the all-to-all —
    # and the router's index_put_ keeps rows = arange(T)[:, None], int64 (8·T)
    for dispatcher, rows in (("allgather", N), ("alltoall", T * 1)):
        plain = megatron_layer_bytes(_ctx(dispatcher), moe=True)
        det = megatron_layer_bytes(_ctx(dispatcher, deterministic=True), moe=True)
        assert det - plain == 2 * rows * H + 8 * T
    # allgather: 2·4096·512 + 8·2048 = 4_210_688
    assert megatron_layer_bytes(_ctx(deterministic=True), moe=True) == 132_284_416 + 4_210_688
    # dense layers and full recompute keep nothing more
    assert megatron_layer_bytes(_ctx(deterministic=True), moe=False) == megatron_layer_bytes(
        _ctx(), moe=False)
    assert megatron_layer_bytes(_ctx(recompute="full", deterministic=True), moe=True) == (
        2 * SBH // 2)


def test_deterministic_needs_the_megatron_profile() -> None:
    _scenario(framework="megatron", deterministic=True)
    with pytest.raises(InputError, match="--deterministic: only the megatron profile"):
        _scenario(framework="hf", deterministic=True)
