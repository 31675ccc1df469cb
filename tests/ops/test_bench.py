"""``tileops bench``: the harness (contenders, the compiled contender, L2 rotation, timing) and
what it writes (JSON schema, Markdown, plot), on the CPU.

The harness is called directly where a test needs to see inside it (a counting torch.compile
backend, contenders that record their inputs); the command through click's CliRunner on tiny
workloads otherwise. Only ``torch`` and stub contenders run here except in one CLI test, so
no test waits on Inductor.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from tileops.ops import GemmFwdOp, LayerNormFwdOp, RMSNormFwdOp
from tileops.ops.cli import main
from tileops.ops.cli.bench import COMPILED, Settings, bench_case, cold_l2, fresh_compile
from tileops.ops.cli.report import (
    SCHEMA,
    ContenderResult,
    geomean,
    markdown,
    require_matplotlib,
    speedups,
)
from tileops.ops.cli.runner import CaseResult, run_case
from tileops.ops.cli.timing import MAX_SETS, Peaks, device_time, input_sets, rotating
from tileops.ops.workloads import cases_of, make_inputs

CPU = torch.device("cpu")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _declare(monkeypatch: pytest.MonkeyPatch, make, cls=RMSNormFwdOp) -> None:
    """Make ``cls`` declare ``make(op)`` as its contenders."""
    monkeypatch.setattr(cls, "contenders", make)


def _tiny(cls=RMSNormFwdOp, label="tiny-n7", dtype="float32"):
    (case,) = cases_of(cls, labels=[label], dtypes=[dtype])
    return case


def _ran(case, cls=RMSNormFwdOp):
    return run_case(cls, case, CPU, timed=False)


def _rms_torch(op):
    return lambda x, w: F.rms_norm(x, list(op.normalized_shape), w, op.eps)


# --- the harness ------------------------------------------------------------------------------


def test_the_compiled_contender_is_fresh_per_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    _declare(monkeypatch, lambda op: {"torch": _rms_torch(op)})
    compiled: list[tuple] = []

    def counting(gm, example_inputs):
        compiled.append(tuple(tuple(t.shape) for t in example_inputs
                              if isinstance(t, torch.Tensor)))
        return gm.forward

    settings = Settings(against=(COMPILED,), iters=2, compile_backend=counting)
    case = _tiny()
    ran = _ran(case)
    for _ in range(2):  # the same shapes twice: a reused function would compile once
        rows = bench_case(case, ran, CPU, settings)
        assert rows[COMPILED].error is None and rows[COMPILED].rel_err < 1e-5
    other = _tiny(label="m1-n4096", dtype="bfloat16")
    bench_case(other, _ran(other), CPU, settings)
    assert compiled == [((3, 7), (7,)), ((3, 7), (7,)), ((1, 4096), (4096,))]


def test_fresh_compile_forgets_earlier_compiles() -> None:
    count = [0]

    def counting(gm, example_inputs):
        count[0] += 1
        return gm.forward

    def f(x):
        return x * 2 + 1

    x = torch.randn(3)
    fresh_compile(f, backend=counting)(x)
    fresh_compile(f, backend=counting)(x)
    assert count[0] == 2


def test_every_declared_contender_and_the_compiled_one_by_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _declare(monkeypatch, lambda op: {"torch": _rms_torch(op),
                                      "peer": lambda x, w: F.rms_norm(x, [7], w) + 1})
    settings = Settings(iters=2, compile_backend="eager")
    case = _tiny()
    ran = _ran(case)
    rows = bench_case(case, ran, CPU, settings)
    assert list(rows) == ["torch", "peer", COMPILED]
    assert rows["torch"].rel_err < 1e-5 and rows["peer"].rel_err > 0.1  # checked, not hidden
    for row in rows.values():
        assert row.error is None and row.time_s > 0 and row.method == "wall clock"
        assert row.first_call_s > 0 and row.eager_s is None  # eager times are CUDA's
    timing = ran.result.extra["timing"]
    assert ran.result.time_s == timing.time_s > 0 and timing.method == "wall clock"
    assert ran.result.extra["l2"] == "warm" and ran.result.extra["sets"] == 1


def test_a_contender_that_is_missing_or_fails_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(x, w):
        raise RuntimeError("no kernel for this shape\nmore detail")

    _declare(monkeypatch, lambda op: {"broken": broken})
    case = _tiny()
    rows = bench_case(case, _ran(case), CPU, Settings(against=("broken", "liger", COMPILED),
                                                      iters=2))
    assert rows["broken"].error == "RuntimeError: no kernel for this shape"
    assert rows["liger"].error == "RMSNormFwdOp has no contender 'liger' here (it declares broken)"
    assert rows[COMPILED].error == "RMSNormFwdOp declares no torch equivalent to compile"
    assert all(r.time_s is None for r in rows.values())


def test_cold_l2_rotates_input_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[float] = set()

    def recording(x, w):
        seen.add(x[0, 0].item())  # each set is drawn from its own seed
        return F.rms_norm(x, [7], w)

    _declare(monkeypatch, lambda op: {"rec": recording})
    case = _tiny()
    ran = _ran(case)
    bench_case(case, ran, CPU, Settings(against=("rec",), l2="cold", iters=2))
    assert ran.result.extra["sets"] == MAX_SETS and ran.result.extra["l2"] == "cold"
    assert len(seen) == MAX_SETS
    seen.clear()
    bench_case(case, ran, CPU, Settings(against=("rec",), l2="warm", iters=2))
    assert len(seen) == 1


def test_the_l2_policy_by_family() -> None:
    assert cold_l2(GemmFwdOp, "auto") and not cold_l2(RMSNormFwdOp, "auto")
    assert cold_l2(RMSNormFwdOp, "cold") and not cold_l2(GemmFwdOp, "warm")


def test_input_sets_span_the_rotation_bytes() -> None:
    case = _tiny(label="m2048-n4096", dtype="float32")  # 2048 x 4096 x 4 B = 32 MiB + 16 kB
    first = make_inputs(case, CPU)
    sets = input_sets(case, CPU, first, span=100 << 20)
    assert len(sets) == 4 and sets[0] == first
    assert not torch.equal(sets[1][0], sets[0][0])  # other seeds, other values
    assert len(input_sets(case, CPU, first, span=1)) == 1
    assert len(input_sets(_tiny(), CPU, make_inputs(_tiny(), CPU))) == MAX_SETS


def test_rotating_takes_turns() -> None:
    calls: list[int] = []
    call = rotating([[1], [2], [3]], calls.append)
    for _ in range(7):
        call()
    assert calls == [1, 2, 3, 1, 2, 3, 1]


def test_device_time_on_the_cpu_is_wall_time() -> None:
    t = device_time(lambda: None, CPU, iters=3)
    assert t.method == "wall clock" and t.note is None and 0 < t.seconds < 0.01


def test_a_short_graph_is_timed_again_with_enough_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 calls of a microsecond are a few times the replay's own cost: such a call is timed
    again over as many calls as fill MIN_GRAPH_S (at most MAX_GRAPH_CALLS); a long one once."""
    import contextlib

    from tileops.ops.cli import timing

    seen = []

    def fake(per_call):
        def graph_time(fn, iters, trials=5):
            seen.append(iters)
            return per_call * (1.0 if iters == 20 else 0.9)
        return graph_time

    monkeypatch.setattr(timing.torch.cuda, "device", lambda d: contextlib.nullcontext())
    cuda = torch.device("cuda")
    monkeypatch.setattr(timing, "graph_time", fake(1e-6))
    t = device_time(lambda: None, cuda, iters=20)
    assert seen == [20, 200] and t.seconds == pytest.approx(0.9e-6) and t.method == "cuda graph"
    seen.clear()
    monkeypatch.setattr(timing, "graph_time", fake(1e-8))
    device_time(lambda: None, cuda, iters=20)
    assert seen == [20, timing.MAX_GRAPH_CALLS]
    seen.clear()
    monkeypatch.setattr(timing, "graph_time", fake(20e-6))
    assert device_time(lambda: None, cuda, iters=20).seconds == pytest.approx(20e-6)
    assert seen == [20]


