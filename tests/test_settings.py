"""adapters/settings.py: every number setting is a finite positive number, and says so when it is not."""

from __future__ import annotations

import pytest

from contextrender.settings import positive_number, start_setting


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "ten", "1e999"])
def test_a_bad_value_is_refused_with_what_it_must_be(monkeypatch, raw):
    monkeypatch.setenv("CONTEXTRENDER_X", raw)
    with pytest.raises(ValueError, match=rf"CONTEXTRENDER_X must be a positive number of seconds \(got '{raw}'\)"):
        positive_number("CONTEXTRENDER_X", 5.0, unit="seconds")
    with pytest.raises(SystemExit, match="ContextRender refuses to start: CONTEXTRENDER_X must be a positive number"):
        start_setting("CONTEXTRENDER_X", 5.0, unit="seconds")


def test_unset_or_blank_is_the_default_and_a_bound_is_kept(monkeypatch):
    monkeypatch.delenv("CONTEXTRENDER_X", raising=False)
    assert positive_number("CONTEXTRENDER_X", 5.0) == 5.0
    monkeypatch.setenv("CONTEXTRENDER_X", "  ")
    assert positive_number("CONTEXTRENDER_X", 5.0) == 5.0
    monkeypatch.setenv("CONTEXTRENDER_X", " 2.5 ")
    assert positive_number("CONTEXTRENDER_X", 5.0) == 2.5
    monkeypatch.setenv("CONTEXTRENDER_X", "0.5")
    with pytest.raises(ValueError, match=r"must be a positive number, at least 1 \(got '0.5'\)"):
        positive_number("CONTEXTRENDER_X", 64, at_least=1)
