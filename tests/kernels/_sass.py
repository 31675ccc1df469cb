"""The SASS of a program's generated CUDA: the compile tests' guard of what the memory-bound
programs' hot loops issue.

A memory-bound program reaches copy bandwidth only where its loop issues few instructions a
16-byte access: a load split into narrower ones, a register spilled to local memory or a
branch around every element's test costs issue slots the loads need, and the program still
computes the same thing, so no GPU test notices. :func:`sass` compiles a program's CUDA for
sm_90a (:func:`_ptxas.ptxas_report`) and disassembles the cubin with ``cuobjdump`` (on the
PATH, or the ``nvidia-cuda-cuobjdump`` wheel's); :func:`functions` reads its instructions,
:func:`loops` finds the loops (a branch back), :func:`memory` counts the memory instructions
of a stretch by their full opcode (``LDG.E.128.CONSTANT``, ``STG.E.128``, ``LDL``...)."""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _ptxas import ptxas_report

__all__ = ["cuobjdump", "functions", "loops", "memory", "needs_cuobjdump", "opcodes", "sass"]


def _tool(name: str) -> str | None:
    """The CUDA tool ``name`` to run: the PATH's, else its ``nvidia-cuda-<name>`` wheel's."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(root).glob(f"cu*/bin/{name}"), reverse=True):
            return str(path)
    return None


def cuobjdump() -> str | None:
    """The ``cuobjdump`` to run (it runs ``nvdisasm``, which must be found too)."""
    return _tool("cuobjdump") if _tool("nvdisasm") else None


needs_cuobjdump = pytest.mark.skipif(
    shutil.which("nvcc") is None or cuobjdump() is None,
    reason="the SASS of a program needs nvcc, cuobjdump and nvdisasm (the "
           "nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels)")

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def sass(source: str, workdir: Path, name: str = "program") -> str:
    """``cuobjdump -sass`` of ``source`` (a program's ``get_kernel_source()``) compiled for
    sm_90a."""
    ptxas_report(source, workdir, name)
    env = {**os.environ, "NVDISASM_PATH": str(Path(_tool("nvdisasm")).parent)}
    done = subprocess.run([cuobjdump(), "-sass", str(workdir / f"{name}.cubin")],
                          capture_output=True, text=True, check=True, env=env)
    return done.stdout


def functions(text: str) -> dict[str, list[tuple[int, str]]]:
    """Each function's instructions as ``(address, text)``, the text without its ``;``."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"\s+Function : (\S+)", line)
        if head:
            current = out.setdefault(head.group(1), [])
            continue
        m = _INS.search(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2)))
    return out


def opcodes(ins: list[tuple[int, str]]) -> list[str]:
    """The opcodes (with their modifiers) of ``ins``, predicates dropped."""
    return [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in ins]


def loops(ins: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """The instructions of each loop of a function, innermost first: from a backward
    branch's target to the branch."""
    found = []
    for addr, text in ins:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            found.append([(a, t) for a, t in ins if start <= a <= addr])
    return sorted(found, key=len)


def memory(ins: list[tuple[int, str]]) -> collections.Counter:
    """The memory instructions of ``ins`` (global, local and shared loads, stores and
    atomics) counted by full opcode."""
    return collections.Counter(op for op in opcodes(ins)
                               if op.startswith(("LDG", "STG", "LDL", "STL", "LDS", "STS",
                                                 "ATOM", "RED")))
