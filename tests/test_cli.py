"""CLI behaviour: JSON numbers, layout, bad input -> one line and exit 2."""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vramcalc.cli import app, main

runner = CliRunner()


def run_json(*args: str) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_estimate_json_keys_and_types() -> None:
    doc = run_json("estimate", "--model", "llama3-8b", "--gpus", "H100", "--seq-len", "2048")
    assert doc["model"]["num_params"] == 8_030_261_248  # Llama-3-8B model card
    assert set(doc["terms"]) == {"weights", "gradients", "optimizer_states", "activations",
                                 "logits", "transients", "overhead"}
    assert all(isinstance(v, int) for v in doc["terms"].values())
    assert set(doc["phases"]) == {"forward", "backward", "optimizer"}
    assert doc["gpu"]["id"] == "h100_sxm"
    assert doc["strategy"]["seq_len"] == 2048
    assert isinstance(doc["fits"], bool)
    # no --headroom: all of the GPU's memory is usable
    assert doc["usable_bytes"] == doc["gpu"]["memory_total_bytes"]
    assert doc["free_bytes"] == doc["usable_bytes"] - doc["device_total_bytes"]


def test_estimate_says_which_model_an_alias_chose() -> None:
    doc = run_json("estimate", "--model", "70b", "--gpus", "8xH100", "--zero", "3")
    assert doc["model"]["name"] == "llama3-70b"
    assert "llama3-70b" in doc["model"]["note"]
    result = runner.invoke(app, ["estimate", "--model", "70b", "--gpus", "8xH100"])
    assert "70b resolved to llama3-70b" in result.stdout


def test_gpt2_fits_on_a_4090_and_405b_does_not() -> None:
    # GPT-2 small model states are 124M x 16 B = 2 GB: far below 24 GB
    small = run_json("estimate", "--model", "gpt2", "--gpus", "4090", "--seq-len", "1024")
    assert small["fits"] is True
    # 405B x 16 B/param of model states alone is 6.5 TB, far above one 80 GB card
    big = run_json("estimate", "--model", "405b", "--gpus", "H100")
    assert big["fits"] is False and big["free_bytes"] < 0


def test_a_table_that_does_not_fit_points_to_plan() -> None:
    # 405B x 16 B/param of model states alone is 6.5 TB against one 80 GB card
    args = ["--model", "405b", "--gpus", "H100", "--recompute", "full", "--framework", "hf",
            "--finetune", "lora", "--lora-targets", "all-linear", "--transformers-version",
            "4.46.0"]
    over = runner.invoke(app, ["estimate", *args], env={"COLUMNS": "80"})
    assert "DOES NOT FIT" in over.stdout
    # the plan of the same flags: folded to 80 columns with `\` continuations, it still
    # pastes as one command, and it runs
    text = over.stdout.split("try: ", 1)[1].split("\n  (it lists", 1)[0]
    assert max(len(t) for t in over.stdout.splitlines()) <= 80
    cmd = shlex.split(text.replace("\\\n", " "))
    pairs = sorted(zip(args[::2], args[1::2], strict=True))
    assert cmd[:2] == ["vramcalc", "plan"] and sorted(zip(cmd[2::2], cmd[3::2], strict=True)) == pairs
    assert runner.invoke(app, cmd[1:]).exit_code in (0, 1)
    fits = runner.invoke(app, ["estimate", "--model", "gpt2", "--gpus", "4090"])
    assert "FITS" in fits.stdout and "try:" not in fits.stdout


def test_a_trace_that_does_not_fit_points_to_plan() -> None:
    # GPT-2 small in fp32 at 64 x 1,024 tokens: the eager logits alone (64 x 1,024 x 50,257
    # x 4 B = 13.2 GB) leave a 16 GB T4 nothing for the rest
    args = ["--model", "gpt2", "--gpus", "1xT4", "--precision", "fp32", "--seq-len", "1024",
            "--micro-batch-size", "64"]
    over = runner.invoke(app, ["trace", *args], env={"COLUMNS": "200"})
    assert "DOES NOT FIT" in over.stdout
    cmd = shlex.split(over.stdout.split("try: ", 1)[1].split("\n", 1)[0])
    assert cmd[:2] == ["vramcalc", "plan"] and sorted(zip(cmd[2::2], cmd[3::2], strict=True)) == (
        sorted(zip(args[::2], args[1::2], strict=True)))


def test_table_layout() -> None:
    result = runner.invoke(app, ["estimate", "--model", "gpt2", "--gpus", "4090",
                                 "--seq-len", "1024"])
    out = result.stdout
    assert result.exit_code == 0
    for label in ("weights", "gradients", "optimizer states", "activations", "logits + loss",
                  "transients", "overhead", "peak allocated", "device total"):
        assert label in out
    assert "GB" in out and "GiB" in out
    assert "FITS" in out


def test_gpus_and_models_catalogs() -> None:
    gpus = run_json("gpus")["gpus"]
    ids = {g["id"] for g in gpus}
    assert {"h100_sxm", "a100_80gb", "rtx_4090", "ascend_910b2", "mi300x", "gaudi3"} <= ids
    models = {m["name"]: m for m in run_json("models")["models"]}
    assert models["gpt2"]["num_params"] == 124_439_808


