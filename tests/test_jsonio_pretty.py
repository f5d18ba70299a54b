"""``pretty_bytes`` writes exactly the standard library's indented JSON, whichever encoder produced it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replayjob import jsonio
from replayjob.errors import IntegrityError


def _stdlib(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),  # every magnitude: exponents, subnormals, -0.0
    st.sampled_from([1e-4, 9.999999999999999e-05, 1e16, 9999999999999998.0, 0.1, 1e-05, 123.0]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.tuples(inner, inner),
    st.dictionaries(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8), inner, max_size=5)),
    max_leaves=40)


@settings(max_examples=400, deadline=None)
@given(documents)
def test_pretty_bytes_is_the_standard_librarys_text(doc: Any) -> None:
    assert jsonio.pretty_bytes(doc) == _stdlib(doc)


def test_the_fast_encoder_writes_plain_documents_and_leaves_the_rest() -> None:
    doc = {"b": [1e-05, 2.5e-300, 1e+16, -0.0, 0.5, 10**19], "a": {"é": "\u2028\x01\"", "z": (1, None)}, "c": {}}
    assert jsonio._fast_pretty(doc) == _stdlib(doc)  # exponent floats are written as repr writes them
    for odd in ({1: 2}, {"x": float("nan")}, [float("inf")], [2**64], {"k": _Sub(3)}):
        assert jsonio._fast_pretty(odd) is None  # the standard library decides
    with pytest.raises(IntegrityError, match="cannot write JSON: Out of range float"):
        jsonio.pretty_bytes({"x": [float("nan")]})
    assert jsonio.pretty_bytes({1: _Sub(3)}) == _stdlib({1: _Sub(3)})


class _Sub(int):
    pass
