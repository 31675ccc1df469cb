"""Environment knobs (one module) and leveled logging that costs nothing when off."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from tileops.runtime import CallSpec, Kernel, KernelInterface, Op, SpecSet, env, log, targets

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")
README = Path(__file__).resolve().parents[2] / "packages" / "runtime" / "README.md"


class Iface(KernelInterface):
    call_spec = CallSpec


class Copy(Kernel, Iface):
    devices = ("cpu",)
    general = True

    def __call__(self, x, y):
        y.copy_(x)


class ScaleOp(Op, specs=SPECS):
    kernel_types = {Iface: (Copy,)}

    def forward(self, call, x, bias, y):
        self.kernel(Iface, CallSpec(call.device))(x, y)


# --- env -------------------------------------------------------------------------------------------


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TILEOPS_CACHE_DIR", raising=False)
    assert env.cache_dir() == Path.home() / ".cache" / "tileops"
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    assert env.cache_dir() == tmp_path
    monkeypatch.setenv("TILEOPS_CACHE_DIR", "~/tc")
    assert env.cache_dir() == Path.home() / "tc"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TILEOPS_CACHE_DIR", "rel/c")  # absolute: TileLang is handed it
    assert env.cache_dir() == tmp_path / "rel" / "c"


def test_every_cache_part_and_compiler_cache_lies_under_the_cache_dir(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    assert set(env.CACHE_PARTS) == {"gemm", "kernels", "specs", "tilelang", "tvm-ffi"}
    assert env.cache_part("tilelang") == tmp_path / "tilelang"
    assert env.compiler_cache_env() == {"TILELANG_CACHE_DIR": str(tmp_path / "tilelang"),
                                        "TVM_FFI_CACHE_DIR": str(tmp_path / "tvm-ffi")}
    assert env.cache_part("kernels") == tmp_path / "kernels"
    with pytest.raises(KeyError, match="unknown cache part 'programs'; parts: gemm, kernels, "
                                       "specs, tilelang, tvm-ffi"):
        env.cache_part("programs")


def test_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TILEOPS_LOG_LEVEL", raising=False)
    assert env.log_level() == "WARNING"
    monkeypatch.setenv("TILEOPS_LOG_LEVEL", " debug ")
    assert env.log_level() == "DEBUG"
    monkeypatch.setenv("TILEOPS_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="TILEOPS_LOG_LEVEL must be one of"):
        env.log_level()


def test_default_target(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.default_target() is None
    monkeypatch.setenv("TILEOPS_TARGET", "  ")
    assert env.default_target() is None
    monkeypatch.setenv("TILEOPS_TARGET", "reference")
    assert env.default_target() == "reference"
    assert targets.default_target() == "reference"


def test_the_env_module_lists_every_knob_and_the_readme_documents_them() -> None:
    assert set(env.KNOBS) == {"TILEOPS_CACHE_DIR", "TILEOPS_LOG_LEVEL", "TILEOPS_TARGET"}
    text = README.read_text()
    for knob in env.KNOBS:
        assert re.search(rf"`{knob}`", text), f"README does not document {knob}"
    source = Path(env.__file__).read_text()
    # every TILEOPS_ variable read anywhere in the runtime is a knob of env.py
    runtime = Path(env.__file__).parent
    for path in runtime.glob("*.py"):
        for name in re.findall(r"TILEOPS_[A-Z_]+", path.read_text()):
            assert name in env.KNOBS, f"{path.name} reads {name}, which env.py does not list"
    assert "os.environ" not in "".join(
        p.read_text() for p in runtime.glob("*.py") if p.name != "env.py")
    assert source.count("os.environ") >= 3


# --- logging --------------------------------------------------------------------------------------


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def captured():
    handler = Capture()
    log.logger.addHandler(handler)
    yield handler
    log.logger.removeHandler(handler)


def test_info_logs_binding_and_building(captured) -> None:
    log.set_log_level("INFO")
    assert log.INFO and not log.DEBUG
    op = ScaleOp()
    op(torch.ones(2))
    op(torch.ones(2))
    assert any(m.startswith("ScaleOp bound to target tileops (by device, device cpu)")
               for m in captured.messages)
    assert sum("building Copy" in m for m in captured.messages) == 1


def test_levels_switch_the_fast_flags() -> None:
    log.set_log_level("debug")
    assert log.DEBUG and log.INFO
    log.set_log_level("WARNING")
    assert not log.DEBUG and not log.INFO
    log.set_log_level("ERROR")
    assert log.logger.level == logging.ERROR


class Loud:
    """An argument whose formatting is observable."""

    formatted = 0

    def __str__(self) -> str:
        Loud.formatted += 1
        return "loud"

    __repr__ = __str__


def test_logging_that_is_off_costs_no_formatting(captured, monkeypatch) -> None:
    log.set_log_level("WARNING")
    Loud.formatted = 0
    log.debug("%s", Loud())
    log.info("%s", Loud())
    assert Loud.formatted == 0 and captured.messages == []
    log.warning("%s", Loud())
    assert Loud.formatted >= 1 and captured.messages == ["loud"]


def test_a_call_with_logging_off_touches_no_logger(monkeypatch: pytest.MonkeyPatch) -> None:
    log.set_log_level("WARNING")

    def forbidden(*a, **k):
        raise AssertionError("the logger was called while its level is off")

    with monkeypatch.context() as m:
        for name in ("debug", "info", "log", "isEnabledFor"):
            m.setattr(log.logger, name, forbidden)
        op = ScaleOp()
        op(torch.ones(2))  # binds, selects and builds: every logging site on the miss path
        op(torch.ones(2))
