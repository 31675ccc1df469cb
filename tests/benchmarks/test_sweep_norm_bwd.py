"""benchmarks/sweep_norm_bwd.py on the CPU: the candidates it would compile and time (the
plan space, the default among them, what is left out and why), ``--dry-run`` and
``--shapes``, and the report a GPU run prints from its measurements."""

from __future__ import annotations

import sys
from importlib import import_module
from pathlib import Path

import pytest

from tileops.kernels.norm import FEW_ROWS, _vec
from tileops.kernels.norm_bwd import BwdRegisterPlan, bwd_register_plan

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def sweep():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield import_module("sweep_norm_bwd")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_candidates_cover_the_plan_space_with_the_default_marked(sweep):
    for shape in sweep.SHAPES:
        kept, left = sweep.candidates(shape)
        plans = [c.plan for c in kept]
        assert len(plans) == len(set(plans)) <= sweep.MAX_CANDIDATES, shape
        default = bwd_register_plan(shape.n, "bfloat16", shape.rows < FEW_ROWS, shape.kind)
        assert [c.plan for c in kept if c.default] == [default], shape
        vec = _vec(shape.n, "bfloat16")
        for p in plans:
            assert (p.tpr * p.per * p.vec, p.vec, p.rpc) == (shape.n, vec, 1), p
            if p != default:
                assert p.tpr in sweep.TPRS and p.per in sweep.PERS, p
                assert p.resident in sweep.RESIDENTS and p.tpr <= p.resident, p
                assert sweep.refusal(shape.kind, p, shape.sums) is None, p
        # every knob combination of the space is either kept or left out with a reason
        space = {BwdRegisterPlan(t, 1, vec, shape.n // vec // t, r, s)
                 for t in sweep.TPRS for r in sweep.RESIDENTS for s in (False, True)
                 if shape.n // vec % t == 0 and shape.n // vec // t in sweep.PERS}
        assert {p for p, _ in left} | set(plans) == space | {default}, shape
        assert all(why for _, why in left) and not {p for p, _ in left} & set(plans)


def test_what_is_left_out_says_why(sweep):
    layer = sweep.Shape("layer", 2048, 8192)
    assert sweep.refusal("layer", BwdRegisterPlan(1024, 1, 8, 1, 512, False), 2) == \
        "a 1024-thread CTA exceeds 512 resident threads"
    assert sweep.refusal("layer", BwdRegisterPlan(128, 1, 8, 8, 512, True), 2) == \
        "4 CTAs of 64 KiB shared memory exceed the SM's 228 KiB"
    assert sweep.refusal("layer", BwdRegisterPlan(512, 1, 8, 2, 1024, False), 2) == \
        "~112 registers a thread, 1024 resident threads leave 64"
    # at the edge of spilling (the kernel's docstring: 416 bytes spilled) it is still swept
    edge = BwdRegisterPlan(256, 1, 8, 4, 512, False)
    assert edge in [c.plan for c in sweep.candidates(layer)[0]]


def test_register_estimate_matches_the_quoted_ptxas_counts(sweep):
    # RMS 8192 x bf16 on 256 x 4, no spills at 128; the fused add at the cap, 4 bytes spilled
    assert sweep.registers("rms", BwdRegisterPlan(256, 1, 8, 4, 512, False), 1) == 112
    assert sweep.registers("add_rms", BwdRegisterPlan(256, 1, 8, 4, 512, False), 1) == 128
    # LAYER two accesses, register partials: 106 (4096) and 118 (8192) measured
    assert sweep.registers("layer", BwdRegisterPlan(256, 1, 8, 2, 512, False), 2) == 112
    # LAYER four accesses: shared partials fit 128; register partials spill
    assert sweep.registers("layer", BwdRegisterPlan(256, 1, 8, 4, 512, True), 2) == 128
    assert sweep.registers("layer", BwdRegisterPlan(256, 1, 8, 4, 512, False), 2) == 192
    assert [sweep.register_cap(r) for r in sweep.RESIDENTS] == [255, 128, 64, 32]


def test_traffic_counts_the_backward_floor(sweep):
    assert sweep.traffic(sweep.Shape("layer", 2048, 8192)) == 2048 * 8192 * 2 * 3 + 2 * 8192 * 2
    assert sweep.traffic(sweep.Shape("add_rms", 2048, 8192)) == \
        2048 * 8192 * 2 * 4 + 2 * 8192 * 2


def test_dry_run_lists_the_chosen_shapes(sweep, capsys):
    assert sweep.main(["--dry-run", "--shapes", "rms-128x4096"]) == 0
    out = capsys.readouterr().out.splitlines()
    kept, left = sweep.candidates(sweep.Shape("rms", 128, 4096))
    assert out[0] == f"rms-128x4096: {len(kept)} candidates, {len(left)} left out"
    assert out[1 + len(kept) - 1].startswith("  256x2 regs r512 ")
    assert out[1 + len(kept) - 1].endswith("grid   128  default")
    assert all(line.startswith("  left out ") for line in out[1 + len(kept):-1])
    jobs = sweep.compile_jobs([sweep.Shape("rms", 128, 4096)])
    assert out[-1] == f"{len(jobs)} programs to compile (grids for 132 SMs)"
    assert len(jobs) == len(kept) + 1  # one column sum


def test_shapes_of_one_row_length_share_programs(sweep):
    a, b = sweep.Shape("layer", 128, 8192), sweep.Shape("layer", 32768, 8192)
    assert sweep.compile_jobs([a, b]) == sweep.compile_jobs([a])


def test_unknown_shape_is_refused_by_name(sweep, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--dry-run", "--shapes", "rms-128x4096,rms-1x7"])
    assert exc.value.code == 2
    assert ("sweep_norm_bwd: --shapes expects labels among layer-128x8192, layer-2048x8192, "
            "layer-32768x8192, layer-2048x16384, layer-128x16384, layer-2048x4096, "
            "add_rms-32768x8192, add_rms-2048x8192, rms-128x4096, rms-128x8192; got rms-1x7"
            ) in capsys.readouterr().err


def test_report_sorts_marks_wrong_and_ranks_the_default(sweep):
    shape = sweep.Shape("rms", 128, 4096)
    p = [BwdRegisterPlan(t, 1, 8, 512 // t, 512, False) for t in (128, 256, 512)]
    rows = [{"plan": p[0], "default": False, "us": 5.0, "gbs": 640.0, "ok": False,
             "err": {"dx": 0.5, "dweight": 1e-3}},
            {"plan": p[1], "default": True, "us": 8.0, "gbs": 400.0, "ok": True,
             "err": {"dx": 2e-3, "dweight": 1e-3}},
            {"plan": p[2], "default": False, "us": 6.0, "gbs": 533.0, "ok": True,
             "err": {"dx": 2e-3, "dweight": 3e-3}},
            {"plan": BwdRegisterPlan(64, 1, 8, 8, 256, True), "default": False,
             "error": "compile: RuntimeError: boom"}]
    lines = sweep.table(shape, rows)
    assert lines[0] == "rms-128x4096  bf16  4 candidates  default 256x2 regs r512"
    assert lines[2].split()[:3] == ["1", "128x4", "regs"] and "WRONG dx 5.0e-01" in lines[2]
    assert lines[3].split()[1] == "512x1" and lines[3].endswith("1.333  ok 3.0e-03")
    assert lines[4].endswith("<- default")
    assert lines[5] == "  default rank: 3 of 3"
    assert lines[6] == "  FAILED 64x8 smem r256       compile: RuntimeError: boom"
    assert sweep.summary(shape, rows).split() == [
        "rms-128x4096", "best", "512x1", "regs", "r512", "6.0", "us", "default", "8.0", "us",
        "speedup", "1.333x"]
