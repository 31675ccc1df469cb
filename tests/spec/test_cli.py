"""``python -m tileops.spec check|show PATH...``: exit codes, what goes to stdout and stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tileops.spec
from tileops.spec import RULES
from tileops.spec.__main__ import main

SPECS = Path(__file__).parent / "specs"
SRC = str(Path(tileops.spec.__file__).resolve().parents[2])  # packages/spec/src

BAD = """\
Op:
  family: test
  status: spec-only
  signature:
    forall: {M: Dim, T: "DType[float16]"}
    inputs:
      x: {dtype: T, shape: "[M]"}
    outputs:
      y: {dtype: T, shape: "[M, Q]"}
  roofline:
    flops: "M > 1"
"""


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "tileops.spec", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )


def test_check_good_files_in_a_subprocess() -> None:
    proc = run_cli("check", str(SPECS))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"ok: 8 entries in 1 files; rules checked: {', '.join(RULES)}\n"
    assert proc.stderr == ""


def test_check_bad_file_in_a_subprocess(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD, encoding="utf-8")
    proc = run_cli("check", str(bad))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"{bad}:9: in Op.signature.outputs.y.shape: '[M, Q]': unknown name 'Q'  [unknown-name]",
        f"{bad}:11: in Op.roofline.flops: 'M > 1' is Bool, but a number is expected here  [kind]",
        "2 error(s) in 1 entries (1 files)",
    ]


def test_check_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(SPECS / "examples.yaml")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok: 8 entries in 1 files; rules checked: index-source, ")
    assert err == ""


def test_check_a_load_error_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD.replace("status: spec-only", "status: done\n  status: planned"),
                   encoding="utf-8")
    assert main(["check", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{bad}:4: in Op.status: duplicate key 'status' (first written at line 3); YAML would "
        f"silently keep only the last one  [yaml]",
        "1 error(s) in 0 entries (1 files)",
    ]


def test_check_several_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD, encoding="utf-8")
    assert main(["check", str(SPECS), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == "2 error(s) in 9 entries (2 files)"


def test_show_prints_the_signature_notation() -> None:
    proc = run_cli("show", str(SPECS))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:6] == [
        "# GemmFwdOp  (family gemm, implemented, like torch.matmul)",
        "GemmFwdOp(trans_a trans_b : Bool) : forall (M N K : Dim) (T : DType[float16 | "
        "bfloat16]).",
        "    a: Tensor[T, Mat[trans_a, M, K]] -> b: Tensor[T, Mat[trans_b, K, N]] -> "
        "c: Tensor[T, [M, N]]",
        "  where Mat[t: Bool, R: Dim, C: Dim] = match t { false -> [R, C]; true -> [C, R] }",
        "  flops = 2 * M * N * K",
        "  2 workloads",
    ]
    assert proc.stdout.endswith(
        f"ok: 8 entries in 1 files; rules checked: {', '.join(RULES)}\n")


def test_show_every_construct(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(SPECS)]) == 0
    out = capsys.readouterr().out
    for line in [
        "RMSNormFwdOp(normalized_shape : Shape) (eps : Maybe[Float]) : forall (B : Shape) "
        "(T : DType[float16 | bfloat16 | float32]).",
        "    x: Tensor[T, [*B, *normalized_shape]] -> weight: Tensor[T, [*normalized_shape]] {?} "
        "-> y: Tensor[T, [*B, *normalized_shape]]",
        "  require not present(eps) or eps.value > 0",
        "    input: Tensor[T, [*S]] {! if inplace} -> output: Tensor[T, [*S]] = input",
        "  require not is_causal or S_q <= S_kv",
        "  let H_out = pool.out(H_in, kH, sH, pH, dH, ceil_mode)",
        "  bytes = itemsize(T) * N * C * (H_in * W_in + H_out * W_out)",
        "MoEGroupedGemmFwdOp(layout : MGroupedLayout) : forall (M E N K : Dim) "
        "(T : DType[bfloat16]).",
        "  where Meta[layout: MGroupedLayout, E: Dim] = match layout { contiguous -> [E + 1]; "
        "masked -> [E] }",
        "  stages gemm: GemmFwdOp, act: ReluFwdOp",
    ]:
        assert line in out.splitlines(), line


def test_show_still_prints_and_fails_on_errors(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD, encoding="utf-8")
    assert main(["show", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[:2] == [
        "# Op  (family test, spec-only)",
        "Op : forall (M : Dim) (T : DType[float16]).",
    ]
    assert err.splitlines()[-1] == "2 error(s) in 1 entries (1 files)"


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "usage: python -m tileops.spec" in capsys.readouterr().err
