"""Expert tensor parallelism (`--etp`, Megatron-LM's --expert-tensor-parallel-size) in the
megatron profile.

Expected values are derived by hand from NVIDIA/Megatron-LM d98e8a64 (never from the code's
output):
- parallel_state.py `initialize_model_parallel`: the expert grid is etp x ep x expert-dp x
  pp over the same world, expert_data_parallel_size = world // (etp·ep·pp), and the world
  must be divisible by etp·ep·pp (RuntimeError otherwise); etp defaults to tp
  (training/arguments.py);
- moe/experts.py builds the routed experts on `pg_collection.expt_tp`: each holds an f/etp
  shard (fc1 column-, fc2 row-parallel); attention, norms and shared experts stay on tp;
- moe/token_dispatcher.py: `tp_size`/`tp_group` are the expert-TP group and `tp_ep_group`
  the etp x ep group. allgather gathers T tokens from each of its etp·ep ranks (T = s·b/t
  under sequence parallelism), k/ep of them for the local experts: n = T·etp·k; alltoall
  sends T·k, receives T·k over ep and gathers over the etp ranks: the same n.
Per MoE layer (bf16, one micro-batch; test_megatron_moe.py gives the terms): attention side
18 sbh + core (÷t under SP), router T·k·12, allgather 3·T·etp·E + 8·n, alltoall 2·8·T·k,
experts 2·n·h + 2·n + 6·n·f/etp.
Model: the calibration's MoE GPT (12 layers, h 512, 8 heads, E 8 experts of f 2048, top-1,
no biases), b 4, s 1024, unfused attention, dropout 0.1, 8 GPUs.
"""

from __future__ import annotations

import json

import pytest
from megatron_models import GPT_MOE, GPT_SMALL
from typer.testing import CliRunner

from vramcalc.cli import app, main
from vramcalc.cli.plan import prepare_plan
from vramcalc.errors import InputError
from vramcalc.parallel import ParallelConfig, resolve_layout
from vramcalc.planner.search import search
from vramcalc.rank import RankContext
from vramcalc.render.plan import strategy_flags
from vramcalc.terms import comm
from vramcalc.terms.gradients import gradients_bytes
from vramcalc.terms.megatron_layer import megatron_layer_bytes
from vramcalc.terms.optimizer_states import optimizer_states_bytes
from vramcalc.terms.weights import weights_bytes
from vramcalc.training import TrainingConfig

B, S, H, A, E, F = 4, 1024, 512, 8, 8, 2048
SBH = S * B * H  # 2_097_152
CORE = 5 * A * S * S * B  # unfused core: softmax 2 + mask 1 + dropout output 2, (b, a, s, s)
WORLD = 8


def _ctx(dispatcher: str | None = None, spec: object = GPT_MOE, zero: int = 0,
         deterministic: bool = False, **par: object) -> RankContext:
    tr = TrainingConfig(seq_len=S, micro_batch_size=B, precision="bf16", framework="megatron",
                        attention="eager", moe_dispatcher=dispatcher,
                        deterministic=deterministic)
    layout = resolve_layout(spec, tr, ParallelConfig(zero=zero, **par), WORLD)  # type: ignore
    return RankContext(spec, tr, layout)  # type: ignore[arg-type]


# A: tp 2 (SP), etp 1, ep 4 -> dp 4, expert-dp 8/(1·4) = 2
A = {"tp": 2, "etp": 1, "ep": 4, "sequence_parallel": True}
# B (the reverse): tp 1, etp 2, ep 4 -> dp 8, expert-dp 8/(2·4) = 1
B_ = {"tp": 1, "etp": 2, "ep": 4}
# Megatron's default for A's dense layout: etp = tp = 2, expert-dp 4/4 = 1
DEFAULT = {"tp": 2, "ep": 4, "sequence_parallel": True}

# A by hand: T = s·b/t = 2048, n = T·etp·k = 2048, f/etp = 2048
A_ATTN = (18 * SBH + CORE) // 2  # 102_760_448
A_ROUTER = 2048 * 1 * 12  # 24_576
A_EXPERTS = 2 * 2048 * H + 2 * 2048 + 6 * 2048 * 2048  # 27_267_072
A_ALLGATHER = 3 * 2048 * 1 * E + 8 * 2048  # 65_536
A_ALLTOALL = 2 * 8 * 2048 * 1  # 32_768
# B by hand: no SP, T = s·b = 4096, n = T·etp·k = 8192, f/etp = 1024
B_ATTN = 18 * SBH + CORE  # 205_520_896
B_ROUTER = 4096 * 1 * 12  # 49_152
B_EXPERTS = 2 * 8192 * H + 2 * 8192 + 6 * 8192 * 1024  # 58_736_640
B_ALLGATHER = 3 * 4096 * 2 * E + 8 * 8192  # 262_144
B_ALLTOALL = 2 * 8 * 4096 * 1  # 65_536


