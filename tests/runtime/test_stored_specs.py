"""Validated spec files kept in the cache: a second load of the same files reads the record
instead of validating again and gives equal entries; an edited file, another validator, a
record written under another key, a truncated, corrupted or hostile record, and an unwritable
cache each fall back to validating the files, with the same result or the same errors."""

from __future__ import annotations

import msgspec
import pytest

from tileops.runtime import SpecSet
from tileops.runtime import specs as specs_mod
from tileops.spec import SpecError, stored

SPEC = """\
ScaleOp:
  family: test
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[float16 | float32]"}
    params:
      factor: {type: float, default: 2.0}
      dim: {type: "int | tuple[int, ...] | None", default: null}
    inputs:
      x: {dtype: T, shape: "[*S]"}
    outputs:
      y: {dtype: T, shape: "[*S]"}
  workloads:
  - {S: [4, 8], factor: .inf, dtype_cases: [{T: float16}], label: inf}
  roofline:
    flops: "prod(S)"
"""


@pytest.fixture()
def spec_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "specs"
    d.mkdir()
    (d / "scale.yaml").write_text(SPEC)
    return d


def records(tmp_path):
    return sorted((tmp_path / "cache" / "specs").glob("*.msgpack"))


def validations(monkeypatch) -> list:
    seen: list = []
    real = specs_mod.check_paths

    def counted(paths):
        seen.append(paths)
        return real(paths)

    monkeypatch.setattr(specs_mod, "check_paths", counted)
    return seen


def test_a_second_load_reads_the_record_and_gives_equal_entries(spec_dir, tmp_path,
                                                                 monkeypatch) -> None:
    seen = validations(monkeypatch)
    first = SpecSet.load(spec_dir)
    assert len(seen) == 1 and len(records(tmp_path)) == 1
    second = SpecSet.load(spec_dir)
    assert len(seen) == 1  # not validated again
    a, b = first.find("ScaleOp")[0], second.find("ScaleOp")[0]
    assert a == b
    assert b.workloads[0].values["factor"] == float("inf")  # msgpack keeps non-finite floats
    assert second.files[0].lines == first.files[0].lines
    assert second.files[0].path == first.files[0].path


def test_an_edited_file_misses_and_is_validated(spec_dir, tmp_path, monkeypatch) -> None:
    seen = validations(monkeypatch)
    SpecSet.load(spec_dir)
    (spec_dir / "scale.yaml").write_text(SPEC.replace("default: 2.0", "default: 3.0"))
    again = SpecSet.load(spec_dir)
    assert len(seen) == 2 and len(records(tmp_path)) == 2
    assert again.find("ScaleOp")[0].signature.params["factor"].default == 3.0
    # an edit that breaks the file is reported as before, whatever the cache holds
    (spec_dir / "scale.yaml").write_text(SPEC.replace("prod(S)", "prod(Q)"))
    with pytest.raises(SpecError, match="Q"):
        SpecSet.load(spec_dir)


def test_another_validator_misses(spec_dir, tmp_path, monkeypatch) -> None:
    seen = validations(monkeypatch)
    SpecSet.load(spec_dir)
    monkeypatch.setattr(stored, "FORMAT", stored.FORMAT + 1)
    SpecSet.load(spec_dir)
    assert len(seen) == 2


