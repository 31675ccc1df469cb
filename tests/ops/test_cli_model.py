"""``tileops model``: in-process with click's CliRunner, the tiny CPU mode (the reference
target) of the decode benchmark with its table and the one line saying so where CUDA is
absent, the options each mode's benchmark gets, and the refusals (transformers missing, no checkout's benchmarks) with exit status 2."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from click.testing import CliRunner

from tileops.ops.cli import main
from tileops.ops.cli import model as model_cli

#: the runs need the transformers extra; its refusal does not
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers (tileops-ops[transformers])")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@needs_transformers
def test_llama_decode_without_cuda_runs_the_tiny_mode(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke("model", "llama", "--decode", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "no CUDA device: the tiny CPU mode, through the reference target"
    assert lines[1].startswith("# Llama greedy decode on ")
    assert "| tileops | " in result.stdout and "| eager | " in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama_decode-cpu.json",
                                                         "llama_decode-cpu.md"]
    assert result.stderr.startswith(f"== llama decode: benchmarks/llama.py --out {tmp_path} "
                                    f"--decode --dry-run --against eager\n")


@needs_transformers
def test_modes_and_exit_status(monkeypatch, tmp_path):
    """Both modes by default, each the benchmark's main with its options; the exit status is
    the worst of theirs."""
    calls = []

    class Bench:
        @staticmethod
        def main(argv):
            calls.append(argv)
            return 1 if "--decode" in argv else 0

    monkeypatch.setattr(model_cli, "_benchmark", lambda name: Bench)
    result = invoke("model", "llama", "--tiny", "--layers", "3", "--out", str(tmp_path))
    assert result.exit_code == 1
    base = ["--layers", "3", "--out", str(tmp_path)]
    assert calls == [[*base, "--dry-run", "--against", "eager", "--steps", "3", "--warmup", "1"],
                     [*base, "--decode", "--dry-run", "--against", "eager"]]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert invoke("model", "llama", "--train", "--out", str(tmp_path)).exit_code == 0
    assert calls == [["--out", str(tmp_path)]]  # on CUDA the benchmark's own full run


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    result = invoke("model", "llama", "--decode")
    assert result.exit_code == 2
    assert result.stderr == ("tileops model: transformers is not installed; install the extra: "
                             "pip install 'tileops-ops[transformers]'\n")


@needs_transformers
def test_without_the_checkouts_benchmarks(monkeypatch, tmp_path):
    monkeypatch.setattr(model_cli, "BENCHMARKS", tmp_path)
    result = invoke("model", "llama", "--tiny", "--train")
    assert result.exit_code == 2
    assert result.stderr == (f"tileops model: needs the source checkout's benchmarks "
                             f"({tmp_path / 'llama.py'} is not there): run it from a checkout "
                             f"installed with pip install -e\n")


def test_unknown_model_is_a_usage_error():
    result = invoke("model", "gpt2")
    assert result.exit_code == 2
    assert "Invalid value for 'MODEL': 'gpt2' is not 'llama'." in result.stderr
