"""A failed test's frames let go of what they held (tests/conftest.py), so that on a GPU one
failure cannot leave the tests after it without memory."""

import gc
import weakref

import pytest


class _Held:
    pass


def _fails(refs: list) -> None:
    held = _Held()
    refs.append(weakref.ref(held))
    raise ValueError("a test failing while it holds an engine")


def test_a_failed_tests_frames_let_go_of_their_locals():
    from tests.conftest import release_frames

    refs = []
    with pytest.raises(ValueError) as info:
        _fails(refs)
    gc.collect()
    assert refs[0]() is not None  # the kept exception's frames hold it
    release_frames(info.tb)
    assert refs[0]() is None
