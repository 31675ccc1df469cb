"""The ``tileops`` command: every subcommand, its output and exit status, and bad input.

Runs in-process with click's CliRunner on tiny workloads (``--max-elements``, ``--repeat 1``)
so the whole file stays fast on a small CPU machine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import tileops.ops
from tileops.ops import GemmFwdOp, LayerNormFwdOp, RMSNormFwdOp
from tileops.ops.cli import main
from tileops.ops.cli.scaffold import ScaffoldError, scaffold_source
from tileops.ops.workloads import cases
from tileops.runtime import REFERENCE, Kernel, Op, default_specs
from tileops.spec import load_spec_text

NO_CUDA = not torch.cuda.is_available()
SHIPPED = ("RMSNormFwdOp", "FusedAddRMSNormFwdOp", "LayerNormFwdOp")
TINY = ["--max-elements", "2048", "--repeat", "1"]


#: the op classes tileops.ops exports
OPS_EXPORTED = frozenset(tileops.ops.__all__)


def invoke(*args: str, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


# --- run --------------------------------------------------------------------------------------


def test_help_lists_every_command() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for name in ("run", "bench", "list", "explain", "check", "scaffold", "env", "cache"):
        assert name in result.output


def test_run_every_shipped_op_on_every_workload_as_json() -> None:
    result = invoke("run", "--json", "--device", "cpu", *TINY)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["device"] == "cpu" and doc["max_elements"] == 2048
    rows = doc["results"]
    for name in SHIPPED:
        entry = default_specs().find(name)[0]
        want = {(w.label, c["T"]) for w in entry.workloads for c in w.dtype_cases}
        assert {(r["workload"], r["dtype"]) for r in rows if r["op"] == name} == want
    # a fill or a scatter (a zero gradient, top-k's) does no arithmetic: its spec says so
    no_flops = {name for name in {r["op"] for r in rows}
                if default_specs().find(name)[0].roofline.flops.text == "0"}
    for r in rows:
        assert r["ok"] and r["checked"] and r["error"] is None, r
        assert r["target"] == REFERENCE  # no GPU here: the reference target serves
        assert r["rel_err"] <= r["tol"]
        assert r["time_s"] > 0 and r["bytes"] > 0 and r["gbps"] > 0
        assert r["flops"] > 0 or (r["op"] in no_flops and r["flops"] == 0)
        assert r["roof_fraction"] is None  # no roofline peak on the CPU
        # rows are capped, down to one row at the least; the row length is kept
        assert math.prod(r["shape"]) <= 2048 or r["shape"][0] == 1


def test_run_prints_a_table() -> None:
    result = invoke("run", "RMSNormFwdOp", "-w", "tiny-n7", "-w", "m128-n4096", "--device", "cpu",
                    *TINY)
    assert result.exit_code == 0, result.output
    out = result.stdout
    for col in ("op", "workload", "target", "rel err", "time", "achieved", "roofline"):
        assert col in out
    assert "tiny-n7" in out and "m128-n4096" in out and "reference" in out
    assert "1×4096 4096 *" in out  # 128 rows of 4096 > 2048 elements: one row is the floor
    assert "3×7 7 " in out  # x and weight
    assert "B/s" in out  # achieved bandwidth, in the unit that fits
    assert "3 cases on cpu: 3 ok, 0 failed (3 checked against float64)" in out


def test_run_scales_rows_down_keeping_the_row_length() -> None:
    result = invoke("run", "RMSNormFwdOp", "-w", "batch-dims-fp32", "-w", "m2048-n4096",
                    "--dtype", "bf16", "--json", "--max-elements", "65536", "--repeat", "1")
    assert result.exit_code == 0, result.output
    rows = {r["workload"]: r for r in json.loads(result.stdout)["results"]}
    assert rows["batch-dims-fp32"]["shape"] == [1, 16, 4096]  # B = [4, 512] -> [1, 16]
    assert rows["batch-dims-fp32"]["scaled"] == {"B": [[4, 512], [1, 16]]}
    assert rows["m2048-n4096"]["shape"] == [16, 4096]
    assert rows["m2048-n4096"]["inputs"] == {"x": [16, 4096], "weight": [4096]}
    assert {r["dtype"] for r in rows.values()} == {"bfloat16"}  # --dtype replaces the cases


def test_a_mismatch_exits_nonzero(monkeypatch: pytest.MonkeyPatch) -> None:
    right = LayerNormFwdOp.fp64_reference
    monkeypatch.setattr(LayerNormFwdOp, "fp64_reference",
                        lambda op, *xs: tuple(y + 1 for y in right(op, *xs)))
    result = invoke("run", "LayerNormFwdOp", "RMSNormFwdOp", "-w", "tiny-n7", "--device", "cpu",
                    *TINY)
    assert result.exit_code == 1
    assert "MISMATCH" in result.stdout
    assert "FAILED LayerNormFwdOp tiny-n7 bfloat16: relative L2 error" in result.stdout
    assert "FAILED RMSNormFwdOp" not in result.stdout


def test_an_op_without_a_reference_runs_unchecked_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def none(op, *xs):
        raise NotImplementedError(f"{type(op).__name__} declares no reference")

    monkeypatch.setattr(RMSNormFwdOp, "fp64_reference", none)
    result = invoke("run", "RMSNormFwdOp", "-w", "tiny-n7", "--json", *TINY)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert len(rows) == 2
    for r in rows:
        assert r["ok"] and not r["checked"] and r["rel_err"] is None
        assert r["note"] == ("no float64 reference: NotImplementedError: RMSNormFwdOp declares "
                             "no reference")


def test_what_a_run_prints_stays_off_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    # kernel compilers log to stdout; --json output must stay one JSON document
    right = RMSNormFwdOp.fp64_reference

    def noisy(op, *xs):
        print("compiling kernel main ...")
        return right(op, *xs)

    monkeypatch.setattr(RMSNormFwdOp, "fp64_reference", noisy)
    result = invoke("run", "RMSNormFwdOp", "-w", "tiny-n7", "--json", *TINY)
    assert result.exit_code == 0
    assert json.loads(result.stdout)["ok"] is True
    assert "compiling kernel main ..." in result.stderr


def test_an_op_that_fails_is_reported_and_exits_nonzero(monkeypatch: pytest.MonkeyPatch) -> None:
    right = RMSNormFwdOp.reference

    def broken(op, call, *xs):  # the float64 reference works; the served call does not
        if xs[0].dtype != torch.float64:
            raise RuntimeError(f"{type(op).__name__}: kernel exploded")
        return right(op, call, *xs)

    monkeypatch.setattr(RMSNormFwdOp, "reference", broken)
    result = invoke("run", "RMSNormFwdOp", "-w", "tiny-n7", "--target", "reference", "--device",
                    "cpu", *TINY)
    assert result.exit_code == 1
    # the row names the op; the op's own message, which starts with its name, follows once
    assert "FAILED RMSNormFwdOp tiny-n7 bfloat16: RuntimeError: kernel exploded\n" in result.stdout
    assert "RMSNormFwdOp: kernel" not in result.stdout


def test_a_row_names_its_op_once() -> None:
    from tileops.ops.cli.runner import run_case

    (case,) = [c for c in cases("RMSNormFwdOp", RMSNormFwdOp._signature.entry, {},
                                labels=["tiny-n7"]) if c.dtype == "float32"]
    bad = dataclasses.replace(case, params={"normalized_shape": []})
    error = run_case(RMSNormFwdOp, bad, torch.device("cpu"), repeat=1).result.error
    assert error.startswith("construction: ConstructionError: construction param "
                            "normalized_shape does not match the signature\n")


def test_describe_leaves_out_the_op_name_the_context_gives() -> None:
    from tileops.ops.cli.bench import _first_line
    from tileops.ops.cli.core import describe, without_op

    assert without_op("RMSNormFwdOp", "RMSNormFwdOp: eps is None") == "eps is None"
    assert without_op("RMSNormFwdOp", "RMSNormFwdOpX: y") == "RMSNormFwdOpX: y"
    assert without_op("RMSNormFwdOp", "row_norm_fwd: no kernel") == "row_norm_fwd: no kernel"
    assert describe("GemmFwdOp", ValueError("GemmFwdOp: bad")) == "ValueError: bad"
    assert _first_line("GemmFwdOp", RuntimeError("GemmFwdOp: bad\nmore")) == "RuntimeError: bad"


@pytest.mark.skipif(not NO_CUDA, reason="checks a machine without CUDA")
def test_a_target_that_cannot_serve_is_refused_once() -> None:
    result = invoke("run", "RMSNormFwdOp", "--target", "tileops", *TINY)
    assert result.exit_code == 2
    assert result.output.endswith(
        "Error: --target tileops cannot serve RMSNormFwdOp on cpu: the in-tree kernels run on "
        "cuda only; targets that can: reference\n")
    result = invoke("run", "--target", "tileops", *TINY)
    assert result.exit_code == 2
    shipped = [n for n in default_specs().names() if n in OPS_EXPORTED]
    assert result.output.endswith(
        f"Error: --target tileops cannot serve any op on cpu: {', '.join(shipped[:6])} and "
        f"{len(shipped) - 6} more: the in-tree kernels run on cuda only\n")
    result = invoke("bench", "LayerNormFwdOp", "--device", "cpu", "--target", "tileops")
    assert result.exit_code == 2
    assert "--target tileops cannot serve LayerNormFwdOp on cpu" in result.output


def test_serving_problem_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from tileops.ops import GemmFwdOp
    from tileops.ops.cli import core

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert core.serving_problem(RMSNormFwdOp, REFERENCE, cpu) is None
    assert core.serving_problem(RMSNormFwdOp, "tileops", cpu) == (
        "the in-tree kernels run on cuda only")
    monkeypatch.setattr(core, "device_arch", lambda device: (7, 5))
    monkeypatch.setattr(core, "_tilelang_importable", lambda: True)
    assert core.serving_problem(RMSNormFwdOp, "tileops", cuda) == (
        "no in-tree kernel supports sm_75 (they support sm_80, sm_86, sm_89, sm_90)")
    monkeypatch.setattr(core, "device_arch", lambda device: (9, 0))
    assert core.serving_problem(GemmFwdOp, "tileops", cuda) is None
    monkeypatch.setattr(core, "_tilelang_importable", lambda: False)
    assert core.serving_problem(GemmFwdOp, "tileops", cuda) == (
        "the in-tree kernels need TileLang, which is not installed")

    class NoKernels(RMSNormFwdOp, entry="RMSNormFwdOp"):
        kernel_types = {}
        reference = Op.reference  # declares none, so the reference target has no builder

    assert core.serving_problem(NoKernels, "tileops", cpu) == "the op has no in-tree kernels"
    assert core.serving_problem(NoKernels, REFERENCE, cpu) == (
        "the target has no builder for the op")
    monkeypatch.setattr(core.targets, "target_devices", lambda name: ("cuda", "xpu"))
    assert core.serving_problem(RMSNormFwdOp, REFERENCE, cpu) == (
        "the target runs on cuda, xpu only")


def test_an_unnamed_op_the_target_cannot_serve_is_left_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tileops.ops.cli import driver

    monkeypatch.setattr(driver, "serving_problem", lambda cls, target, device: (
        "it is refused here" if cls is LayerNormFwdOp else None))
    result = invoke("run", "--target", "reference", "-w", "tiny-n7", "--json", *TINY)
    assert result.exit_code == 0, result.output
    assert ("left out LayerNormFwdOp: --target reference cannot serve it on cpu: it is refused "
            "here\n") in result.stderr
    ops = {r["op"] for r in json.loads(result.stdout)["results"]}
    assert ops == {"RMSNormFwdOp", "FusedAddRMSNormFwdOp", "RMSNormBwdOp",
                   "FusedAddRMSNormBwdOp", "LayerNormBwdOp"}
    # an op whose entry takes none of the --dtype given is left out the same way (every
    # shipped op takes float32; one is made not to here)
    accepted = driver.entry_dtypes
    monkeypatch.setattr(driver, "entry_dtypes", lambda entry, adts: [
        d for d in accepted(entry, adts) if entry is not GemmFwdOp._signature.entry
        or d != "float32"])
    result = invoke("run", "--dtype", "fp32", "-w", "tiny-n7", "--json", *TINY)
    assert result.exit_code == 0, result.output
    assert "left out GemmFwdOp: it accepts no float32\n" in result.stderr


def test_in_tree_kernels_that_fail_fall_back_to_the_reference_target() -> None:
    from tileops.kernels.norm import RowNormFwdInterface
    from tileops.ops import RMSNormFwdOp
    from tileops.ops.cli.runner import run_case

    class Broken(RowNormFwdInterface, Kernel):
        devices = ("cpu",)
        general = True

        @classmethod
        def entry_for(cls, spec, op):
            raise RuntimeError("compile failed\nwith details")

    class InTreeOnCpu(RMSNormFwdOp, entry="RMSNormFwdOp"):
        kernel_types = {RowNormFwdInterface: (Broken,)}

    (case,) = [c for c in cases("RMSNormFwdOp", InTreeOnCpu._signature.entry, {},
                                labels=["tiny-n7"]) if c.dtype == "float32"]
    res = run_case(InTreeOnCpu, case, torch.device("cpu"), repeat=1).result
    assert res.ok and res.checked and res.target == REFERENCE
    assert res.note == ("in-tree kernels failed, so the reference target ran: RuntimeError: "
                        "compile failed")
    explicit = run_case(InTreeOnCpu, case, torch.device("cpu"), target="tileops", repeat=1)
    assert not explicit.result.ok and "compile failed" in explicit.result.error


def test_unknown_op_suggests_the_nearest_names() -> None:
    result = invoke("run", "RMSNormOp")
    assert result.exit_code == 2
    assert "unknown op 'RMSNormOp'; did you mean RMSNormFwdOp" in result.output


def test_unknown_device_lists_the_valid_ones() -> None:
    result = invoke("run", "--device", "tpu")
    assert result.exit_code == 2
    assert "unknown device 'tpu'; valid here: cpu" in result.output


@pytest.mark.skipif(not NO_CUDA, reason="checks a machine without CUDA")
def test_cuda_without_a_gpu_lists_the_valid_devices() -> None:
    result = invoke("run", "--device", "cuda")
    assert result.exit_code == 2
    assert "device 'cuda' is not available on this machine; valid here: cpu" in result.output


def test_unknown_dtype_lists_the_dtypes_the_ops_take() -> None:
    # only what some op at hand takes (no complex; the elementwise ops take bool and the
    # integers, the fp8 ops the float8 types), with the aliases of those
    result = invoke("run", "--dtype", "float13")
    assert result.exit_code == 2
    assert result.output.endswith(
        "Error: unknown dtype 'float13'; valid: bool, uint8, int8, int16, int32, int64, "
        "float8_e4m3fn, float8_e5m2, float16, bfloat16, float32, float64, bf16 (bfloat16), fp16 (float16), half (float16), "
        "fp32 (float32), float (float32), fp64 (float64), double (float64); did you mean "
        "float32, float16 or float?\n")
    result = invoke("run", "GemmFwdOp", "--dtype", "bf-16")
    assert result.exit_code == 2
    assert result.output.endswith(
        "Error: unknown dtype 'bf-16'; valid: float16, bfloat16, float32, float64, bf16 "
        "(bfloat16), fp16 (float16), half (float16), fp32 (float32), float (float32), fp64 "
        "(float64), double (float64); did you mean bf16, fp16 or bfloat16?\n")


def test_a_dtype_the_op_does_not_take() -> None:
    result = invoke("run", "RMSNormFwdOp", "--dtype", "int8")
    assert result.exit_code == 2
    assert "RMSNormFwdOp accepts no int8; its dtypes: float16, bfloat16, float32" in result.output


def test_a_dtype_option_naming_no_dtype_is_refused() -> None:
    """``--dtype ,`` (or an empty value) is a mistake, not "each workload's own dtypes"."""
    for value in (",,", "", " , "):
        result = invoke("run", "RMSNormFwdOp", "--dtype", value)
        assert result.exit_code == 2
        assert f"--dtype {value!r} names no dtype" in result.output


def test_unknown_workload_and_target() -> None:
    result = invoke("run", "RMSNormFwdOp", "-w", "nope")
    assert result.exit_code == 2 and "no workload matches nope; labels: " in result.output
    assert "tiny-n7" in result.output
    result = invoke("run", "RMSNormFwdOp", "--target", "nope")
    assert result.exit_code == 2
    assert "unknown target 'nope'; valid: tileops, reference" in result.output


def test_an_unknown_name_points_at_the_list() -> None:
    result = invoke("run", "NoSuchOpAtAll")
    assert result.exit_code == 2 and "(tileops list shows them all)" in result.output


# --- bench ------------------------------------------------------------------------------------


@pytest.mark.skipif(not NO_CUDA, reason="checks a machine without CUDA")
def test_bench_without_cuda_says_how_to_run_on_cpu() -> None:
    result = invoke("bench", "RMSNormFwdOp")
    assert result.exit_code == 1
    assert "this machine has none" in result.output and "--device cpu" in result.output


def test_bench_on_cpu_writes_json_markdown_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = ["bench", "RMSNormFwdOp", "--device", "cpu", "--against", "torch,compile", "-w",
            "tiny-n7", "--dtype", "fp32", "--repeat", "2", "--out", str(out)]
    # matplotlib is the ops package's `plot` extra: where the test environment lacks it, the
    # command must refuse up front, naming the extra
    if importlib.util.find_spec("matplotlib") is None:
        result = invoke(*args)
        assert result.exit_code == 1 and "pip install 'tileops-ops[plot]'" in result.output
        args.append("--no-plot")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "RMSNormFwdOp-cpu.json").read_text())
    assert doc["ops"] == ["RMSNormFwdOp"] and doc["against"] == ["torch", "torch.compile"]
    (row,) = doc["results"]
    assert row["workload"] == "tiny-n7" and row["dtype"] == "float32" and row["ok"]
    for name in ("torch", "torch.compile"):
        c = row["contenders"][name]
        assert c["error"] is None, c
        assert c["time_s"] > 0 and c["rel_err"] < 1e-5 and c["method"] == "wall clock"
    md = (out / "RMSNormFwdOp-cpu.md").read_text()
    assert "| workload | dtype | inputs | tileops (reference) | achieved |" in md
    assert "| tiny-n7 | float32 | 3×7 7 |" in md
    assert md in result.stdout
    if "--no-plot" not in args:
        assert (out / "RMSNormFwdOp-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_extra_the_message_names_is_declared() -> None:
    from tileops.ops.cli.report import PLOT_EXTRA

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = Path(__file__).parents[2] / "packages" / "ops" / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    assert f"{project['name']}[plot]" == PLOT_EXTRA
    assert project["optional-dependencies"]["plot"] == ["matplotlib>=3.7"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])


def test_bench_bad_input(tmp_path: Path) -> None:
    result = invoke("bench", "RMSNormFwdOp", "--device", "cpu", "--against", "eagr")
    assert result.exit_code == 2
    assert ("unknown contender 'eagr'; valid here: torch, torch.compile; aliases: eager (torch), "
            "compile (torch.compile); did you mean eager?") in result.output
    result = invoke("bench", "LayerNorm", "--device", "cpu")
    assert result.exit_code == 2 and "did you mean LayerNormFwdOp" in result.output
    result = invoke("bench", "--device", "cpu")
    assert result.exit_code == 2 and "Missing argument 'OP [OP]...'" in result.output


# --- list / explain / check ---------------------------------------------------------------------


def test_list() -> None:
    result = invoke("list")
    assert result.exit_code == 0
    for name in SHIPPED:
        assert name in result.output
    assert "implemented" in result.output and "reference" in result.output
    doc = json.loads(invoke("list", "--json").stdout)
    rows = {r["op"]: r for r in doc["ops"]}
    assert rows["RMSNormFwdOp"]["family"] == "norm"
    assert rows["RMSNormFwdOp"]["dtypes"] == ["float16", "bfloat16", "float32", "float64"]
    assert REFERENCE in rows["RMSNormFwdOp"]["targets"]
    assert ("tileops" in rows["RMSNormFwdOp"]["targets"]) == (not NO_CUDA)


def test_explain() -> None:
    result = invoke("explain", "LayerNormFwdOp")
    assert result.exit_code == 0
    out = result.output
    assert "LayerNormFwdOp(normalized_shape : Shape) (eps : Float) : forall (B : Shape)" in out
    assert "effects: weight optional; bias optional" in out
    assert "flops = (5 + " in out and "like torch.nn.functional.layer_norm" in out
    assert "def check(" not in out
    code = invoke("explain", "LayerNormFwdOp", "--code").output
    assert "def check(" in code and "required params from workload 'm1-n4096'" in code
    code = invoke("explain", "RMSNormFwdOp", "--code", "--param", "normalized_shape=[8]").output
    assert "s_x[-1] == 8" in code


def test_explain_lists_every_workload_as_expanded() -> None:
    # the family grid's rows (m1-n4096 ... tiny-n7) read like the entry's own rows
    out = invoke("explain", "LayerNormFwdOp").output
    entry = default_specs().find("LayerNormFwdOp")[0]
    assert f"  workloads ({len(entry.workloads)}):\n" in out
    for w in entry.workloads:
        assert f"\n    {w.label} " in out
    assert ("\n    m2048-n4096     B=[2048], normalized_shape=[4096]    with weight, bias       "
            "T=bfloat16, W=bfloat16 | T=float16, W=float16\n") in out
    assert ("\n    fp32-weight-n7  B=[3], normalized_shape=[7]          with weight, bias       "
            "T=bfloat16, W=float32\n") in out
    assert ("\n    no-affine       B=[2048], normalized_shape=[4096]    with no weight or bias  "
            "T=float32, W=float32\n") in out
    out = invoke("explain", "GemmFwdOp").output  # no optional input: no presence column
    assert "\n    square-4k-tt            M=4096, N=4096, K=4096, trans_a=True, trans_b=True  " \
           "T=bfloat16\n" in out
    assert "\n    odd-1000                M=1000, N=1000, K=1000                              " \
           "T=bfloat16\n" in out


def test_explain_constructs_through_the_op_class() -> None:
    # RMSNormFwdOp(normalized_shape=7) works from Python (the row norms take an int as torch
    # does), so it works here; a JSON value, else a Python literal
    result = invoke("explain", "RMSNormFwdOp", "--code", "--param", "normalized_shape=7")
    assert result.exit_code == 0, result.output
    assert "# generated code at (normalized_shape=7)\n" in result.output
    assert "s_x[-1] == 7" in result.output
    result = invoke("explain", "RMSNormFwdOp", "--code", "--param", "normalized_shape=(7, 3)",
                    "--param", "eps=None")
    assert result.exit_code == 0, result.output
    assert "# generated code at (normalized_shape=(7, 3), eps=None)\n" in result.output
    assert "s_x[-2] == 7" in result.output


def test_explain_bad_input() -> None:
    result = invoke("explain", "LayerNormOp")
    assert result.exit_code == 2
    assert "\nError: unknown op 'LayerNormOp'; did you mean LayerNormFwdOp" in result.output
    assert result.output.endswith("? (tileops list shows them all)\n")
    result = invoke("explain", "RMSNormFwdOp", "--code", "--param", "nope=1")
    assert result.exit_code == 2
    assert result.output.endswith(
        "Error: RMSNormFwdOp has no param 'nope'; params: normalized_shape, eps\n")
    result = invoke("explain", "RMSNormFwdOp", "--code", "--param", "normalized_shape")
    assert result.exit_code == 2
    assert result.output.endswith("Error: --param takes NAME=VALUE, got 'normalized_shape'\n")
    # the op's refusal names the op once
    for value, head in [("[]", "construction param normalized_shape does not match the "
                               "signature\n  expected: len(normalized_shape) > 0\n"),
                        ("[-1]", "construction param normalized_shape does not match the "
                                 "signature\n  expected: normalized_shape: Shape\n")]:
        result = invoke("explain", "RMSNormFwdOp", "--code", "--param",
                        f"normalized_shape={value}")
        assert result.exit_code == 2
        assert f"\nError: RMSNormFwdOp: {head}" in result.output
        assert result.output.count("RMSNormFwdOp:") == 1, result.output


def test_check_shipped_specs() -> None:
    result = invoke("check")
    assert result.exit_code == 0
    assert result.output.startswith(f"ok: {len(default_specs().names())} entries in ")


def test_check_reports_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "Op:\n"
        "  family: test\n"
        "  status: spec-only\n"
        "  signature:\n"
        "    forall: {M: Dim, T: \"DType[float16]\"}\n"
        "    inputs:\n"
        "      x: {dtype: T, shape: \"[M]\"}\n"
        "    outputs:\n"
        "      y: {dtype: T, shape: \"[M, Q]\"}\n"
    )
    result = invoke("check", str(bad))
    assert result.exit_code == 1
    assert f"{bad}:9: in Op.signature.outputs.y.shape" in result.output
    assert "unknown name 'Q'" in result.output and "1 error(s)" in result.output
    assert invoke("check", str(tmp_path / "missing.yaml")).exit_code == 2


# --- scaffold -----------------------------------------------------------------------------------

SPEC = '''\
ScaledAddFwdOp:
  family: elementwise
  status: spec-only
  doc: 'y = alpha * x (+ bias); """ \\ ";import os'
  signature:
    forall: {B: Shape, T: "DType[float16 | float32]"}
    params:
      axes: {type: "list[int] | tuple[int, ...]"}
      alpha: {type: float, default: 1.0}
      mode: {type: "'fast' | 'exact'", default: fast}
      scale: {type: "float | None", default: null}
    inputs:
      x: {dtype: T, shape: "[*B]"}
      extra: {dtype: T, shape: "[*B]", optional: true}
    outputs:
      y: {dtype: T, shape: "[*B]"}
    shape_rules:
    - "len(axes) > 0"
  workloads:
  - {B: [4, 8], axes: [1], some: [extra], dtype_cases: [{T: float32}], label: small}