@pytest.mark.cuda
def test_a_contender_that_cannot_be_captured_falls_back_to_events() -> None:
    dev = torch.device("cuda")
    x = torch.randn(1024, device=dev)

    def syncs():
        x.mul_(1.0)
        torch.cuda.synchronize()  # not allowed while a CUDA graph is captured

    t = device_time(syncs, dev, iters=5)
    assert t.method == "cuda events" and "CUDA graph capture failed" in t.note
    assert device_time(lambda: x.mul_(1.0), dev, iters=5).method == "cuda graph"


# --- the report -------------------------------------------------------------------------------


def _row(label: str, time_s: float | None, **contenders: float | None) -> CaseResult:
    r = CaseResult("RMSNormFwdOp", label, "bfloat16", (4, 8), {}, {"x": (4, 8), "weight": (8,)},
                   target="tileops", rel_err=1e-3, tol=1e-2, checked=True, time_s=time_s,
                   flops=160, bytes=144)
    r.extra["contenders"] = {n: ContenderResult(time_s=t, method="cuda graph", rel_err=2e-3)
                             for n, t in contenders.items()}
    return r


def test_speedups_and_their_geometric_mean() -> None:
    rows = [_row("a", 1.0, torch=2.0), _row("b", 2.0, torch=1.0), _row("c", None, torch=1.0),
            _row("d", 1.0, torch=None)]
    assert [(r.workload, s) for r, s in speedups(rows, "torch")] == [("a", 2.0), ("b", 0.5)]
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert geomean([4.0, 1.0]) == pytest.approx(2.0)


