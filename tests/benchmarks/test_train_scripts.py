"""The training benchmarks (benchmarks/train_norm.py, train_gemm.py, host_cost_grad.py) in
their tiny mode (``--dry-run``: the CPU, the reference target, shapes scaled down) end to end:
every contender runs, gradients are checked against float64, the tables have their columns,
the table is printed last and the results files are written. Beside it, what a GPU run relies
on that the CPU can check: the shapes chosen, the bars, a wrong gradient caught, the layouts of
the cuBLAS products.

Whether our op's cells run depends on the tree: an op whose spec entry has a ``backward:`` must
give gradients within tolerance; one without must be refused as forward-only (and the script's
exit status says so)."""

from __future__ import annotations

import importlib.util
import json
import sys
from importlib import import_module
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tileops.ops as ops
from tileops.ops.workloads import cases_of

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
NORM_OPS = ("RMSNormFwdOp", "LayerNormFwdOp", "FusedAddRMSNormFwdOp")
NORM_INPUTS = {"RMSNormFwdOp": ["x", "weight"], "LayerNormFwdOp": ["x", "weight", "bias"],
               "FusedAddRMSNormFwdOp": ["x", "residual", "weight"]}
LIGER = importlib.util.find_spec("liger_kernel") is not None


@pytest.fixture(scope="module")
def scripts():
    """The three scripts, imported as they run: their folder first on the path (train_gemm and
    host_cost_grad import train_norm, a sibling)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield SimpleNamespace(norm=import_module("train_norm"), gemm=import_module("train_gemm"),
                              host=import_module("host_cost_grad"))
    finally:
        sys.path.remove(str(BENCHMARKS))


def has_backward(name: str) -> bool:
    return getattr(ops, name)._signature.entry.backward is not None


def tables(md: str) -> list[list[list[str]]]:
    """Every Markdown table of ``md``: its rows (header first, the rule left out) as cells."""
    out: list[list[list[str]]] = []
    previous = False
    for line in md.splitlines():
        is_row = line.startswith("|")
        if is_row and not line.startswith("|---"):
            if not previous:
                out.append([])
            out[-1].append([c.strip() for c in line.strip("|").split("|")])
        previous = is_row
    return out


def check_ran(cell: dict, inputs: list[str]) -> None:
    assert cell["error"] is None, cell["error"]
    assert cell["time_s"] > 0 and cell["method"] == "wall clock"
    assert sorted(cell["grad_err"]) == sorted(inputs) and cell["grad_ok"] is True


def check_ours(cell: dict, name: str, inputs: list[str]) -> None:
    """Our op's cell: gradients within tolerance where it has a backward, else refused."""
    if has_backward(name):
        check_ran(cell, inputs)
    else:
        assert f"{name} is forward-only" in cell["error"]


def written(out: str, tmp_path: Path, stem: str) -> tuple[dict, str]:
    """The JSON and Markdown a run wrote, checking that its output ends with the table."""
    json_path, md_path = tmp_path / f"{stem}-cpu.json", tmp_path / f"{stem}-cpu.md"
    md = md_path.read_text()
    assert out == md + f"wrote {json_path}, {md_path}\n"
    return json.loads(json_path.read_text()), md


# --- train_norm.py ------------------------------------------------------------------------------