'''


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scaffold_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "existing.py"
    out.write_text("# mine\n")
    result = invoke("scaffold", "RMSNormFwdOp", "--out", str(out))
    assert result.exit_code == 1
    assert "exists; refusing to overwrite it" in result.output
    assert out.read_text() == "# mine\n"


def test_scaffold_a_shipped_entry(tmp_path: Path) -> None:
    out = tmp_path / "rms.py"
    assert invoke("scaffold", "RMSNormFwdOp", "--out", str(out)).exit_code == 0
    module = _import(out, "scaffolded_rms")
    op = module.RMSNormFwdOp(normalized_shape=[8])
    assert op.normalized_shape == (8,) and op.eps is None  # the checked value, a tuple


def test_scaffold_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("scaffold", "RMSNormOp")
    assert result.exit_code == 2 and "did you mean RMSNormFwdOp" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("Op:\n  family: x\n")
    result = invoke("scaffold", "Op", "--spec", str(bad))
    assert result.exit_code == 1 and "does not pass the checks" in result.output
    assert not list(tmp_path.glob("*.py"))


def test_scaffold_refuses_names_that_are_not_identifiers(tmp_path: Path) -> None:
    entry = load_spec_text(SPEC, "x.yaml").entries["ScaledAddFwdOp"]
    for name in ("Bad-Op", "class", "A; import os"):
        with pytest.raises(ScaffoldError, match="not a Python identifier"):
            scaffold_source(name, entry, {})


# --- env / cache ------------------------------------------------------------------------------


def test_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path / "cache"))
    result = invoke("env")
    assert result.exit_code == 0
    out = result.output
    assert f"torch {torch.__version__}" in out and "tileops-ops 0.1.0" in out
    assert f"cache: {tmp_path / 'cache'} (not created)" in out
    assert "TILEOPS_CACHE_DIR" in out and "reference" in out
    if NO_CUDA:
        assert "gpu: none" in out
    doc = json.loads(invoke("env", "--json").stdout)
    assert doc["cache"]["dir"] == str(tmp_path / "cache") and doc["python"] == (
        ".".join(map(str, sys.version_info[:3])))


def test_cache_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(cache))
    assert "nothing to clear" in invoke("cache", "clear").output
    (cache / "kernels").mkdir(parents=True)
    (cache / "kernels" / "a.so").write_bytes(b"x" * 10)
    (cache / "gemm").mkdir()
    (cache / "gemm" / "tuned.json").write_text("{}")
    (cache / "theirs.json").write_text("{}")  # not TileOPs's: counted by info, never cleared
    assert "(3 files" in invoke("cache", "info").output
    result = invoke("cache", "clear", input="n\n")
    assert result.exit_code == 1 and "Delete 2 files" in result.output
    assert (cache / "gemm" / "tuned.json").exists()
    result = invoke("cache", "clear", input="y\n")
    assert result.exit_code == 0 and [p.name for p in cache.iterdir()] == ["theirs.json"]
    (cache / "specs").mkdir()
    (cache / "specs" / "again").write_text("1")
    assert invoke("cache", "clear", "--yes").exit_code == 0
    assert cache.is_dir() and [p.name for p in cache.iterdir()] == ["theirs.json"]


def test_cache_clear_refuses_the_home_directory(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    (home / "precious").mkdir(parents=True)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: home))
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(home))
    result = invoke("cache", "clear", "--yes")
    assert result.exit_code == 1 and "refusing to clear" in result.output
    assert (home / "precious").is_dir()


def test_a_workload_is_judged_by_the_matmul_peak_of_its_dtype(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 rows against the fp8 matmul, float32 against float32's, 16-bit floats and the
    rest against bf16's: a float8 GEMM is not reported above 100% of a bf16 roof."""
    from tileops.ops.cli import timing
    from tileops.ops.cli.report import markdown
    from tileops.ops.cli.runner import CaseResult

    assert [timing.math_class(d) for d in ("float8_e4m3fn", "float8_e5m2", "bfloat16",
                                            "float16", "float32", "float64", "int8", "bool")] \
        == ["fp8", "fp8", "bf16", "bf16", "fp32", "fp64", "bf16", "bf16"]
    cpu = timing.peaks(torch.device("cpu"))
    assert cpu.for_dtype("float8_e4m3fn") is cpu  # no roof on the CPU at all
    bf16 = timing.Peaks(3e12, 8e14, "bf16 roof", "cuda:7", "bf16")
    fp8 = timing.Peaks(3e12, 1.6e15, "fp8 roof", "cuda:7", "fp8")
    monkeypatch.setitem(timing._PEAKS, ("cuda:7", "bf16"), bf16)
    monkeypatch.setitem(timing._PEAKS, ("cuda:7", "fp8"), fp8)
    assert bf16.for_dtype("bfloat16") is bf16 and bf16.for_dtype("float8_e5m2") is fp8
    assert timing.measured_flops(torch.device("cuda:7")) == {"bf16": 8e14, "fp8": 1.6e15}
    flops = 2 * 8192**3
    rows = [CaseResult("GemmFp8FwdOp", "w", d, (8192, 8192), {}, time_s=flops / 1.2e15,
                       flops=flops, bytes=3 * 8192 * 8192)
            for d in ("float8_e4m3fn", "bfloat16")]
    assert rows[0].roof_fraction(bf16) == pytest.approx(0.75)
    assert rows[1].roof_fraction(bf16) == pytest.approx(1.5)  # as before: the bf16 roof
    header = {"device": "cuda:7", "versions": {}, "tileops": "x", "when": "now",
              "timing": {"method": "m", "compile": {"mode": None}}}
    text = markdown(header, rows[:1], bf16)
    assert "Roofline: bf16 workloads: bf16 roof; fp8 workloads: fp8 roof." in text
    assert "| 75% |" in text
    assert "Roofline: bf16 roof." in markdown(header, rows[1:], bf16)


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_the_fp8_and_float32_roofs_are_measured() -> None:
    from tileops.ops.cli import timing

    dev = torch.device("cuda")
    base = timing.peaks(dev)
    f32 = base.for_dtype("float32")
    assert f32.math == "fp32" and 0 < f32.flops < base.flops
    if torch.cuda.get_device_capability(dev) >= (8, 9):
        fp8 = base.for_dtype("float8_e4m3fn")
        assert fp8.flops > base.flops and fp8.bandwidth == base.bandwidth
