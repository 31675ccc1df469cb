"""``tileops scaffold``: the leaf on a shipped family base, a new family's skeleton, and an op
scaffolded from a spec entry that runs green through the reference target with no edits."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tileops.kernels.norm import RowNormKind
from tileops.ops import RowNormOp
from tileops.ops.cli import main
from tileops.ops.cli.scaffold import family_base, scaffold_source
from tileops.ops.workloads import cases_of, make_inputs, rel_l2
from tileops.runtime import REFERENCE, SpecSet, default_specs
from tileops.runtime import specs as runtime_specs
from tileops.spec import load_spec_text

#: a new family: its ref_api is a torch function the reference can call on widened inputs
POINTWISE = """\
ScaffoldAddFwdOp:
  family: scaffold_pointwise
  status: implemented
  ref_api: torch.add
  doc: z = x + y
  signature:
    forall: {M: Dim, N: Dim, T: "DType[float16 | float32]"}
    inputs:
      x: {dtype: T, shape: "[M, N]"}
      y: {dtype: T, shape: "[M, N]"}
    outputs:
      z: {dtype: T, shape: "[M, N]"}
  workloads:
  - {M: 4, N: 8, dtype_cases: [{T: float32}, {T: float16}], label: small}
  - {M: 3, N: 7, dtype_cases: [{T: float32}], label: odd}
"""

#: a variant of the shipped row-norm family: no derivable reference
NORM_VARIANT = """\
ScaffoldRMSNormFwdOp:
  family: norm
  status: spec-only
  ref_api: torch.nn.functional.rms_norm
  signature:
    forall: {M: Dim, N: Dim, T: "DType[float16 | float32]"}
    params:
      eps: {type: float, default: 1.0e-6}
    inputs:
      x: {dtype: T, shape: "[M, N]"}
    outputs:
      y: {dtype: T, shape: "[M, N]"}
"""

_TOL = {torch.float32: 1e-6, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def _own_spec_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command registers the spec it scaffolds from; the test's entries stay in a copy of
    the process-wide set, so the rest of the suite never sees them."""
    copy = SpecSet()
    copy.merge(default_specs())
    monkeypatch.setattr(runtime_specs, "_default", copy)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _machine_paths() -> list[str]:
    roots = {str(Path(__file__).resolve().parents[2]), str(Path.home()),
             tempfile.gettempdir(), os.path.realpath(tempfile.gettempdir())}
    return [r for r in roots if len(r) > 1]


def _assert_portable(text: str, *extra: Path) -> None:
    for root in [*_machine_paths(), *(str(p) for p in extra)]:
        assert root not in text, root
    ast.parse(text)


def test_family_base_is_found_from_the_shipped_modules() -> None:
    assert family_base("norm") is RowNormOp
    assert family_base("gemm").__name__ == "GemmOp"
    assert family_base("scaffold_pointwise") is None


def _scaffold_pointwise(tmp_path: Path):
    spec_file = tmp_path / "pointwise.yaml"
    spec_file.write_text(POINTWISE)
    pkg = tmp_path / "scaffoldpkg"
    ops_out, kernels_out = pkg / "pointwise.py", pkg / "pointwise_kernels.py"
    result = invoke("scaffold", "ScaffoldAddFwdOp", "--spec", str(spec_file), "--out",
                    str(ops_out), "--kernels-out", str(kernels_out), "--kernels-module",
                    "scaffoldpkg.pointwise_kernels")
    return spec_file, ops_out, kernels_out, result


def test_a_scaffolded_op_passes_the_generic_harness_with_no_hand_edits(tmp_path: Path) -> None:
    """The whole generic harness (numerics on every workload, the signature's bad-input
    corpus, compile, fake and meta tensors) run on the scaffolded op, untouched, through the
    reference target, in a fresh interpreter pointed at it by TILEOPS_HARNESS."""
    spec_file, ops_out, _, result = _scaffold_pointwise(tmp_path)
    assert result.exit_code == 0, result.output
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ,
           "TILEOPS_HARNESS": json.dumps({"specs": [str(spec_file)],
                                          "modules": ["scaffoldpkg.pointwise"]}),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
         str(root / "tests" / "ops" / "harness")],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 20, tail  # every category ran on the op