def test_contender_result_as_dict() -> None:
    d = ContenderResult(time_s=2.0, rel_err=math.inf).as_dict(flops=4e12, nbytes=8e9)
    assert d["gbps"] == 4.0 and d["tflops"] == 2.0 and d["rel_err"] == "inf"
    assert ContenderResult(error="x").as_dict(1, 1)["gbps"] is None


def test_markdown_has_a_section_and_a_summary_per_op() -> None:
    header = {"device": "cuda:0", "gpu": "NVIDIA H200", "when": "2026-12-01 10:00 UTC",
              "tileops": "0.1.0", "versions": {"torch": "2.11.0", "triton": "3.5.0",
                                               "liger-kernel": None},
              "max_elements": None,
              "timing": {"method": "CUDA graph replay", "compile": {"mode": None}}}
    rows = [_row("a", 1e-6, torch=2e-6, liger=4e-6), _row("b", 2e-6, torch=1e-6)]
    lay = _row("c", 1e-6, torch=3e-6)
    lay.op = "LayerNormFwdOp"
    rows[1].extra["contenders"]["liger"] = ContenderResult(error="Liger refuses rows over 64k")
    md = markdown(header, [*rows, lay], Peaks(3e12, 1e15, "measured"))
    assert md.startswith("# tileops bench on NVIDIA H200 (2026-12-01 10:00 UTC)\n")
    assert "tileops 0.1.0; torch 2.11.0, triton 3.5.0." in md  # absent libraries left out
    assert "## RMSNormFwdOp" in md and "## LayerNormFwdOp" in md
    assert ("geometric mean: torch 1.000× over 2 (lowest 0.500×, b bfloat16); liger 4.000× "
            "over 1 (lowest 4.000×, a bfloat16).") in md
    assert ("| workload | dtype | inputs | tileops | achieved | roofline | torch | achieved | "
            "liger | achieved | vs best other | rel err (tileops / torch / liger) |") in md
    assert "| a | bfloat16 | 4×8 8 | 1.0 µs | 144 MB/s | 0% | 2.0 µs | 72 MB/s | 4.0 µs |" in md
    assert "| b | bfloat16 | 4×8 8 | 2.0 µs | 72 MB/s | 0% | 1.0 µs | 144 MB/s | error | - | " \
           "0.50× |" in md
    assert "- b bfloat16 liger: Liger refuses rows over 64k" in md