def test_explain_substitutes_numbers() -> None:
    result = runner.invoke(app, ["explain", "--model", "gpt2", "--gpus", "4090",
                                 "--seq-len", "512"])
    assert result.exit_code == 0
    assert "124,439,808" in result.stdout
    assert "attn.q" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["estimate", "--model", "llama-9b"], "unknown model"),
        (["estimate", "--model", "8b", "--gpus", "H1000"], "unknown GPU"),
        (["estimate", "--model", "8b", "--precision", "bf17"], "did you mean"),
        (["estimate", "--model", "8b", "--seq-len", "0"], "--seq-len"),
        (["estimate", "--model", "8b", "--seq-len", "lots"], "--seq-len"),
        (["estimate", "--model", "8b", "--gpus", "8xH100", "--tp", "3"], "cannot be split"),
        (["estimate", "--model", "8b", "--gpus", "8xH100", "--tp", "8", "--dp", "2"],
         "does not match"),
        (["estimate", "--model", "gpt2", "--gpus", "8xH100", "--tp", "8"], "does not divide"),
        (["estimate", "--model", "8b", "--gpus", "3xH100", "--pp", "3"],
         "divisible"),
        (["estimate", "--model", "8b", "--gpus", "0xH100"], "0xH100"),
        (["estimate", "--model", "8b", "--precison", "bf16"], "No such option"),
        (["estimate", "--model", "/no/such/config.json"], "no such file"),
    ],
)
def test_bad_input_one_line_exit_2(args: list[str], fragment: str, capsys) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert fragment.lower() in err.lower()
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--seq-len", "-5"], "error: --seq-len: Input should be greater than 0 (got -5)"),
        (["--zero", "5"], "error: --zero: Input should be less than or equal to 3 (got 5)"),
        (["--dp", "0"], "error: --dp: Input should be greater than 0 (got 0)"),
    ],
)
def test_out_of_bounds_values_name_the_flag(args: list[str], line: str, capsys) -> None:
    """A bound the training or parallel config declares is reported in pydantic's words
    under the option's flag, with the value given."""
    assert main(["estimate", "--model", "8b", "--gpus", "8xH100", *args]) == 2
    assert capsys.readouterr().err == line + "\n"


def test_malformed_model_files(tmp_path, capsys) -> None:
    bad_json = tmp_path / "config.json"
    bad_json.write_text("{not json")
    bad_yaml = tmp_path / "m.yaml"
    bad_yaml.write_text("hidden_size: [1, 2\n")
    unknown = tmp_path / "u.yaml"
    unknown.write_text("hidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\n"
                       "intermediate_size: 128\nvocab_size: 100\nhiden: 3\n")
    for path in (bad_json, bad_yaml, unknown):
        assert main(["estimate", "--model", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_model_yaml_file_and_hf_dir(tmp_path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text("hidden_size: 64\nnum_hidden_layers: 2\nnum_attention_heads: 4\n"
                    "intermediate_size: 128\nvocab_size: 100\n")
    doc = run_json("estimate", "--model", str(spec), "--seq-len", "32")
    # 2 x 100 x 64 (embedding + head) + 2 layers x (4 x 64^2 + 3 x 64 x 128 + 2 x 64) + 64
    assert doc["model"]["num_params"] == 2 * 6400 + 2 * (4 * 4096 + 3 * 8192 + 128) + 64
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    doc2 = run_json("estimate", "--model", str(hf), "--seq-len", "32")
    assert doc2["model"]["num_params"] == doc["model"]["num_params"]


def test_python_dash_m_works() -> None:
    out = subprocess.run([sys.executable, "-m", "vramcalc", "models", "--json"],
                         capture_output=True, text=True, check=True)
    assert "llama3-70b" in out.stdout


def test_estimate_path_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from vramcalc.cli import main\n"
        "assert 'torch' not in sys.modules\n"
        "rc = main(['estimate', '--model', '70b', '--gpus', '8xH100', '--zero', '3', '--json'])\n"
        "rc2 = main(['explain', '--model', 'gpt2'])\n"
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "sys.exit(rc + rc2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_cli_imports_only_the_torch_engines_inside_functions() -> None:
    """The CLI, the rendering and the option table import at module top, except the
    commands that drive the torch engines (trace, probe, validate) and `max --plot`."""
    root = Path(__file__).resolve().parents[1] / "vramcalc"
    files = [*(root / "cli").glob("*.py"), *(root / "render").glob("*.py"),
             root / "options.py", root / "check.py"]
    lazy = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom):
                    lazy.append((path.name, node.module or ""))
                elif isinstance(node, ast.Import):
                    lazy += [(path.name, alias.name) for alias in node.names]
    engines = ("vramcalc.trace", "vramcalc.probe", "vramcalc.validate",
               "matplotlib")  # max --plot: the plot extra, loaded only for a file
    assert lazy and all(module.startswith(engines) for _, module in lazy), lazy


def test_commands_write_no_files(tmp_path: Path) -> None:
    """estimate, plan, size, gpus and models leave the home directory and the working
    directory as they found them: no cache, no record, unless a flag asks for one."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME",)}
    env.update(HOME=str(home), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for argv in (["estimate", "--model", "8b", "--gpus", "8xH100", "--json"],
                 ["plan", "--model", "8b", "--gpus", "8xH100", "--json"],
                 ["size", "--model", "8b", "--tokens", "1e9", "--gpu", "H100", "--json"],
                 ["gpus", "--json"], ["models", "--json"]):
        run = subprocess.run([sys.executable, "-m", "vramcalc", *argv], cwd=work, env=env,
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
    assert list(home.rglob("*")) == [] and list(work.rglob("*")) == []