def test_a_new_family_runs_green_through_the_reference_target(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec_file, ops_out, kernels_out, result = _scaffold_pointwise(tmp_path)
    assert result.exit_code == 0, result.output
    assert f"wrote {ops_out} and {kernels_out}" in result.output
    assert "todo: ScaffoldPointwiseGeneralKernel.__call__ raises NotImplementedError" in \
        result.output
    assert "reference raises" not in result.output  # derived from ref_api
    for path in (ops_out, kernels_out):
        _assert_portable(path.read_text(), tmp_path)

    assert default_specs().find("ScaffoldAddFwdOp") is not None  # the command registered it
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "scaffoldpkg", raising=False)
    kernels = importlib.import_module("scaffoldpkg.pointwise_kernels")
    ops = importlib.import_module("scaffoldpkg.pointwise")
    cls = ops.ScaffoldAddFwdOp
    assert issubclass(cls, ops.ScaffoldPointwiseOp)
    leaf = next(n for n in ast.parse(ops_out.read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == "ScaffoldAddFwdOp")
    assert [n.name for n in leaf.body] == ["reference", "eager"]  # no __init__: generated
    assert set(kernels.ScaffoldPointwiseSpec.__struct_fields__) == {"device", "m", "n", "dtype"}
    spec = kernels.ScaffoldPointwiseSpec(device="cpu", m=2, n=3, dtype="float16")
    assert (spec.m, spec.n, spec.dtype) == (2, 3, "float16")
    with pytest.raises(ValueError, match=r"ScaffoldPointwiseSpec.dtype must be one of float16, "
                                         r"float32, got 'bfloat16'"):
        kernels.ScaffoldPointwiseSpec(device="cpu", m=2, n=3, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"ScaffoldPointwiseSpec.m must be a size"):
        kernels.ScaffoldPointwiseSpec(device="cpu", m=-1, n=3, dtype="float16")
    with pytest.raises(TypeError):
        kernels.ScaffoldPointwiseSpec("cpu", 2, 3, "float16")  # keyword-only

    op = cls(target=REFERENCE)
    assert repr(op) == "ScaffoldAddFwdOp(target='reference')"
    cases = cases_of(cls)
    assert {(c.label, c.dtype) for c in cases} == {("small", "float32"), ("small", "float16"),
                                                   ("odd", "float32")}
    for case in cases:
        x, y = make_inputs(case)
        (want,) = op.fp64_reference(x, y)
        torch.testing.assert_close(want, x.double() + y.double())
        z = op(x, y)
        assert z.shape == x.shape and z.dtype == x.dtype
        assert rel_l2(z.double(), want) <= _TOL[x.dtype]
        torch.testing.assert_close(op.eager()(x, y), z)  # eager is torch.add
    with pytest.raises(Exception, match=r"ScaffoldAddFwdOp.*y") as info:
        op(torch.randn(4, 8), torch.randn(4, 9))  # N unifies to 8, then 9
    assert "N" in str(info.value)

    # the forward of the family base reaches the general kernel with the typed call spec
    with pytest.raises(NotImplementedError,
                       match="ScaffoldPointwiseGeneralKernel: write the scaffold_pointwise_fwd"):
        cls(kernel_map={"scaffold_pointwise_fwd": _cpu(kernels)})(torch.randn(2, 3),
                                                                   torch.randn(2, 3))


def _cpu(kernels):
    class CpuGeneral(kernels.ScaffoldPointwiseGeneralKernel):
        devices = ("cpu",)

    return CpuGeneral


def test_a_variant_of_a_shipped_family_is_its_leaf_declaration(tmp_path: Path) -> None:
    spec_file = tmp_path / "variant.yaml"
    spec_file.write_text(NORM_VARIANT)
    out = tmp_path / "variant.py"
    result = invoke("scaffold", "ScaffoldRMSNormFwdOp", "--spec", str(spec_file), "--out",
                    str(out))
    assert result.exit_code == 0, result.output
    assert ("todo: ScaffoldRMSNormFwdOp.reference raises NotImplementedError: it has params, "
            "optional inputs or several outputs") in result.output
    assert "todo: ScaffoldRMSNormFwdOp.eager is not written" in result.output
    text = out.read_text()
    _assert_portable(text, tmp_path)
    tree = ast.parse(text)
    (leaf,) = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert [ast.unparse(b) for b in leaf.bases] == ["RowNormOp"]
    assert [ast.unparse(n) for n in leaf.body if isinstance(n, ast.Assign)] == [
        f"kind = RowNormKind.{next(iter(RowNormKind)).name}"]
    assert [n.name for n in leaf.body if isinstance(n, ast.FunctionDef)] == ["reference"]
    ref = next(n for n in leaf.body if isinstance(n, ast.FunctionDef))
    assert [a.arg for a in ref.args.args] == ["self", "call", "x"]
    assert ast.unparse(ref.body[0]) == ("raise NotImplementedError(\"ScaffoldRMSNormFwdOp."
                                        "reference: state the op's outputs in plain PyTorch\")")


def test_a_leaf_with_a_derivable_reference_on_a_shipped_base() -> None:
    entry = load_spec_text(NORM_VARIANT.replace("    params:\n      eps: {type: float, "
                                                "default: 1.0e-6}\n", "")
                           .replace("torch.nn.functional.rms_norm", "torch.nn.functional.silu"),
                           "x.yaml").entries["ScaffoldRMSNormFwdOp"]
    made = scaffold_source("ScaffoldRMSNormFwdOp", entry, {})
    assert made.kernels is None and made.notes == ()
    assert "return (torch.nn.functional.silu(_wide(x)),)" in made.ops
    assert "return torch.nn.functional.silu" in made.ops


def test_scaffold_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    entry = load_spec_text(POINTWISE, "x.yaml").entries["ScaffoldAddFwdOp"]
    with pytest.raises(ValueError, match="kernels module 'a.b-c' is not a dotted name of Python identifiers"):
        scaffold_source("ScaffoldAddFwdOp", entry, {}, kernels_module="a.b-c")
    two = POINTWISE.replace('T: "DType[float16 | float32]"}',
                            'T: "DType[float16 | float32]", U: "DType[float32]"}')
    entry = load_spec_text(two, "x.yaml").entries["ScaffoldAddFwdOp"]
    with pytest.raises(ValueError, match="ScaffoldAddFwdOp: a new family's call spec reads one "
                                         "DType index; the entry has 2"):
        scaffold_source("ScaffoldAddFwdOp", entry, {})