def test_moe_layer_etp_below_tp() -> None:
    assert A_ATTN == 102_760_448 and A_EXPERTS == 27_267_072
    assert megatron_layer_bytes(_ctx("allgather", **A), moe=True) == (
        A_ATTN + A_ROUTER + A_ALLGATHER + A_EXPERTS) == 130_117_632
    assert megatron_layer_bytes(_ctx("alltoall", **A), moe=True) == (
        A_ATTN + A_ROUTER + A_ALLTOALL + A_EXPERTS) == 130_084_864
    # deterministic allgather: unpermute's index_add_ keeps the n = 2048 local rows (bf16)
    # and the router's index_put_ its int64 rows (8·T)
    assert megatron_layer_bytes(_ctx("allgather", deterministic=True, **A), moe=True) == (
        130_117_632 + 2 * 2048 * H + 8 * 2048)


def test_moe_layer_etp_above_tp() -> None:
    assert B_ATTN == 205_520_896 and B_EXPERTS == 58_736_640
    assert megatron_layer_bytes(_ctx("allgather", **B_), moe=True) == (
        B_ATTN + B_ROUTER + B_ALLGATHER + B_EXPERTS) == 264_568_832
    assert megatron_layer_bytes(_ctx("alltoall", **B_), moe=True) == (
        B_ATTN + B_ROUTER + B_ALLTOALL + B_EXPERTS) == 264_372_224


def test_etp_equal_to_tp_is_the_default() -> None:
    # the calibration case of test_megatron_moe.py (tp 2, ep 2, dp 4): 132_284_416
    for d in ("allgather", "alltoall"):
        given = _ctx(d, tp=2, etp=2, ep=2, sequence_parallel=True)
        default = _ctx(d, tp=2, ep=2, sequence_parallel=True)
        assert megatron_layer_bytes(given, moe=True) == megatron_layer_bytes(default, moe=True)
    assert megatron_layer_bytes(_ctx("allgather", tp=2, etp=2, ep=2, sequence_parallel=True),
                                moe=True) == 132_284_416


def _numel(ctx: RankContext, expert: bool) -> int:
    return sum(t.numel * t.count for t in ctx.tensors if t.is_expert == expert)


