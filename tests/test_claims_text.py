"""The comparable text of a value (claims._text) is the JSON encoder's, whichever way it is spelled."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from replayjob.gate.checks import _text

names = st.text(max_size=8)  # any characters: quotes, backslashes, control and non-ASCII ones
values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.lists(names, max_size=4),
                   st.tuples(names, names), st.just({}), st.just([]), st.just(()),
                   st.dictionaries(names, st.integers(), max_size=3),
                   st.lists(st.sampled_from(["backend.options.gradient_checkpointing", "training.micro_batch_size",
                                             "quote\"d", "back\\slash", "é", "\x7f", "tab\t"]), max_size=3))


@settings(max_examples=1500, deadline=None)
@given(values)
def test_text_is_the_encoders(value: Any) -> None:
    assert _text(value) == (value if isinstance(value, str) else json.dumps(value, sort_keys=True))
