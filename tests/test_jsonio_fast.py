"""The fast JSON path (msgspec, :func:`replayjob.jsonio.fast_loads`) reads exactly what the standard library
reads, under both rule sets: the strict one (:func:`~replayjob.jsonio.loads_strict`: duplicate keys, ``NaN``
and infinities, depth, 64-bit integers, UTF-8) and the diag reader's (:func:`~replayjob.check.rows.parse_line`:
duplicate keys refused, ``NaN`` and infinities read, any depth the standard library reads).

Every document either reads as the same values (compared as ``marshal`` bytes: type-tagged, floats by their
bits) or is refused with the same message as by the standard library alone (``loads_stdlib``,
``parse_line_stdlib``), over hand-picked hostile documents and generated ones: duplicate keys spelled
differently, ``:`` inside strings, escapes, long integers, edge floats, deep nesting and byte mutations.
"""

from __future__ import annotations

import json
import marshal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replayjob.check.rows import parse_line, parse_line_stdlib
from replayjob.errors import IntegrityError
from replayjob.jsonio import MAX_DEPTH, MISS, fast_loads, loads_stdlib, loads_strict


def outcome(fn: Any, data: bytes) -> tuple[str, bytes | str]:
    try:
        return "value", marshal.dumps(fn(data), 2)
    except IntegrityError as exc:
        return "refused", exc.message


def agree(data: bytes) -> None:
    assert outcome(loads_strict, data) == outcome(loads_stdlib, data), data[:200]
    row = outcome(lambda b: parse_line(b, 7, "diag.jsonl"), data)
    assert row == outcome(lambda b: parse_line_stdlib(b, 7, "diag.jsonl"), data), data[:200]


HOSTILE = [
    b'{"a":1,"a":2}', b'{"a":1,"\\u0061":2}', b'{"a\\u003a":1,"a:":2}', b'{"a":"\\u003a","a":2}',
    b'{"a":"x:y","a":1}', b'{"k:":1,"k\\u003a":2}', b'{"a":{"b":1,"b":1}}', b'[{"a":1},{"a":1,"a":1}]',
    b'{"a":"x:y","b":"::"}', b'{"a::b":1}', b'{"a":"\\\\:"}', b'{"a":NaN}', b'{"a":Infinity}',
    b'{"a":-Infinity}', b'{"a":1e400}', b'{"a":-1e400}', b'{"a":1e-400}', b'{"a":4.9e-324}',
    b'{"a":12345678901234567890}', b'{"a":-12345678901234567890}', b'{"a":123456789012345678901}',
    b'123456789012345678901', b'{"a":' + b"1" * 4301 + b"}", b'{"a":"\\ud800"}', b'{"a":"\xed\xa0\x80"}',
    b'{"a":"\xff"}', b'\xef\xbb\xbf{"a":1}', b'{"a":"\x01"}', b'{"a":1,}', b"[1,]", b"", b" ", b"{}", b"[]",
    b'{"a":1}\n', b'{"a":1}\r\n', b' \t{"a" : 1 }  ', b'{"a":1} x', b'{"a":1}{"b":2}', b"\x00{}",
    b'"\x00"', b'{"a":-0}', b'{"a":-0.0}', b'{"a":0.1}', b'{"a":1E2}', b'{"a":01}', b'{"a":.5}',
    b'{"a":"\xe2\x82\xac:\xf0\x9f\x98\x80"}', b'{"\\u00e9":1,"\xc3\xa9":2}', b'"just a string"', b"null",
    b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
    b'{"a":' * 300 + b"1" + b"}" * 300, b"[" * 990 + b"]" * 990, b"[" * 5000 + b"]" * 5000,
    '{"a":"\u2028:"}'.encode(), b'{"a":[1,2,{"b":[3,{"c":"d:e"}]}],"f":{"g":null,"h":true}}',
]


