"""What ptxas says of a program's generated CUDA: the compile tests' guard against a silent
slowdown of the Hopper products.

ptxas serializes every ``wgmma`` of a function (warning C7514) where it cannot prove that no
other instruction touches a product's accumulator between its issue and its wait (a product
or a wait under a condition is enough), and injects a wait of its own (C7517) where an
instruction reads registers a product in flight defines; either costs the overlap the program
was written for, and a register spill costs local-memory traffic. The program still computes
the same thing, so no GPU test notices. :func:`ptxas_report` compiles a program's CUDA for
sm_90a with TileLang's own headers (as TileLang's build does) and returns ptxas's ``-v``
report; :func:`assert_asynchronous` refuses any of the three."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["assert_asynchronous", "needs_nvcc", "ptxas_report", "spills"]

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90a needs nvcc (the CUDA toolkit)")

_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(source: str, workdir: Path, name: str = "program", arch: str = "sm_90a") -> str:
    """ptxas's ``-v`` report on ``source`` (a program's ``get_kernel_source()``), compiled to a
    cubin for ``arch`` under ``workdir``; a failed compile fails the test with the report."""
    import tilelang.env as tl_env

    src = workdir / f"{name}.cu"
    src.write_text(source)
    done = subprocess.run(
        ["nvcc", f"-arch={arch}", "-std=c++17", "-cubin", "-o", str(workdir / f"{name}.cubin"),
         f"-I{tl_env.TILELANG_TEMPLATE_PATH}", f"-I{tl_env.CUTLASS_INCLUDE_DIR}",
         "--use_fast_math", "-w", "-Xptxas", "-v", str(src)],
        capture_output=True, text=True, check=False)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    return report


def spills(report: str) -> list[tuple[int, int]]:
    """The (store, load) bytes of spilled registers of each function of a report."""
    return [(int(s), int(ld)) for s, ld in _SPILLS.findall(report)]


def assert_asynchronous(report: str) -> None:
    """No ``wgmma`` serialized (C7514), no wait injected by ptxas (C7517), no function that
    spills registers."""
    assert "C7514" not in report and "serialized" not in report, report
    assert "C7517" not in report, report
    found = spills(report)
    assert found and all(f == (0, 0) for f in found), report
