"""Fixtures shared by the runtime tests.

- Process-wide runtime state (the default target, ``TILEOPS_TARGET``, targets registered by a
  test, the log level) is restored after every test.
- ``state`` checks an op's instance state against the reference document's groups
  (construction, binding, run; tables 2 and 3) before and after a fault.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tileops.runtime import log, targets
from tileops.runtime.op import _UNRESOLVED, Op

SPECS_DIR = Path(__file__).parent / "specs"

#: table 2, construction group (besides the spec params, which every op has by name)
CONSTRUCTION = ("target", "_installed_kernel_types", "_preferred_over", "_keys_by_interface",
                "_construction_indices", "_instance_key", "_init_args")
#: table 2, binding group (table 3 gives the initial values)
BINDING = ("_target_builder", "_serving_target", "_entries_by_call", "_built_entries",
           "_target_kernels")
#: table 2, run group (besides construction-time tensors, named by each op class)
RUN = ("_tune_requested", "_delegates", "_delegate_stages", "_effect_branches", "_last_call",
       "_tune_warned", "_backward_ops")


@pytest.fixture(autouse=True)
def _isolate_process_state(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TILEOPS_TARGET", raising=False)
    saved_default = (targets._default[0], targets._default_set[0])
    saved_targets = dict(targets._targets)
    saved_builders = {k: dict(v) for k, v in targets._builders.items()}
    saved_level = log.logger.level
    yield
    targets._default[0], targets._default_set[0] = saved_default
    targets._targets.clear()
    targets._targets.update(saved_targets)
    targets._builders.clear()
    targets._builders.update(saved_builders)
    log.set_log_level(log.logging.getLevelName(saved_level))


_names = itertools.count()


@pytest.fixture
def new_target():
    """``new_target(devices=None) -> name``: a freshly registered target (removed afterwards
    by the autouse fixture)."""

    def make(devices: tuple[str, ...] | None = None) -> str:
        name = f"test-target-{next(_names)}"
        targets.register_target(name, devices)
        return name

    return make


@dataclass
class Snapshot:
    construction: dict[str, Any]
    binding: dict[str, Any]
    run: dict[str, Any]


class StateCheck:
    """Assertions on the three groups of an op's instance state."""

    CONSTRUCTION = CONSTRUCTION
    BINDING = BINDING
    RUN = RUN

    def snapshot(self, op: Op) -> Snapshot:
        cons = {n: getattr(op, n) for n in CONSTRUCTION}
        cons.update({n: getattr(op, n) for n in type(op)._param_names})
        cons = {n: (v, _copy(v)) for n, v in cons.items()}
        binding = {n: (getattr(op, n), _copy(getattr(op, n))) for n in BINDING}
        run = {n: (getattr(op, n), _copy(getattr(op, n))) for n in RUN}
        run.update({n: (getattr(op, n), None) for n in type(op).construction_tensors})
        return Snapshot(cons, binding, run)

    def assert_fields_present(self, op: Op) -> None:
        names = CONSTRUCTION + BINDING + RUN + type(op)._param_names + tuple(
            type(op).construction_tensors)
        missing = [n for n in names if not hasattr(op, n)]
        assert not missing, f"fields missing after construction: {missing}"

    def assert_binding_initial(self, op: Op) -> None:
        """Table 3: every binding field holds its initial value."""
        assert op._target_builder is _UNRESOLVED
        assert op._target_builder is type(op)._target_builder
        assert op._serving_target is None
        assert op.serving_target is None
        assert op._entries_by_call == {}
        assert op._built_entries == {}
        assert op.built_entries == {}
        assert op._target_kernels == {}

    def assert_construction_unchanged(self, op: Op, before: Snapshot) -> None:
        for n, (obj, copy) in before.construction.items():
            now = getattr(op, n)
            assert now is obj, f"construction field {n} was replaced"
            assert _copy(now) == copy, f"construction field {n} was modified"

    def assert_run_kept(self, op: Op, before: Snapshot) -> None:
        """The run group survives a failure: the same objects, nothing of theirs removed."""
        for n in ("_delegates", "_delegate_stages", "_effect_branches"):
            obj, copy = before.run[n]
            assert getattr(op, n) is obj, f"run field {n} was replaced"
            if isinstance(copy, dict):
                now = getattr(op, n)
                for k, v in copy.items():
                    assert k in now and now[k] is v, f"run field {n} lost {k!r}"
        assert op._tune_requested == before.run["_tune_requested"][0]
        assert op._tune_warned >= before.run["_tune_warned"][0]

    def assert_last_call_unchanged(self, op: Op, before: Snapshot) -> None:
        assert op._last_call is before.run["_last_call"][0]
        assert op.last_call is before.run["_last_call"][0]

    def assert_binding_kept(self, op: Op, before: Snapshot) -> None:
        """A failing call that did not bind the target leaves the binding as it was: the same
        builder and target, and every cache entry from before still there."""
        assert op._target_builder is before.binding["_target_builder"][0]
        assert op._serving_target == before.binding["_serving_target"][0]
        for n in ("_entries_by_call", "_target_kernels"):
            now = getattr(op, n)
            for k, v in before.binding[n][1].items():
                assert now.get(k) is v, f"binding cache {n} lost {k!r}"
        for iface, built in before.binding["_built_entries"][1].items():
            for k, v in built.items():
                assert op._built_entries[iface][k] is v

    def assert_failed_and_reset(self, op: Op, before: Snapshot) -> None:
        """After a failing call that bound the target."""
        self.assert_binding_initial(op)
        self.assert_run_kept(op, before)
        self.assert_construction_unchanged(op, before)
        self.assert_last_call_unchanged(op, before)

    def assert_failed_and_kept(self, op: Op, before: Snapshot) -> None:
        """After a failing call made under a target bound by an earlier call."""
        self.assert_binding_kept(op, before)
        self.assert_run_kept(op, before)
        self.assert_construction_unchanged(op, before)
        self.assert_last_call_unchanged(op, before)


def _copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: (dict(x) if isinstance(x, dict) else x) for k, x in v.items()}
    if isinstance(v, list):
        return list(v)
    return v


@pytest.fixture
def state() -> StateCheck:
    return StateCheck()
