"""CallSpec.check_fields: the field checks every call spec's ``__post_init__`` states once."""

import pytest

from tileops.runtime import CallSpec


class DemoSpec(CallSpec, frozen=True, kw_only=True):
    rows: int
    dtype: str
    flag: bool

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": {"float16", "bfloat16"}}, sizes=("rows",),
                          flags=("flag",))


def test_a_valid_spec_passes() -> None:
    assert DemoSpec(device="cpu", rows=0, dtype="float16", flag=False).rows == 0


@pytest.mark.parametrize(("field", "value", "error", "message"), [
    ("dtype", "float32", ValueError,
     "DemoSpec.dtype must be one of bfloat16, float16, got 'float32'"),
    ("rows", -1, ValueError, "DemoSpec.rows must be a size (an int >= 0), got -1"),
    ("rows", True, ValueError, "DemoSpec.rows must be a size (an int >= 0), got True"),
    ("rows", 3.0, ValueError, "DemoSpec.rows must be a size (an int >= 0), got 3.0"),
    ("flag", 1, TypeError, "DemoSpec.flag must be a bool, got 1"),
])
def test_each_kind_of_field_is_refused_by_name(field, value, error, message) -> None:
    fields = {"device": "cpu", "rows": 2, "dtype": "bfloat16", "flag": True, field: value}
    with pytest.raises(error) as e:
        DemoSpec(**fields)
    assert str(e.value) == message