def test_a_contender_the_workload_does_not_declare_is_a_dash_not_an_error() -> None:
    header = {"device": "cuda:0", "gpu": None, "when": "2026-12-01 10:00 UTC",
              "tileops": "0.1.0", "versions": {}, "max_elements": None,
              "timing": {"method": "CUDA graph replay", "compile": {"mode": None}}}
    # a peer declared for the first workload's op only (say, none for an in-place call)
    rows = [_row("a", 1e-6, torch=2e-6, liger=4e-6), _row("inplace", 2e-6, torch=4e-6)]
    md = markdown(header, rows, Peaks(3e12, 1e15, "measured"))
    assert ("| inplace | bfloat16 | 4×8 8 | 2.0 µs | 72 MB/s | 0% | 4.0 µs | 36 MB/s | - | - "
            "| 2.00× | 1.0e-03 / 2.0e-03 / - |") in md
    assert ("- inplace bfloat16 liger: not a contender here (the workload's op does not "
            "declare it, e.g. a peer without an in-place form)") in md
    assert "error" not in md


def test_a_contender_off_the_reference_is_noted() -> None:
    header = {"device": "cuda:0", "gpu": None, "when": "2026-12-01 10:00 UTC",
              "tileops": "0.1.0", "versions": {}, "max_elements": None,
              "timing": {"method": "CUDA graph replay", "compile": {"mode": None}}}
    rows = [_row("decode", 1e-6, torch=2e-6, liger=4e-6)]
    rows[0].extra["contenders"]["liger"].rel_err = 0.55  # tol 1e-2
    md = markdown(header, rows, Peaks(3e12, 1e15, "measured"))
    assert ("- decode bfloat16 liger: its result is off the float64 reference (rel err 5.5e-01 "
            "against the op's tolerance 1.0e-02); its time still counts as a contender's") in md
    assert "torch: its result is off" not in md


# --- the command ------------------------------------------------------------------------------


def test_bench_json_schema(tmp_path: Path) -> None:
    result = invoke("bench", "RMSNormFwdOp", "LayerNormFwdOp", "--device", "cpu", "-w", "tiny-n7",
                    "-w", "no-affine", "--dtype", "fp32", "--against", "eager", "--repeat", "2",
                    "--max-elements", "4096", "--out", str(tmp_path), "--no-plot")
    assert result.exit_code == 0, result.output
    assert "wrote " + str(tmp_path / "bench-cpu.json") in result.output
    assert not (tmp_path / "bench-cpu.png").exists()
    doc = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert doc["schema"] == SCHEMA and doc["ops"] == ["RMSNormFwdOp", "LayerNormFwdOp"]
    assert doc["device"] == "cpu" and doc["against"] == ["torch"] and doc["tuned"] is False
    assert doc["versions"]["torch"] == torch.__version__ and "tilelang" in doc["versions"]
    assert doc["timing"]["l2"] == {"RMSNormFwdOp": "warm", "LayerNormFwdOp": "warm"}
    assert doc["timing"]["compile"]["fresh_per_workload"] is True
    assert {(r["op"], r["workload"], r["dtype"]) for r in doc["results"]} == {
        ("RMSNormFwdOp", "tiny-n7", "float32"), ("LayerNormFwdOp", "tiny-n7", "float32"),
        ("LayerNormFwdOp", "no-affine", "float32")}
    for r in doc["results"]:
        assert r["ok"] and r["target"] == "reference" and r["l2"] == "warm" and r["sets"] == 1
        assert r["time_s"] == r["timing"]["time_s"] > 0 and r["timing"]["method"] == "wall clock"
        assert set(r["contenders"]) == {"torch"}
        c = r["contenders"]["torch"]
        assert set(c) == {"time_s", "method", "eager_s", "first_call_s", "rel_err", "note",
                          "error", "gbps", "tflops"}
        assert c["error"] is None and c["rel_err"] < 1e-5 and c["gbps"] > 0
    no_affine = next(r for r in doc["results"] if r["workload"] == "no-affine")
    assert no_affine["inputs"] == {"x": [1, 4096], "weight": None, "bias": None}
    assert no_affine["scaled"] == {"B": [[2048], [1]]}
    md = (tmp_path / "bench-cpu.md").read_text()
    assert "## RMSNormFwdOp" in md and "## LayerNormFwdOp" in md and "`*`: scaled down" in md