def test_expert_weights_split_by_etp_dense_by_tp() -> None:
    # 12 layers x E/ep = 2 experts per rank, fc1 + fc2 = 2·h·f = 2_097_152 each, ÷etp
    assert _numel(_ctx(**A), True) == 12 * 2 * 2 * H * F == 50_331_648
    assert _numel(_ctx(**B_), True) == 12 * 2 * 2 * H * F // 2 == 25_165_824
    assert _numel(_ctx(**DEFAULT), True) == 25_165_824
    # fc1 is column-parallel (its f rows split), fc2 row-parallel (its f columns split)
    rows = {t.name: t.rows for t in _ctx(**B_).tensors if t.is_expert}
    assert rows == {"experts.fc.weight": F // 2, "experts.proj.weight": H}
    # dense weights: split by tp whatever etp is
    assert _numel(_ctx(**A), False) == _numel(_ctx(**DEFAULT), False)
    # shared experts are built on the dense TP group (shared_experts.py tp_group=pg.tp)
    spec = GPT_MOE.model_copy(update={"num_shared_experts": 1,
                                      "shared_expert_intermediate_size": 1024})
    shared = {t.name: t.numel for t in _ctx(spec=spec, **A).tensors
              if t.name.startswith("shared_expert")}
    assert shared and all(n == H * 1024 // 2 for n in shared.values())


def test_expert_data_parallel_group() -> None:
    # world // (etp·ep·pp)
    assert _ctx(**A).parallel.expert_shard_degree == 8 // (1 * 4) == 2
    assert _ctx(**B_).parallel.expert_shard_degree == 8 // (2 * 4) == 1
    assert _ctx(tp=2, etp=1, ep=2, sequence_parallel=True).parallel.expert_shard_degree == 4
    assert _ctx(**DEFAULT).parallel.expert_shard_degree == 1
    assert _ctx(tp=2, etp=1, ep=2, pp=2, sequence_parallel=True
                ).parallel.expert_shard_degree == 8 // (1 * 2 * 2) == 2


def test_weights_grads_and_optimizer_of_the_expert_shard() -> None:
    # A holds 50_331_648 expert elements per rank, the default 25_165_824: 25_165_824 more
    # in bf16 weights (2 B), fp32 main gradients (4 B; Megatron's grad buffer is not
    # sharded) and, without the distributed optimizer, fp32 master + Adam's 2 moments (12 B)
    more = 25_165_824
    a, d = _ctx(**A), _ctx(**DEFAULT)
    assert weights_bytes(a) - weights_bytes(d) == 2 * more
    assert gradients_bytes(a) - gradients_bytes(d) == 4 * more
    assert optimizer_states_bytes(a) - optimizer_states_bytes(d) == 12 * more
    # the distributed optimizer shards expert states over the expert-dp group: A's 2 ranks
    # x 50_331_648 / 2 = the default's 1 rank x 25_165_824 (each expert element lives on
    # etp·edp = world/(ep·pp) ranks either way), dense states alike
    a1, d1 = _ctx(zero=1, **A), _ctx(zero=1, **DEFAULT)
    assert optimizer_states_bytes(a1) == optimizer_states_bytes(d1)
    assert optimizer_states_bytes(a) - optimizer_states_bytes(a1) > 12 * more // 2


def test_megatron_accepts_ep_across_tp_ranks() -> None:
    # tp 2, etp 1, ep 8 on 8 GPUs: etp·ep·pp = 8 divides the world (Megatron runs it), though
    # ep 8 does not divide dp = 4; with etp = tp it does not
    ctx = _ctx(tp=2, etp=1, ep=8, sequence_parallel=True)
    assert ctx.parallel.expert_shard_degree == 1 and _numel(ctx, True) == 12 * 2 * H * F
    with pytest.raises(InputError, match="must divide dp x cp"):
        _ctx(tp=2, ep=8, sequence_parallel=True)


@pytest.mark.parametrize(
    ("par", "fragment"),
    [
        ({"tp": 2, "etp": 4, "ep": 4, "sequence_parallel": True},
         "etp=4 x ep=4 must divide tp x cp x dp = 8"),
        ({"tp": 2, "etp": 1, "ep": 4}, "needs --sequence-parallel"),
        ({"tp": 2, "etp": 1, "ep": 4, "sequence_parallel": True, "fsdp": "full"}, "--fsdp"),
    ],
)
def test_layout_errors(par: dict, fragment: str) -> None:
    with pytest.raises(InputError, match=fragment):
        _ctx(**par)


def test_expert_ffn_must_split_evenly() -> None:
    spec = GPT_MOE.model_copy(update={"moe_intermediate_size": 2050})
    with pytest.raises(InputError, match="etp=4 does not divide the expert FFN width 2050"):
        _ctx(spec=spec, tp=2, etp=4, ep=2, sequence_parallel=True)
    with pytest.raises(InputError, match="dense"):
        _ctx(spec=GPT_SMALL, etp=1)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model", "mixtral-8x7b", "--etp", "2"], "--framework megatron"),
        (["--model", "llama2-7b", "--framework", "megatron", "--etp", "2"],
         "needs a mixture-of-experts model"),
        (["--model", "mixtral-8x7b", "--framework", "megatron", "--tp", "2", "--etp", "4",
          "--ep", "4", "--sequence-parallel"], "must divide"),
        (["--model", "mixtral-8x7b", "--framework", "megatron", "--etp", "0"],
         "--etp: Input should be greater than 0"),
    ],
)
def test_cli_errors_one_line_exit_2(args: list[str], fragment: str, capsys) -> None:
    assert main(["estimate", "--gpus", "8xH100", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err


def test_cli_strategy_shows_etp_only_when_given() -> None:
    base = ["estimate", "--model", "mixtral-8x7b", "--gpus", "8xH100", "--framework",
            "megatron", "--tp", "2", "--ep", "4", "--sequence-parallel", "--json"]
    runner = CliRunner()
    plain = json.loads(runner.invoke(app, base).stdout)
    given = json.loads(runner.invoke(app, [*base, "--etp", "1"]).stdout)
    assert "etp" not in plain["strategy"] and given["strategy"]["etp"] == 1


def test_dispatch_buffer_receives_the_expert_tp_gathered_rows() -> None:
    # comm.ep_dispatch_bytes: the b·s·k = 4096 permuted rows sent (bf16, h = 512), and the
    # rows the rank's experts receive, T·etp·k: A 2048·1, B 4096·2, the default 2048·2
    sent = 4096 * H * 2
    assert comm.ep_dispatch_bytes(_ctx(**A)) == sent + 2048 * H * 2 == 6_291_456
    assert comm.ep_dispatch_bytes(_ctx(**B_)) == sent + 8192 * H * 2 == 12_582_912
    assert comm.ep_dispatch_bytes(_ctx(**DEFAULT)) == sent + 4096 * H * 2 == 8_388_608


def test_plan_keeps_a_given_etp() -> None:
    # --etp is pinned, not searched: every ranked strategy carries it, and the estimate
    # command printed for it repeats it
    base, req, _ = prepare_plan({"model": "mixtral-8x7b", "gpus": "8xH200",
                                 "framework": "megatron", "etp": 1, "seq_len": 4096})
    result = search(base, req)
    assert result.entries
    for e in result.entries:
        assert e.report.strategy["etp"] == 1
        flags = strategy_flags(e.report.strategy)
        assert flags[flags.index("--etp") + 1] == "1"