def test_train_norm_tiny_mode(scripts, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = scripts.norm.main(["--dry-run", "-w", "tiny-n7", "--compile-backend", "aot_eager",
                            "--out", str(tmp_path)])
    doc, md = written(capsys.readouterr().out, tmp_path, "train_norm")
    assert (doc["device"], doc["target"], doc["versions"]["torch"]) == ("cpu", "reference",
                                                                        torch.__version__)
    rows = doc["results"]
    assert [(r["op"], r["workload"], r["dtype"]) for r in rows] == [
        (op, "tiny-n7", dt) for op in NORM_OPS for dt in ("bfloat16", "float32")]
    for r in rows:
        inputs = NORM_INPUTS[r["op"]]
        factor = 7 if r["op"] == "FusedAddRMSNormFwdOp" else 5
        assert r["bytes"] == factor * 3 * 7 * (2 if r["dtype"] == "bfloat16" else 4)
        check_ours(r["contenders"]["tileops"], r["op"], inputs)
        check_ran(r["contenders"]["torch"], inputs)
        check_ran(r["contenders"]["torch.compile"], inputs)
        liger = r["contenders"]["liger"]
        if LIGER:
            assert liger["time_s"] or liger["error"]
        else:
            assert liger["note"].startswith("not run: liger_kernel.ops.")
        assert r["bar"] == "≥ 1.0× faster of torch.compile, liger" and not r["headline"]
    found = tables(md)
    assert len(found) == 3  # one per op
    head = ["workload", "dtype", "shape", "tileops", "TB/s", "torch", "TB/s", "torch.compile",
            "TB/s", "liger", "TB/s", "vs torch", "vs torch.compile", "vs liger", "vs best",
            "bar", "meets", "grad rel err (tileops / torch / torch.compile / liger)"]
    for table in found:
        assert table[0] == head
        assert [(row[0], row[1], row[2]) for row in table[1:]] == [
            ("tiny-n7", "bfloat16", "3×7"), ("tiny-n7", "float32", "3×7")]
        assert all(len(row) == len(head) for row in table[1:])
    assert rc == (0 if all(map(has_backward, NORM_OPS)) else 1)


def test_train_norm_shapes_are_the_family_grid(scripts) -> None:
    for name in NORM_OPS:
        cls = getattr(ops, name)
        full = scripts.norm.grid_cases(cls)
        labels = {c.label for c in full}
        # the grid's 14 rows, 7 of them in two dtypes; the entries' own rows are not in it
        assert len(full) == 21 and len(labels) == 14
        assert {"m1-n4096", "odd-n4097", "tiny-n7", "m32768-n16384"} <= labels
        assert not labels & {"no-weight", "wide-n65536", "batch-dims-fp32", "weight-only",
                             "inplace-m32768-n8192", "inplace-decode"}
        assert scripts.norm.headline_label(cls) == "m32768-n8192"
        small = scripts.norm.grid_cases(cls, 1 << 14, ["m32768-*"])
        assert [(c.label, c.dtype) for c in small] == [
            (c.label, c.dtype) for c in full if c.label.startswith("m32768-")]
        assert all(c.inputs[0].numel <= 1 << 14 for c in small)


def cells(scripts, **times) -> dict:
    """Contender cells that ran in the given seconds (a tuple ``(s, False)``: wrong grads)."""
    out = {}
    for name, t in times.items():
        c = scripts.norm.blank_cell()
        seconds, ok = t if isinstance(t, tuple) else (t, True)
        c.update(time_s=seconds, grad_ok=ok, grad_err={"x": 0.0})
        out[name.replace("_", ".")] = c
    return out


@pytest.mark.parametrize(("op", "headline", "times", "bar", "meets", "best"), [
    # RMSNorm's headline is judged by its bandwidth: 5 x 32768 x 8192 x 2 bytes = 2.68 GB
    ("RMSNormFwdOp", True, {"tileops": 2.684e9 / 3.9e12, "torch_compile": 1e-9},
     "≥ 3.8 TB/s", True, "torch.compile"),
    ("RMSNormFwdOp", True, {"tileops": 2.684e9 / 3.7e12}, "≥ 3.8 TB/s", False, None),
    # the other headlines: 1.2x the faster of torch.compile and Liger; torch eager sets no bar
    ("LayerNormFwdOp", True, {"tileops": 1.0, "torch": 0.5, "torch_compile": 1.25,
                              "liger": 1.3}, "≥ 1.2× faster of torch.compile, liger", True,
     "torch"),
    ("LayerNormFwdOp", True, {"tileops": 1.0, "torch_compile": 1.1, "liger": 1.3},
     "≥ 1.2× faster of torch.compile, liger", False, "torch.compile"),
    # every other row: at least as fast
    ("FusedAddRMSNormFwdOp", False, {"tileops": 1.0, "torch_compile": 0.99},
     "≥ 1.0× faster of torch.compile, liger", False, "torch.compile"),
    # a peer with wrong gradients is nobody's best and sets no bar
    ("FusedAddRMSNormFwdOp", False, {"tileops": 1.0, "torch_compile": 1.0,
                                     "liger": (0.5, False)},
     "≥ 1.0× faster of torch.compile, liger", True, "torch.compile"),
    # no peer of the bar timed: not judged
    ("LayerNormFwdOp", False, {"tileops": 1.0, "torch": 2.0}, "≥ 1.0× faster of "
     "torch.compile, liger", None, "torch"),
])
def test_train_norm_bars(scripts, op, headline, times, bar, meets, best) -> None:
    row = {"op": op, "headline": headline, "bytes": 5 * 32768 * 8192 * 2,
           "contenders": cells(scripts, **times)}
    scripts.norm.judge(row)
    assert (row["bar"], row["meets"], row["best_peer"]) == (bar, meets, best)


def test_train_norm_marks_a_wrong_gradient(scripts, monkeypatch: pytest.MonkeyPatch) -> None:
    real = scripts.norm.contender

    def contender(name, op, eps, args, cls_name):
        if name != "torch":
            return real(name, op, eps, args, cls_name)
        return (lambda x, w: F.rms_norm(x, [7], w, eps) * 1.01), None  # 1% off

    monkeypatch.setattr(scripts.norm, "contender", contender)
    (case,) = [c for c in cases_of(ops.RMSNormFwdOp, labels=["tiny-n7"]) if c.dtype == "float32"]
    args = SimpleNamespace(target="reference", against=["tileops", "torch"], iters=2,
                           compile_backend="aot_eager", compile_mode=None)
    row = scripts.norm.run_case(ops.RMSNormFwdOp, case, False, args, torch.device("cpu"))
    torch_cell = row["contenders"]["torch"]
    assert torch_cell["grad_ok"] is False and min(torch_cell["grad_err"].values()) > 5e-3
    assert row["best_peer"] is None  # the only peer is wrong
    table = tables("\n".join(scripts.norm.op_table("RMSNormFwdOp", [row], args.against)))[0]
    assert table[1][table[0].index("torch")].endswith(" ms ✗")


# --- train_gemm.py ------------------------------------------------------------------------------


def test_train_gemm_tiny_mode(scripts, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = scripts.gemm.main(["--dry-run", "-w", "square-4k*", "--out", str(tmp_path)])
    doc, md = written(capsys.readouterr().out, tmp_path, "train_gemm")
    rows = doc["results"]
    assert [(r["workload"], r["dtype"]) for r in rows] == [
        ("square-4k", "bfloat16"), ("square-4k", "float16"), ("square-4k-tn", "bfloat16"),
        ("square-4k-tt", "bfloat16")]
    bwd_op = hasattr(ops, "GemmBwdOp")
    for r in rows:
        mnk = r["m"] * r["n"] * r["k"]
        assert r["flops"] == {"tileops": 6 * mnk, "torch": 6 * mnk, "tileops bwd": 4 * mnk,
                              "cuBLAS bwd": 4 * mnk}
        check_ours(r["contenders"]["tileops"], "GemmFwdOp", ["a", "b"])
        check_ran(r["contenders"]["torch"], ["a", "b"])
        check_ran(r["contenders"]["cuBLAS bwd"], ["a", "b"])
        if bwd_op:
            check_ran(r["contenders"]["tileops bwd"], ["a", "b"])
        else:
            assert r["contenders"]["tileops bwd"]["note"] == "not run: tileops.ops has no GemmBwdOp"
    (table,) = tables(md)
    assert table[0] == ["workload", "dtype", "M×N×K", "trans", "tileops", "TFLOP/s", "torch",
                        "TFLOP/s", "vs torch", "tileops bwd", "TFLOP/s", "cuBLAS bwd",
                        "TFLOP/s", "vs cuBLAS bwd",
                        "grad rel err (tileops / torch / tileops bwd / cuBLAS bwd)"]
    assert [row[3] for row in table[1:]] == ["NN", "NN", "TN", "TT"]
    assert all(len(row) == len(table[0]) and row[2].endswith(" *") for row in table[1:])
    ours_ok = has_backward("GemmFwdOp") and bwd_op
    assert rc == (0 if ours_ok else 1)


def test_train_gemm_shapes(scripts) -> None:
    labels = {c.label for c in scripts.gemm.training_cases()}
    assert {"square-8k", "qo-m2048", "lmhead-m8192", "linear-weight-nt-m2048",
            "square-4k-tt"} <= labels
    assert not labels & {"qo-m128", "linear-weight-nt-m1", "odd-1000", "unaligned-4097"}
    # scaling rows down does not change which workloads are chosen
    assert [(c.label, c.dtype) for c in scripts.gemm.training_cases(1 << 14)] == [
        (c.label, c.dtype) for c in scripts.gemm.training_cases()]
    assert scripts.gemm.headline_label() == "square-8k"


@pytest.mark.parametrize(("ta", "tb"), [(False, False), (False, True), (True, False),
                                        (True, True)])
def test_cublas_backward_is_the_gradient_in_the_stored_layout(scripts, ta, tb) -> None:
    m, n, k = 5, 3, 4
    g = torch.Generator().manual_seed(0)
    a = torch.randn((k, m) if ta else (m, k), dtype=torch.float64, generator=g)
    b = torch.randn((n, k) if tb else (k, n), dtype=torch.float64, generator=g)
    dc = torch.randn(m, n, dtype=torch.float64, generator=g)
    da, db = scripts.gemm.cublas_bwd(ta, tb)(dc, a, b)
    ref_a, ref_b = scripts.gemm.reference_grads(a, b, dc, ta, tb)
    assert da.shape == a.shape and db.shape == b.shape
    assert da.is_contiguous() and db.is_contiguous()
    torch.testing.assert_close(da, ref_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(db, ref_b, rtol=1e-12, atol=1e-12)


# --- host_cost_grad.py --------------------------------------------------------------------------


def test_host_cost_tiny_mode(scripts, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = scripts.host.main(["--dry-run", "--calls", "5", "--out", str(tmp_path)])
    doc, md = written(capsys.readouterr().out, tmp_path, "host_cost_grad")
    assert [len(doc["processes"][t]) for t in ("now", "before")] == [1, 0]
    assert doc["before"] is None
    (table,) = tables(md)
    assert table[0] == ["setting", "tileops µs", "F.rms_norm µs", "tileops − F.rms_norm", "bar",
                        "meets"]
    assert [row[0] for row in table[1:]] == list(scripts.host.SETTINGS)
    assert [row[-2:] for row in table[1:]] == [["≤ before", "-"], ["≤ grad off + 5 µs", "yes"
                                               if doc["bars"]["grad on, forward"]["meets"]
                                               else "NO"], ["-", "-"]]
    now = doc["now"]
    assert all(isinstance(now["F.rms_norm"][s], float) for s in scripts.host.SETTINGS)
    assert isinstance(now["tileops"]["grad off"], float)
    for s in scripts.host.SETTINGS[1:]:
        if has_backward("RMSNormFwdOp"):
            assert isinstance(now["tileops"][s], float)
        else:
            assert "RMSNormFwdOp is forward-only" in now["tileops"][s]
    missed = doc["bars"]["grad on, forward"]["meets"] is False
    assert rc == (1 if missed or not has_backward("RMSNormFwdOp") else 0)
    # with a before tree (its figures here: this run's own), two more columns and a line
    with_before = {**doc, "before": now, "bars": scripts.host.judge(now, now),
                   "processes": {"now": doc["processes"]["now"],
                                 "before": doc["processes"]["now"]}}
    md = scripts.host.markdown({**doc, "before": "/elsewhere"}, with_before)
    (table,) = tables(md)
    assert table[0][4:6] == ["before: tileops µs", "before: F.rms_norm µs"]
    assert table[1][4] == table[1][1] and table[1][-1] == "yes"  # as fast as itself
    assert "Grad off, tileops, per process of the before tree: " in md


@pytest.mark.parametrize(("now", "before", "meets"), [
    ({"grad off": 10.0, "grad on, forward": 14.9}, {"grad off": 10.0}, [True, True]),
    ({"grad off": 10.1, "grad on, forward": 15.2}, {"grad off": 10.0}, [False, False]),
    ({"grad off": 10.0, "grad on, forward": "RuntimeError: x"}, None, [None, False]),
])
def test_host_cost_bars(scripts, now, before, meets) -> None:
    full = {"tileops": {**now, "grad on, forward + backward": 1.0}, "F.rms_norm": {}}
    prev = None if before is None else {"tileops": before, "F.rms_norm": {}}
    bars = scripts.host.judge(full, prev)
    assert [bars[s]["meets"] for s in scripts.host.SETTINGS] == [*meets, None]


def test_host_cost_before_must_be_a_checkout(scripts, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--before .*: no packages/\*/src in it"):
        scripts.host.tree_paths(tmp_path)


# --- the prebuild workers (what --prebuild runs in each spawned process) ------------------------


def test_prebuild_workers_call_every_contender_once(scripts) -> None:
    (case,) = [c for c in cases_of(ops.RMSNormFwdOp, labels=["tiny-n7"]) if c.dtype == "float32"]
    label, secs, status = scripts.norm._prebuild_one(("RMSNormFwdOp", case, "cpu", "reference"))
    assert label == "RMSNormFwdOp tiny-n7 float32" and secs >= 0
    if has_backward("RMSNormFwdOp"):
        assert status == "ok"
    else:
        assert status.startswith("RuntimeError: RMSNormFwdOp is forward-only")
    (case,) = scripts.gemm.training_cases(1 << 10, ["square-4k-tt"])
    label, _, status = scripts.gemm._prebuild_one((case, "cpu", "reference"))
    assert label == "square-4k-tt bfloat16"
    if has_backward("GemmFwdOp"):
        assert status == "ok"
    else:
        assert status.startswith("RuntimeError: GemmFwdOp is forward-only")
