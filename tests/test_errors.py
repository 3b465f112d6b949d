"""errors: each error is also the builtin exception callers catch, has its exit code, and short() never fails."""

import pytest

from ckpttools import errors


@pytest.mark.parametrize(
    "cls,builtin,code",
    [(errors.CheckpointNotFoundError, FileNotFoundError, 1), (errors.CorruptCheckpointError, ValueError, 1),
     (errors.UnsupportedCheckpointError, ValueError, 1), (errors.UnsafeCheckpointError, ValueError, 1),
     (errors.OutputError, OSError, 1), (errors.UsageError, Exception, 2), (errors.VerificationError, Exception, 1),
     (errors.RemoteError, Exception, 3), (errors.AuthError, Exception, 4)],
)  # fmt: skip
def test_each_error_is_a_ckpt_error_and_its_builtin(cls, builtin, code):
    with pytest.raises(builtin) as info:
        raise cls("one line")
    assert isinstance(info.value, errors.CkptError) and info.value.exit_code == code
    assert str(info.value) == "one line" and tuple(info.value.problems) == ()


def test_short_cuts_long_values_and_bounds_deep_ones():
    assert errors.short("abc") == "'abc'"
    assert errors.short("x" * 100, 10) == "'xxxxxx..." and len(errors.short("x" * 100, 10)) == 10
    deep: list = []
    for _ in range(10_000):  # nested far past the recursion limit
        deep = [deep]
    assert len(errors.short(deep, 60)) <= 60
    assert errors.short(list(range(10**6)), 200).startswith("[0, 1, 2")
    assert errors.short(ValueError("why")) == "why"


def test_short_never_fails():
    assert errors.short(10**5000) == "<a int>"  # repr of an int past Python's digit limit raises

    class BrokenRepr:
        def __repr__(self):
            raise RuntimeError("no repr")

    class BrokenStr(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    assert errors.short(BrokenRepr()).startswith("<BrokenRepr instance at")  # reprlib's own fallback
    assert errors.short(BrokenStr()) == "<a BrokenStr>"
