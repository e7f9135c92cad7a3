"""Schema numbers llguidance cannot hold are refused naming where they are (hardening round 13)."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from spec_plugins.grammar.spec import GrammarError, GrammarSpec  # noqa: E402


@pytest.mark.parametrize("schema, where", [
    ({"type": "number", "minimum": float("inf")}, r"\$\.minimum is inf: numbers in a schema must be finite"),
    ('{"type": "number", "maximum": 1e400}', r"\$\.maximum is inf"),
    ({"type": "integer", "minimum": 10 ** 29}, r"\$\.minimum is 1(0)+, past 64 bits"),
    ({"type": "object", "properties": {"a": {"enum": [1, -(2 ** 64)]}}}, r"\$\.properties\.a\.enum\[1\] is -18446744073709551616"),
], ids=["inf", "1e400-text", "big-int", "nested-enum"])
def test_schema_numbers_out_of_range_are_named(schema, where):
    """``1e400`` reached llguidance as null ("Expected f64 for 'minimum', got null") and an integer
    past 64 bits as "Value is not JSON serializable": neither named the number."""
    with pytest.raises(GrammarError, match=where):
        GrammarSpec.json_schema(schema).text()


def test_schema_numbers_within_range_still_compile():
    """Unsigned 64-bit bounds (a uint64 field) and infinity in annotations llguidance does not read
    (``default``, ``examples``) compiled before the check and still do."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 63 - 1},
                                               "u": {"type": "integer", "minimum": 0, "maximum": 2 ** 64 - 1},
                                               "x": {"type": "number", "maximum": 1.5e300, "default": float("inf"),
                                                     "examples": [float("inf")]}, "b": {"const": True}}}
    assert GrammarSpec.json_schema(schema).text()
