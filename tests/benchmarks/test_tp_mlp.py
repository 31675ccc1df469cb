"""benchmarks/tp_mlp.py in its tiny mode under ``torchrun --nproc-per-node 2`` (``--dry-run``:
gloo on the CPU, float32, the reference target): every contender runs on its ranks, matches
the one-device block, and rank 0 writes the table and the results files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with the gloo backend", allow_module_level=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_dry_run(tmp_path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_port()),
               str(ROOT / "benchmarks" / "tp_mlp.py"), "--dry-run", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    doc = json.loads((tmp_path / "tp_mlp-cpu.json").read_text())
    assert (doc["world"], doc["hidden"], doc["intermediate"], doc["tokens"]) == (2, 64, 176, 48)
    cells = {c["contender"]: c for c in doc["contenders"]}
    assert list(cells) == ["tileops", "torch", "tileops TP", "torch TP (DTensor)"]
    assert [c["gpus"] for c in cells.values()] == [1, 1, 2, 2]
    for c in cells.values():
        assert c["step_ms"] > 0 and c["input_grad_rel_err"] <= 1e-5, c
    assert cells["tileops"]["scaling_efficiency"] is None
    assert cells["tileops TP"]["scaling_efficiency"] == pytest.approx(
        cells["tileops"]["step_ms"] / (2 * cells["tileops TP"]["step_ms"]))
    table = (tmp_path / "tp_mlp-cpu.md").read_text()
    assert "| contender | ranks | step ms |" in table and table in result.stdout
    assert "MISMATCH" not in output


def test_a_bad_size_is_refused_by_name() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tp_mlp.py"),
                             "--tokens", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("error: --tokens must be positive, seen 0")