def test_bench_names_its_files(tmp_path: Path) -> None:
    result = invoke("bench", "LayerNormFwdOp", "--device", "cpu", "-w", "tiny-n7", "--dtype",
                    "fp32", "--against", "torch", "--repeat", "1", "--out", str(tmp_path),
                    "--name", "norms", "--no-plot")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["norms-cpu.json", "norms-cpu.md"]


def test_bench_filters_like_run() -> None:
    result = invoke("bench", "RMSNormFwdOp", "--device", "cpu", "-w", "nope", "--no-plot")
    assert result.exit_code == 2 and "no workload matches nope; labels: " in result.output
    result = invoke("bench", "RMSNormFwdOp", "--device", "cpu", "--dtype", "int8", "--no-plot")
    assert result.exit_code == 2
    assert "RMSNormFwdOp accepts no int8; its dtypes: float16, bfloat16, float32" in result.output


def test_bench_without_matplotlib_says_which_extra(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    assert "pip install 'tileops-ops[plot]'" in require_matplotlib()
    result = invoke("bench", "RMSNormFwdOp", "--device", "cpu", "--out", str(tmp_path))
    assert result.exit_code == 1
    assert ("tileops bench draws its PNG plot with matplotlib, which is not installed; install "
            "it with the plot extra (pip install 'tileops-ops[plot]') or pass --no-plot"
            in result.output)
    assert list(tmp_path.iterdir()) == []  # nothing ran
    result = invoke("bench", "RMSNormFwdOp", "--device", "cpu", "-w", "tiny-n7", "--dtype",
                    "fp32", "--against", "torch", "--repeat", "1", "--out", str(tmp_path),
                    "--no-plot")
    assert result.exit_code == 0, result.output


def test_bench_exits_nonzero_when_the_op_fails(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    right = LayerNormFwdOp.reference

    def broken(op, call, *xs):  # the float64 reference works; the served call does not
        if xs[0].dtype != torch.float64:
            raise RuntimeError("kernel exploded")
        return right(op, call, *xs)

    monkeypatch.setattr(LayerNormFwdOp, "reference", broken)
    result = invoke("bench", "LayerNormFwdOp", "--device", "cpu", "--target", "reference", "-w",
                    "tiny-n7", "--dtype", "fp32", "--against", "torch", "--repeat", "1",
                    "--out", str(tmp_path), "--no-plot")
    assert result.exit_code == 1
    doc = json.loads((tmp_path / "LayerNormFwdOp-cpu.json").read_text())
    (row,) = doc["results"]
    assert not row["ok"] and row["error"] == "RuntimeError: kernel exploded"
    assert row["time_s"] is None
    assert row["contenders"]["torch"]["time_s"] > 0  # the contenders still ran
    md = (tmp_path / "LayerNormFwdOp-cpu.md").read_text()
    assert "| tiny-n7 | float32 | 3×7 7 7 | error | - | - |" in md


def test_layer_norm_contender_matches_its_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _tiny(LayerNormFwdOp)
    ran = _ran(case, LayerNormFwdOp)
    rows = bench_case(case, ran, CPU, Settings(against=("torch",), iters=1))
    assert rows["torch"].error is None and rows["torch"].rel_err < 1e-5


def test_a_run_keeps_results_and_lets_the_tensors_go() -> None:
    import gc
    import weakref

    from tileops.ops.cli.driver import prepare, run_cases

    plan = prepare(["RMSNormFwdOp"], "cpu", ["fp32"], ["tiny-n7", "m1-n4096"], None, None)
    seen = []

    def per_case(case, ran, status):
        seen.append((weakref.ref(ran.inputs[0]), weakref.ref(ran.refs[0])))

    results = run_cases(plan, 1, 0.0, timed=False, per_case=per_case)
    gc.collect()
    assert [type(r) for r in results] == [CaseResult, CaseResult] and len(seen) == 2
    assert all(x() is None and ref() is None for x, ref in seen)


def test_settings_refuse_what_the_harness_cannot_do() -> None:
    with pytest.raises(ValueError, match=r"^Settings.l2 must be one of auto, cold, warm, got "
                                         r"'lukewarm'$"):
        Settings(l2="lukewarm")
    with pytest.raises(ValueError, match=r"^Settings.iters must be at least 1, got 0$"):
        Settings(iters=0)
