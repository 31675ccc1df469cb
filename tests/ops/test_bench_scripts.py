"""The benchmark scripts that remain beside ``tileops bench`` load and read the spec through the
library, on a machine without a GPU (what they time needs one)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tileops.ops import GemmFwdOp
from tileops.ops.cli import timing
from tileops.ops.workloads import cases_of

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    """Import ``benchmarks/<name>.py`` as the scripts run: their folder first on the path."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_script_{name}",
                                                      BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_the_gemm_rows_are_the_spec_workloads() -> None:
    gemm = _load("gemm")
    rows = gemm.workloads()
    assert [(r["label"], r["dtype"]) for r in rows] == [(c.label, c.dtype)
                                                        for c in cases_of(GemmFwdOp)]
    tt = next(r for r in rows if r["label"] == "square-4k-tt")
    assert (tt["m"], tt["n"], tt["k"], tt["trans_a"], tt["trans_b"]) == (4096, 4096, 4096,
                                                                        True, True)
    assert {r["dtype"] for r in gemm.workloads({"float16"})} == {"float16"}
    assert gemm.rotating is timing.rotating  # the harness's rotation, not a copy


def test_the_gemm_sweep_reads_shapes_with_layouts() -> None:
    """``--shapes MxNxK[:layout]``: the layout's letters are a's and b's (t: stored
    transposed); ``llama-step`` is the training step's products; bad items are refused."""
    import argparse

    sweep = _load("sweep_gemm")
    rows = sweep.shape_rows(sweep.parse_shapes("5x6x7, 8x9x10:tn ,3x3x3:nt,2x2x2:tt"))
    assert [(r["label"], r["m"], r["n"], r["k"], r["trans_a"], r["trans_b"]) for r in rows] == [
        ("grid-5x6x7", 5, 6, 7, False, False), ("grid-8x9x10-tn", 8, 9, 10, True, False),
        ("grid-3x3x3-nt", 3, 3, 3, False, True), ("grid-2x2x2-tt", 2, 2, 2, True, True)]
    step = sweep.parse_shapes("llama-step")
    assert len(step) == 9 and (128256, 4096, 1024, True, False) in step
    for bad, why in (("5x6", "is not MxNxK"), ("5x6x0", "is not MxNxK"),
                     ("5x6x7:tx", "must be nn, nt, tn or tt, got 'tx'")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            sweep.parse_shapes(bad)


def test_the_gemm_sweep_times_the_configurations_labelled() -> None:
    """``--configs`` names the configurations to time: the stream-K grid against the
    heuristic's persistent one (and cuBLAS); an unknown label is refused before any build."""
    sweep = _load("sweep_gemm")
    (w,) = sweep.shape_rows(sweep.parse_shapes("5001x1000x1000"))
    cands = sweep._candidates(w, False, {"128x256x64/st3sk"})
    assert [c.label() for c in cands] == ["128x256x64/st3p", "128x256x64/st3sk"]
    assert cands[1].stream_k and len(sweep._jobs([w], False, {"128x256x64/st3sk"})) == 2
    assert len(sweep._candidates(w)) > 2  # every candidate without labels
    with pytest.raises(SystemExit) as info:
        sweep.main(["--shapes", "5001x1000x1000", "--configs", "128x256x64/st3q"])
    assert info.value.code == 2  # argparse's refusal, before any build


def test_gemm_script_only_prebuilds(capsys: pytest.CaptureFixture[str]) -> None:
    gemm = _load("gemm")
    with pytest.raises(SystemExit) as info:
        gemm.main([])
    assert info.value.code == 2
    assert "the following arguments are required: --prebuild" in capsys.readouterr().err


def test_the_shared_timing_is_the_harness_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    common = _load("_common")
    monkeypatch.setattr(timing, "events_time", lambda fn, iters, trials=5: 2e-6)
    monkeypatch.setattr(timing, "graph_time", lambda fn, iters, trials=5: 3e-6)
    assert common.events(lambda: None, 10) == pytest.approx(2e-3)  # milliseconds
    assert common.graph_events(lambda: None, 10) == pytest.approx(3e-3)
    assert _load("norm").host_overhead.__doc__.startswith("Host microseconds per cached")


def test_the_moe_stages_script_runs_the_layer_s_own_stages(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    """``moe_stages.py --dry-run``: the fused layer's stages, each its delegate op on the
    stage before's tensors, give the layer's output exactly (the script exits 1 otherwise),
    and the table names every stage and the layer."""
    stages = _load("moe_stages")
    monkeypatch.setattr(sys, "argv", ["moe_stages.py", "--dry-run"])
    assert stages.main() == 0
    rows = [line.split("|")[2].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("| dry-run")]
    assert rows == ["route", "permute", "gate_up", "act", "down", "unpermute", "layer"]
