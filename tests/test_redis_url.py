"""lanegate/redis_url.py: plain and Sentinel Redis URLs, and a clear error for a bad one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lanegate.redis_url import DirectTarget, RedisUrlError, SentinelTarget, parse_redis_url
from lanegate.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://:pw@redis:6380/2",
                                 "unix:///run/redis.sock?db=1", "REDIS://host"])
def test_plain_urls_go_to_redis_py_as_they_are(url: str) -> None:
    assert parse_redis_url(url) == DirectTarget(url)


def test_sentinel_url_with_password_hosts_service_and_db() -> None:
    target = parse_redis_url("redis+sentinel://:s3cr%40t@10.0.0.1:26379,10.0.0.2:26380,"
                             "sentinel-c/mymaster/3")
    assert target == SentinelTarget(
        sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26380), ("sentinel-c", 26379)),
        service_name="mymaster", db=3, password="s3cr@t")


def test_sentinel_url_defaults_and_options() -> None:
    assert parse_redis_url("redis+sentinel://h/svc") == SentinelTarget((("h", 26379),), "svc")
    assert parse_redis_url("redis+sentinel://h:1/svc/") == SentinelTarget((("h", 1),), "svc")
    target = parse_redis_url("redis+sentinel://app:pw@[::1]:5000/svc/0"
                             "?sentinel_username=s&sentinel_password=spw")
    assert target == SentinelTarget((("::1", 5000),), "svc", 0, username="app", password="pw",
                                    sentinel_username="s", sentinel_password="spw")


@pytest.mark.parametrize(("url", "says"), [
    ("127.0.0.1:6379", "is not a URL"),
    ("http://redis:6379", "unknown Redis URL scheme 'http'"),
    ("redis+sentinel://h:26379", "names its service"),
    ("redis+sentinel://h:26379/", "names its service"),
    ("redis+sentinel:///svc", "at least one host"),
    ("redis+sentinel://a:1,,b:2/svc", "at least one host"),
    ("redis+sentinel://h:port/svc", "bad port 'port'"),
    ("redis+sentinel://h:70000/svc", "bad port '70000'"),
    ("redis+sentinel://[::1/svc", "bad sentinel address"),
    ("redis+sentinel://h/svc/zero", "database must be a number"),
    ("redis+sentinel://h/svc/0/extra", "too many path parts"),
    ("redis+sentinel://h/svc?timeout=1", "unknown sentinel URL option 'timeout'"),
])
def test_bad_urls_say_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError, match=says):
        parse_redis_url(url)


def test_a_bad_url_is_a_settings_error_that_hides_the_password() -> None:
    with pytest.raises(SettingsError, match="LANEGATE_REDIS_URL") as caught:
        Settings(redis_url="tcp://:hunter2@redis:6379")
    assert "hunter2" not in str(caught.value)
    with pytest.raises(SettingsError, match=r"\*\*\*@redis"):
        Settings(redis_url=":hunter2@redis:6379")
    assert Settings(redis_url="").redis_url == ""  # `lanegate up` starts its own


def test_the_cli_refuses_a_bad_url_with_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lanegate.cli", "worker", "--lane", "batch",
         "--redis-url", "redis+sentinel://h:26379"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2
    assert "LANEGATE_REDIS_URL" in result.stderr
    assert "names its service" in result.stderr
