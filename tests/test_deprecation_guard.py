"""The suite's guard (conftest.py): a deprecated third-party API called from our code fails the test; the same
warning raised between third-party modules is left alone."""

from __future__ import annotations

import types
import warnings

import pytest
from deprecation_guard import DeprecatedCallError


LIBRARY = '''
import warnings

def old_api():
    warnings.warn("old_api is deprecated", FutureWarning)  # no stacklevel, like transformers' property

def old_kwarg(x=None):
    warnings.warn("x is deprecated", DeprecationWarning, stacklevel=2)  # blames its caller

def new_api():
    old_api()  # the library's own use of its deprecated API
'''


@pytest.fixture
def library() -> types.ModuleType:
    module = types.ModuleType("some_library")
    exec(compile(LIBRARY, "/site-packages/some_library/__init__.py", "exec"), module.__dict__)
    return module


def test_a_deprecated_call_from_our_code_fails(library):
    with pytest.raises(DeprecatedCallError, match=r"test_deprecation_guard.py:\d+ calls a deprecated API"):
        library.old_api()
    with pytest.raises(DeprecatedCallError, match="x is deprecated"):
        library.old_kwarg(x=1)


def test_third_party_use_and_other_warnings_pass(library):
    with pytest.warns(FutureWarning, match="old_api is deprecated"):
        library.new_api()
    with pytest.warns(UserWarning):
        warnings.warn("not a deprecation", UserWarning, stacklevel=1)