@pytest.mark.parametrize("damage", [
    lambda data: data[: len(data) // 2],  # truncated
    lambda data: b"\x00" * len(data),  # overwritten
    lambda data: b"",  # empty
    lambda data: b"\x91" * 100_000 + b"\xc0",  # a 100000-deep array
    lambda data: msgspec.msgpack.encode(["0" * 64, [], {}]),  # well formed, another key
    lambda data: data.replace(b"prod(S)", b"prod(("),  # an expression that does not parse
    # well formed under its key, one rule's text changed (prod(S) to sum(S)): the checksum
    # refuses it (the next test shows it would decode)
    lambda data: data.replace(b"\xa7prod(S)", b"\xa6sum(S)"),
])
def test_a_damaged_record_is_rebuilt(spec_dir, tmp_path, monkeypatch, damage) -> None:
    seen = validations(monkeypatch)
    want = SpecSet.load(spec_dir).find("ScaleOp")[0]
    (path,) = records(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    got = SpecSet.load(spec_dir).find("ScaleOp")[0]
    assert len(seen) == 2 and got == want
    assert stored.load(path.read_bytes(), path.stem)[0][0].entries["ScaleOp"] == want


def test_a_record_under_another_key_is_refused(spec_dir, tmp_path) -> None:
    SpecSet.load(spec_dir)
    (path,) = records(tmp_path)
    with pytest.raises(ValueError, match="was written under key"):
        stored.load(path.read_bytes(), "f" * 64)


def test_an_unwritable_cache_costs_only_the_validation(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(blocker))
    d = tmp_path / "specs"
    d.mkdir()
    (d / "scale.yaml").write_text(SPEC)
    seen = validations(monkeypatch)
    for _ in range(2):
        assert SpecSet.load(d).find("ScaleOp") is not None
    assert len(seen) == 2


def test_a_record_serves_loads_naming_the_files_the_same_way(spec_dir, tmp_path,
                                                             monkeypatch) -> None:
    seen = validations(monkeypatch)
    SpecSet.load(spec_dir)
    monkeypatch.chdir(spec_dir.parent)
    relative = SpecSet.load("specs")  # the same files by another path: their own record
    assert len(seen) == 2
    assert relative.files[0].path == str(spec_dir.relative_to(spec_dir.parent) / "scale.yaml")
    assert SpecSet.load("specs").files[0].path == relative.files[0].path and len(seen) == 2


def warnings_of(monkeypatch) -> list[str]:
    """The warnings the module emits (taken where it emits them: the tileops logger's
    handlers and propagation depend on what ran before)."""
    seen: list[str] = []
    monkeypatch.setattr(specs_mod.log, "warning", lambda msg, *a: seen.append(msg % a))
    monkeypatch.setattr(specs_mod, "_warned", set())
    return seen


def test_a_damaged_record_warns_once_a_process(spec_dir, tmp_path, monkeypatch) -> None:
    SpecSet.load(spec_dir)
    (path,) = records(tmp_path)
    said = warnings_of(monkeypatch)
    monkeypatch.setattr(specs_mod, "_stored_save", lambda *a: None)  # it stays damaged
    path.write_bytes(b"\x00" * 10)
    for _ in range(2):
        assert SpecSet.load(spec_dir).find("ScaleOp") is not None
    assert len(said) == 1 and said[0].startswith(f"the spec record {path} is not usable (")
    assert said[0].endswith("; validating the spec files again")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_record_that_is_not_a_regular_file_is_not_read(spec_dir, tmp_path, monkeypatch,
                                                         kind) -> None:
    """A FIFO where the record goes would block a read for ever, /dev/zero would never end:
    neither is opened."""
    import os

    SpecSet.load(spec_dir)
    (path,) = records(tmp_path)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    said = warnings_of(monkeypatch)
    seen = validations(monkeypatch)
    assert SpecSet.load(spec_dir).find("ScaleOp") is not None
    assert len(seen) == 1
    assert said[0] == (f"the spec record {path} is not usable (it is not a regular file); "
                       "validating the spec files again")


def test_a_record_that_cannot_take_its_place_warns_once_and_leaves_no_file(
        spec_dir, tmp_path, monkeypatch) -> None:
    SpecSet.load(spec_dir)
    (path,) = records(tmp_path)
    path.unlink()
    path.mkdir()  # a directory where the record goes: the rename fails
    said = warnings_of(monkeypatch)
    for _ in range(2):
        assert SpecSet.load(spec_dir).find("ScaleOp") is not None
    folder = tmp_path / "cache" / "specs"
    assert [p.name for p in folder.iterdir()] == [path.name]  # no temporary file left
    assert [s.split(" (")[0] for s in said] == [
        f"the spec record {path} is not usable", f"cannot write the spec record under {folder}"]


def test_a_changed_record_that_is_well_formed_is_refused_by_its_checksum(spec_dir,
                                                                        tmp_path) -> None:
    """An edit that keeps the record well formed under its own key (one rule's text) is refused
    by the checksum alone: with the checksum written again over the edit, the same bytes
    decode, and the edited rule would have been served."""
    import hashlib

    SpecSet.load(spec_dir)
    (path,) = records(tmp_path)
    data = path.read_bytes()
    payload = data[32:]
    assert b"\xa7prod(S)" in payload  # msgpack's 7-byte string
    edited = payload.replace(b"\xa7prod(S)", b"\xa6sum(S)")
    with pytest.raises(ValueError, match="does not match its checksum"):
        stored.load(data[:32] + edited, path.stem)
    files, _ = stored.load(hashlib.sha256(edited).digest() + edited, path.stem)
    assert files[0].entries["ScaleOp"].roofline.flops.text == "sum(S)"
