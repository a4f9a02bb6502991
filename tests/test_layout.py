"""deploykit.layout: unsafe tags are refused."""

from __future__ import annotations

import pytest

from deploykit.errors import UsageError
from deploykit.layout import safe_name
from deploykit.results import write_result


def test_unsafe_tag_is_refused_and_nothing_is_written_outside(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path / "results"))
    for bad in ("../../x", "a/b", "..", ".hidden", "", "x y"):
        with pytest.raises(UsageError, match="not a plain name"):
            write_result("efficientnet_lite0", bad, {"status": "ok"})
    assert not list(tmp_path.rglob("*.json"))
    assert safe_name("ort_int8_hp32") == "ort_int8_hp32"
