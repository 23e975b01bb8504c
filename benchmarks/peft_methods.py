"""Every PEFT method of PEFT's MetaMathQA benchmark, traced with `--peft-config`.

    python benchmarks/peft_methods.py --peft-repo PATH [--markdown] [--only NAME ...]

PATH is a checkout of huggingface/peft. Each `method_comparison/MetaMathQA/results/*.json`
records one run: its PEFT config (`run_info.peft_config`) and the memory it reached
(`train_info.accelerator_memory_max`: `torch.cuda.max_memory_reserved()` at the end less the
reading right after the model was made, which is about zero), on one L40S with
meta-llama/Llama-3.2-3B in bf16, batches of 4 sequences of up to 768 tokens, AdamW, no
gradient checkpointing (default_training_params.json). This script writes each config to a
file and runs vramcalc's trace engine with PEFT's own `get_peft_model` on that config
(`vramcalc trace --peft-config FILE`, the flags below), then compares the trace's reserved
peak with the recorded figure. Nothing is fitted; an experiment that overrides the default
training parameters (its `training_params.json`) is traced with the defaults all the same.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from calibration import _PEFT_MC

from vramcalc.errors import InputError
from vramcalc.options import build_scenario
from vramcalc.trace.engine import trace

GB = 10**9
RESULTS = "method_comparison/MetaMathQA/results"
FLAGS = {**_PEFT_MC, "micro_batch_size": 4}  # the calibrated PEFT rows' settings


def _why(message: str) -> str:
    """The trace's refusal, short: what stopped it."""
    op = re.search(r"\((aten\.[\w.]+)\)", message)
    if op:
        return f"not traced: shapes from tensor values ({op.group(1)})"
    if "fake tensors" in message:
        return "not traced: checks tensor values"
    return "not traced: " + message.rsplit(": ", 1)[-1]


def rows(repo: Path, only: list[str]) -> list[tuple[str, str, float, float | None, str]]:
    """(experiment, peft_type, recorded GB, traced GB or None, remark) per result file."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted((repo / RESULTS).glob("*.json")):
            name = path.stem
            if only and name not in only:
                continue
            doc = json.loads(path.read_text(encoding="utf-8"))
            cfg = doc["run_info"].get("peft_config")
            recorded = doc["train_info"]["accelerator_memory_max"] / GB
            if not cfg:  # full fine-tuning: the calibration set's record
                continue
            cfg_file = Path(tmp) / f"{name}.json"
            cfg_file.write_text(json.dumps(cfg), encoding="utf-8")
            start = time.perf_counter()
            try:
                res = trace(build_scenario({**FLAGS, "framework": "hf",
                                            "peft_config": str(cfg_file)}))
            except InputError as err:
                out.append((name, cfg["peft_type"], recorded, None, _why(str(err))))
                continue
            took = f"{time.perf_counter() - start:.0f} s"
            out.append((name, cfg["peft_type"], recorded,
                        res.report.peak_reserved_bytes / GB, took))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peft-repo", type=Path, required=True)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--only", nargs="*", default=[])
    args = ap.parse_args()
    if not (args.peft_repo / RESULTS).is_dir():
        print(f"error: {args.peft_repo} has no {RESULTS}", file=sys.stderr)
        return 2
    table = rows(args.peft_repo, args.only)
    errors = []
    if args.markdown:
        print("| experiment | PEFT method | recorded GB | trace GB | error |")
        print("|---|---|---|---|---|")
    for name, kind, rec, got, remark in table:
        if got is None:
            line = (f"| {name} | {kind} | {rec:.2f} | – | {remark} |" if args.markdown
                    else f"{name:58s} {kind:16s} {rec:7.2f}       -  {remark}")
        else:
            err = got / rec - 1
            errors.append(abs(err))
            line = (f"| {name} | {kind} | {rec:.2f} | {got:.2f} | {err:+.1%} |" if args.markdown
                    else f"{name:58s} {kind:16s} {rec:7.2f} {got:7.2f} {err:+7.1%}  {remark}")
        print(line)
    if errors:
        print(f"\n{len(errors)} traced of {len(table)}; median |error| "
              f"{statistics.median(errors):.1%}, max {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
