"""The parameter rules the stream and upload endpoints share (gateway/params.py)."""

from __future__ import annotations

import pytest

from gateway.intake import UploadError
from gateway.params import parse_language, parse_sample_rate


@pytest.mark.parametrize(("raw", "kept"), [
    (None, ""), ("", ""), (" ", ""), ("en", "en"), ("EN", "en"), ("en-US", "en-us"),
    ("en_US", "en-us"), ("zh-Hant-TW", "zh-hant-tw"), ("yue", "yue"),
])
def test_language_tags(raw: str | None, kept: str) -> None:
    assert parse_language(raw) == kept


@pytest.mark.parametrize("raw", ["English!", "e n", "e", "engl", "en-", "en--us",
                                 "en-toolongsubtag"])
def test_bad_language_names_the_param(raw: str) -> None:
    with pytest.raises(UploadError) as caught:
        parse_language(raw)
    assert (caught.value.status, caught.value.code, caught.value.param) == (
        400, "invalid_language", "language")


@pytest.mark.parametrize(("raw", "rate"), [(None, 16000), ("8000", 8000), ("48000", 48000)])
def test_sample_rates(raw: str | None, rate: int) -> None:
    assert parse_sample_rate(raw) == rate


@pytest.mark.parametrize("raw", ["7999", "48001", "abc", ""])
def test_bad_sample_rate(raw: str) -> None:
    with pytest.raises(UploadError) as caught:
        parse_sample_rate(raw)
    assert caught.value.code == "invalid_sample_rate"
