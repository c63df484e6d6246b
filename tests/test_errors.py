"""streamnmt.errors.one_line: an exception's message in one log line."""

from __future__ import annotations

from streamnmt.errors import one_line


def test_one_line_keeps_the_first_line_cut_and_names_the_type_where_asked():
    e = RuntimeError("  capture failed: operation not permitted\nwhile capturing\n")
    assert one_line(e) == "capture failed: operation not permitted"
    assert one_line(e, typed=True) == "RuntimeError: capture failed: operation not permitted"
    assert one_line(e, limit=7) == "capture"
    assert one_line(ValueError()) == "ValueError"  # no message: the type
    assert one_line(ValueError(), typed=True) == "ValueError: "
