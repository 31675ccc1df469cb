"""benchmarks/llama.py --decode (llama_decode.py) in its tiny mode (``--dry-run``: the CPU, the
reference target, a tiny float32 Llama): the contenders run, the tokens are eager's, the table
has its columns and is printed last, the results files are written; a prebuild job; the
refusals of bad options."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("llama"), importlib.import_module("llama_decode")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_decode_tiny_mode(bench, tmp_path, capsys):
    llama, _ = bench
    # torch.compile's contender is left out: on the CPU transformers does not compile the
    # static cache's step, so it would time the same eager generate again
    rc = llama.main(["--decode", "--dry-run", "--against", "tileops-eager-steps,eager",
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    path = tmp_path / "llama_decode-cpu.json"
    assert out.endswith(f"wrote {path}, {tmp_path / 'llama_decode-cpu.md'}\n")
    assert rc == 0
    doc = json.loads(path.read_text())
    assert (doc["device"], doc["layers"], doc["batch"], doc["prompt"], doc["new"]) == \
        ("cpu", 2, 2, 37, 6)
    cells = doc["contenders"]
    assert list(cells) == ["eager", "tileops", "tileops-eager-steps"]
    for cell in cells.values():
        assert cell["error"] is None and cell["steps"] == 6
        assert cell["decode_tokens_per_s"] > 0 and cell["prefill_s"] > 0
        assert cell["same_as_eager"] == 1.0 and len(cell["tokens"]) == 2
    assert cells["tileops"]["note"] is None  # no graph on the CPU, so no capture to fail
    assert list(doc["bars"]) == ["1.3x eager tokens/s"]
    header = "| contender | prefill s | decode tokens/s | vs eager | peak GiB | sequences = " \
             "eager's | note |"
    assert header in out and "| tileops | " in out
    assert "bars (tileops): 1.3x eager tokens/s" in out


def test_decode_prebuild_job(bench):
    _, decode = bench
    options = {"dry_run": True, "device": "cpu", "batch": 2, "prompt": 9, "seq": 12,
               "layers": 2, "seed": 0}
    assert decode._prebuild_one(("attention", options))[::2] == ("attention", "ok")


def test_decode_refuses_bad_options(bench, capsys):
    llama, _ = bench
    with pytest.raises(SystemExit):
        llama.main(["--decode", "--dry-run", "--against", "eager,vllm"])
    assert capsys.readouterr().err.endswith(
        "error: --against: unknown contender 'vllm'; valid: tileops-eager-steps, eager, "
        "torch.compile\n")
    with pytest.raises(SystemExit):
        llama.main(["--decode", "--dry-run", "--new", "3"])
    assert capsys.readouterr().err.endswith(
        "error: --new must be at least 4 (two steady decode steps after the first 2 tokens), "
        "got 3\n")