@pytest.mark.parametrize("data", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_documents_read_or_are_refused_as_the_standard_library_does(data: bytes) -> None:
    agree(data)


def test_duplicates_never_take_the_fast_path() -> None:
    for data in (b'{"a":1,"a":2}', b'{"a":1,"\\u0061":2}', b'{"a":"x:y","a":1}', b'{"k:":1,"k\\u003a":2}'):
        assert fast_loads(data) is MISS and fast_loads(data, strict=False) is MISS
        with pytest.raises(IntegrityError, match="duplicate key"):
            loads_strict(data)
        with pytest.raises(IntegrityError, match="duplicate key"):
            parse_line(data, 1, "d.jsonl")


def test_the_fast_path_serves_ordinary_documents() -> None:
    """What reduce and diag-diff read every time does not fall back (the speed is not silently lost)."""
    row = {"step": 3, "loss": 0.25, "device": "cuda:0", "timing": {"t": [1.5, 2.0]}, "ok": True, "n": None}
    for text in (json.dumps(row), json.dumps(row, separators=(",", ":")), json.dumps(row, indent=2)):
        assert fast_loads(text.encode()) == row and fast_loads(text.encode(), strict=False) == row
    assert fast_loads(b'{"loss":NaN}', strict=False) is MISS  # the standard library reads NaN rows
    assert parse_line(b'{"loss":NaN}', 1, "d.jsonl")["loss"] != parse_line(b'{"loss":NaN}', 1, "d.jsonl")["loss"]


# ----------------------------------------------------------------------------------- generated documents
KEYS = st.text(alphabet=st.sampled_from("ab:\\\"é€ \u2028"), max_size=4)
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 0.1]))
INTS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([10**20 - 1, -(10**20) + 1, 10**20, -(10**20)]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, KEYS)
# Objects as lists of pairs, so that a key may repeat.
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(st.tuples(KEYS, inner), max_size=4).map(lambda p: ("pairs", p))),
    max_leaves=25)


def render(value: Any, escape: Any, sep: tuple[str, str]) -> str:
    """JSON text of ``value``: pairs as objects (repeats kept); strings escaped per the draw."""
    if isinstance(value, tuple) and value and value[0] == "pairs":
        body = sep[0].join(f"{render_str(k, escape)}{sep[1]}{render(v, escape, sep)}" for k, v in value[1])
        return "{" + body + "}"
    if isinstance(value, list):
        return "[" + sep[0].join(render(v, escape, sep) for v in value) + "]"
    if isinstance(value, str):
        return render_str(value, escape)
    return json.dumps(value)


def render_str(s: str, escape: Any) -> str:
    """A string literal with some characters written as \\uXXXX (the same key spelled two ways)."""
    out = []
    for ch in s:
        if ch in '"\\' or escape.draw(st.integers(0, 3)) == 0:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=VALUES, data=st.data(), sep=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
def test_generated_documents_read_as_the_standard_library_reads_them(value: Any, data: st.DataObject,
                                                                    sep: tuple[str, str]) -> None:
    agree(render(value, data, sep).encode("utf-8"))


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from('0123456789.eE+-'), min_size=1, max_size=40))
def test_number_texts_read_as_the_standard_library_reads_them(text: str) -> None:
    agree(f'{{"x":{text}}}'.encode())
    agree(text.encode())


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_byte_mutations_read_or_are_refused_as_the_standard_library_does(data: st.DataObject) -> None:
    base = bytearray(b'{"step":3,"loss":0.25,"dev":"cuda:0","t":{"a":[1.5,-2e-3,7]},"k":"\\u00e9","n":null}')
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(base) - 1))
        op = data.draw(st.sampled_from(["set", "insert", "delete"]))
        byte = data.draw(st.sampled_from(list(b'":,{}[]\\u0aN1e.-\xff\xc3 ')))
        if op == "set":
            base[i] = byte
        elif op == "insert":
            base.insert(i, byte)
        elif len(base) > 1:
            del base[i]
    agree(bytes(base))


@pytest.mark.parametrize("data", [b"1e400", b"-1e400", b'{"a":[1,{"b":1e400}]}', b'{"a":-1E+400}',
                                  b'{"a":' + b"9" * 400 + b'.5}', b'[1.7976931348623159e308]'])
def test_numbers_that_overflow_to_infinity_are_refused_on_both_paths(data: bytes) -> None:
    """An overflowing number is as non-finite as the ``Infinity`` literal: refused whichever parser decides."""
    for fn in (loads_strict, loads_stdlib):
        with pytest.raises(IntegrityError, match="overflows to a non-finite float"):
            fn(data)
    assert loads_strict(b'{"a":1e-400}') == {"a": 0.0}  # underflow to zero is a finite value


@pytest.mark.parametrize("data", [b'{"a":"\\ud800"}', b'{"\\udc00":1}', b'{"a":[1,{"b":"x\\udfff"}]}',
                                  b'{"a":"\\uD83D"}'])
def test_a_lone_surrogate_is_refused_by_both_readers(data: bytes) -> None:
    """Half a UTF-16 pair parses to a string no UTF-8 writer can write: a diag row holding one made diag-diff's
    report (text or --json) fail with a UnicodeEncodeError traceback (exit 3)."""
    for fn in (loads_strict, loads_stdlib):
        with pytest.raises(IntegrityError, match="lone surrogate"):
            fn(data)
    with pytest.raises(IntegrityError, match="line 7: malformed JSON: a string holds a lone surrogate"):
        parse_line(data, 7, "d.jsonl")
    assert loads_strict(b'{"a":"\\ud83d\\ude00","b":"\\\\ud800"}') == {"a": "\U0001f600", "b": "\\ud800"}
