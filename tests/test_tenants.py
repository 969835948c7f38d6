"""Tenants: the file and its reload (gateway/tenancy/tenants.py), and their limits across gateways (quotas.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from gateway.tenancy.quotas import SHARE_INTERVAL_S, STALE_S, Quotas, duration
from gateway.tenancy.tenants import Tenants, TenantsFileError, digest_of, read_tenants_file
from schemas.fair_share import FAIR_PREEMPT_MARGIN, RETURN_CREDIT, FairShare, priority_level

TOML = """
rate_window_s = 10
[tenants.team-a]
keys = ["key-a", "sha256:{digest}"]
weight = 2
requests_per_minute = 60
tokens_per_minute = 600
max_concurrent = 3
max_priority = 2
models = ["tokenrelay-tiny", "shout"]
max_tokens = 64
[tenants.team-b]
keys = ["key-b"]
"""


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    stamp = path.stat().st_mtime_ns + 10**9  # a second on: a rewrite in the same tick still reads as a change
    os.utime(path, ns=(stamp, stamp))
    return path


def _tenants(tmp_path: Path, text: str = TOML, name: str = "tenants.toml") -> Tenants:
    digest = hashlib.sha256(b"hashed-key-a").hexdigest()
    return Tenants(str(_write(tmp_path / name, text.replace("{digest}", digest))))


def test_a_tenants_file_in_toml_or_yaml_maps_plain_and_hashed_keys_to_their_tenant(tmp_path):
    tenants = _tenants(tmp_path)
    assert tenants.names() == ["team-a", "team-b"] and tenants.window_s == 10
    assert [tenants.of_digest(digest_of(k)) for k in (b"key-a", b"hashed-key-a", b"key-b", b"key-c", b"sha256:")] == [
        "team-a",
        "team-a",
        "team-b",
        None,
        None,
    ]
    a = tenants.get("team-a")
    assert (a.weight, a.requests_per_minute, a.tokens_per_minute, a.max_concurrent) == (2, 60, 600, 3)
    assert (a.max_priority, a.models, a.max_tokens) == (2, ["tokenrelay-tiny", "shout"], 64)
    b = tenants.get("team-b")
    assert (b.weight, b.requests_per_minute, b.max_priority, b.models, b.max_tokens) == (1, None, 1, [], None)
    yaml = "tenants:\n  team-y:\n    keys: [key-y]\n    tokens_per_minute: 100\n"
    in_yaml = _tenants(tmp_path, yaml, "tenants.yaml")
    assert in_yaml.window_s == 60 and in_yaml.of_digest(digest_of(b"key-y")) == "team-y"
    assert in_yaml.get("team-y").tokens_per_minute == 100


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ('keys = ["k"]\nweight = 0', "tenants.t.weight: Input should be greater than 0"),
        ('keys = ["k"]\nrequests_per_minute = 0', "tenants.t.requests_per_minute: Input should be greater than"),
        ('keys = ["k"]\nmax_priority = 6', "tenants.t.max_priority: Input should be less than or equal to 5"),
        ('keys = ["k"]\nburst = 3', "tenants.t.burst: Extra inputs are not permitted"),
        ("keys = []", "tenants.t.keys: List should have at least 1 item"),
        ('keys = ["sha256:abc"]', "a hashed key is sha256: and 64 lower-case hex digits"),
        ('keys = ["k"]\n[tenants.u]\nkeys = ["k"]', "a key of tenant u is also one of tenant t"),
        ('keys = "k"\n[tenants', "Expected ']'"),
    ],
)
def test_a_bad_tenants_file_is_refused_naming_the_entry(tmp_path, entry, named):
    path = _write(tmp_path / "t.toml", f"[tenants.t]\n{entry}\n")
    with pytest.raises(TenantsFileError) as refused:
        read_tenants_file(str(path))
    assert named in str(refused.value) and str(path) in str(refused.value)


def test_the_file_read_again_lets_a_new_key_in_and_a_removed_one_not_and_a_bad_one_changes_nothing(tmp_path):
    tenants = _tenants(tmp_path)
    path = Path(tenants.path)
    tenants.reload_if_changed()  # unchanged: nothing read
    _write(path, '[tenants.team-b]\nkeys = ["key-b", "key-new"]\n')
    tenants.reload_if_changed()
    assert (tenants.of_digest(digest_of(b"key-new")), tenants.of_digest(digest_of(b"key-a")), tenants.names()) == (
        "team-b",
        None,
        ["team-b"],
    )
    _write(path, "[tenants.team-b\n")
    tenants.reload()  # as SIGHUP does
    assert tenants.of_digest(digest_of(b"key-new")) == "team-b"  # the tenants read before stay


def _quotas(tmp_path: Path, entry: str, window_s: int = 60, gateway: str = "g1") -> tuple[Quotas, Tenants]:
    path = _write(tmp_path / f"{gateway}.toml", f"rate_window_s = {window_s}\n[tenants.t]\nkeys = ['k']\n{entry}\n")
    tenants = Tenants(str(path))
    return Quotas(gateway, 1000.0, tenants), tenants


def test_requests_per_minute_admit_exactly_the_limit_in_the_window_then_room_comes_back_as_it_slides(tmp_path):
    quotas, tenants = _quotas(tmp_path, "requests_per_minute = 30", window_s=20)  # 10 per 20 s
    t = tenants.get("t")
    for second in range(10):
        assert quotas.admit("t", t, 5000.0 + second) is None
    refused = quotas.admit("t", t, 5012.5)
    assert refused.limit == "requests_per_minute" and refused.retry_after_s == 8  # the request of 5000 leaves at 5020
    assert "used 10 requests in the last 20 s, its limit of 30 per minute" in refused.message
    assert quotas.headers("t", t, 5012.5) == {
        "x-ratelimit-limit-requests": "30",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "16.5s",  # the last one, of 5009, leaves at 5029
    }
    assert quotas.admit("t", t, 5020.0) is None  # one room, from 5000's
    assert quotas.admit("t", t, 5020.5).retry_after_s == 1


def test_tokens_per_minute_count_as_given_and_concurrency_as_in_flight(tmp_path):
    quotas, tenants = _quotas(tmp_path, "tokens_per_minute = 100\nmax_concurrent = 2")
    t = tenants.get("t")
    assert quotas.admit("t", t, 100.0) is None and quotas.admit("t", t, 100.0) is None
    assert quotas.admit("t", t, 100.0).limit == "max_concurrent"
    quotas.ended("t")
    quotas.tokens("t", 99, 101.0)
    assert quotas.admit("t", t, 102.0) is None  # 99 < 100
    quotas.ended("t")
    quotas.tokens("t", 1, 103.0)
    refused = quotas.admit("t", t, 104.0)
    assert (refused.limit, refused.retry_after_s) == ("tokens_per_minute", 57)  # 101's tokens leave at 161
    assert quotas.headers("t", t, 104.0)["x-ratelimit-remaining-tokens"] == "0"
    assert quotas.admit("t", t, 161.0) is None


def _exchange(*quotas: Quotas, now: float) -> None:
    reports = [q.report(now) for q in quotas]
    for q in quotas:
        for report in reports:
            if report is not None:
                q.observe(report)


def test_gateways_that_share_their_use_hold_a_limit_together_within_one_request_per_other_gateway(tmp_path):
    (one, tenants_one), (two, tenants_two) = (
        _quotas(tmp_path, "requests_per_minute = 20", gateway=g) for g in ("g1", "g2")
    )
    t = tenants_one.get("t")
    _exchange(one, two, now=200.0)  # each knows the other is there
    admitted = 0
    now = 200.0
    for _ in range(20):  # both take as much as they may, then share their use; again and again
        now += SHARE_INTERVAL_S
        for quotas in (one, two):
            admitted += sum(quotas.admit("t", t, now) is None for _ in range(30))
        _exchange(one, two, now=now)
    assert 20 <= admitted <= 21  # the bound: the limit, and one request per other gateway
    # Alone, a gateway's own use is never refused short of the limit: one gateway is exact.
    alone, tenants = _quotas(tmp_path, "requests_per_minute = 20", gateway="g3")
    assert sum(alone.admit("t", tenants.get("t"), 300.0) is None for _ in range(30)) == 20


def test_the_in_flight_of_a_gateway_not_heard_for_a_while_no_longer_counts(tmp_path):
    (one, tenants), (two, _) = (_quotas(tmp_path, "max_concurrent = 2", gateway=g) for g in ("g1", "g2"))
    t = tenants.get("t")
    assert two.admit("t", t, 10.0) is None and two.admit("t", t, 10.0) is None
    one.observe(two.report(10.0))
    assert one.admit("t", t, 10.5).limit == "max_concurrent"
    assert one.admit("t", t, 10.0 + STALE_S + 0.1) is None  # g2 stopped: its requests ended with it


def test_a_restarted_gateway_counts_its_previous_life_s_use_and_skips_its_own_reports(tmp_path):
    before, tenants = _quotas(tmp_path, "requests_per_minute = 3")
    t = tenants.get("t")
    assert all(before.admit("t", t, 50.0) is None for _ in range(3))
    after = Quotas("g1", 1060.0, tenants)  # the same id, started later
    after.observe(before.report(50.0))
    after.observe(after.report(51.0))
    assert after.admit("t", t, 52.0).limit == "requests_per_minute"


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.02, "20ms"), (0, "0ms"), (1.5, "1.5s"), (360, "6m0s"), (61.25, "1m1.2s")]
)
def test_reset_times_are_written_as_openai_writes_them(seconds, text):
    assert duration(seconds) == text


def test_fair_share_counts_tokens_by_weight_and_an_idle_tenant_banks_no_more_than_its_return_credit():
    fair = FairShare(return_credit=RETURN_CREDIT)  # a gateway's
    fair.arrived("a")
    fair.charge("a", 2.0, 6000)  # weight 2: 6000 tokens count 3000
    assert not fair.far_below("a")  # nobody else active
    fair.arrived("b")  # a is active: b starts RETURN_CREDIT below it, not at 0 with 3000 tokens of credit
    assert (fair.counter("a"), fair.counter("b")) == (3000, 3000 - RETURN_CREDIT)
    assert fair.far_below("b") and not fair.far_below("a")
    fair.charge("b", 1.0, RETURN_CREDIT - FAIR_PREEMPT_MARGIN)  # within the margin of a: no longer far below
    assert not fair.far_below("b")
    for tenant in ("a", "b"):
        fair.left(tenant)  # b leaves last, at 2488 with its credit not all spent: at the level of 3000
    fair.arrived("c")  # nobody active: a credit below the level the last one left at
    assert fair.counter("c") == 3000 - RETURN_CREDIT
    fair.arrived("d")  # it comes back while c is in its credit: level with c, not a credit below it
    assert fair.counter("d") == fair.counter("c") and not fair.far_below("d") and not fair.far_below("c")
    fair.left("d")
    fair.charge("c", 1.0, 10)
    assert fair.order("c", 4.5) < fair.order("a", 4.5)  # within a level, the counter
    fair.charge("c", 1.0, 100_000)
    assert fair.order("c", 3.9) < fair.order("a", 4.5)  # a level first, whatever the counters


@pytest.mark.parametrize(("urgency", "level"), [(5.0, 5), (4.999, 5), (4.0, 4), (0.5, 1), (-1.5, -1)])
def test_an_aged_priority_keeps_its_level_until_it_has_waited_a_whole_aging_period(urgency, level):
    assert priority_level(urgency) == level
