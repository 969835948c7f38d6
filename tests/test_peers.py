"""PeerClock: silence counts only while the control topic demonstrably works."""

from __future__ import annotations

from bus.peers import PeerClock


def _clock() -> PeerClock:
    return PeerClock(interval_s=1.0, silence_s=3.0, stuck_after_s=10.0, forget_after_s=100.0)


def test_a_peer_is_gone_after_3_s_of_silence_on_a_working_topic_or_at_once_when_it_leaves():
    peers = _clock()
    for t in range(5):
        peers.own_heard(float(t))
    peers.heard("a", 0.0)
    peers.heard("b", 4.0)
    assert peers.gone("a", 4.0) and not peers.gone("b", 4.0)
    assert not peers.gone("unknown", 4.0)
    peers.left("b", 4.5)
    assert peers.gone("b", 4.5)
    peers.heard("b", 5.0)  # back again under the same id
    assert not peers.gone("b", 5.0)


def test_an_outage_silences_everyone_and_kills_no_one():
    peers = _clock()
    peers.own_heard(0.0)
    peers.heard("a", 0.0)
    assert not peers.gone("a", 30.0)  # nothing heard at all: the topic does not work
    peers.own_heard(30.0)  # the broker is back: the peer gets its silence_s again
    assert not peers.gone("a", 30.5)
    for t in (31.0, 32.0, 33.0):
        peers.own_heard(t)
    assert not peers.gone("a", 33.5)  # 3 s of the topic since it is back, not more
    peers.own_heard(34.0)
    assert peers.gone("a", 34.0)


def test_a_pause_in_reading_the_topic_counts_no_silence():
    """A worker's event loop paused 2.3 s (a loaded machine): when it runs again, its inbox's next request may be
    checked before its control listener has read the heartbeats that came meanwhile. Its own are as late, so the
    peer's silence is counted up to them: the peer is not gone. If it really is, the next own heartbeats say so."""
    peers = _clock()
    for t in (0.0, 1.0, 2.0):
        peers.own_heard(t)
    peers.heard("gw", 1.05)
    assert peers.working(4.3) and not peers.gone("gw", 4.3)  # counted up to `now`, 3.25 s: gone
    for t in (4.4, 5.0):  # read again: the peer said nothing
        peers.own_heard(t)
    assert peers.gone("gw", 5.0)


def test_own_heartbeats_published_but_never_heard_mean_a_stuck_consumer():
    peers = _clock()
    peers.own_heard(0.0)
    for t in range(1, 12):
        assert not peers.stuck()
        peers.own_published(float(t))
    assert peers.stuck()
    peers.consumer_rebuilt()
    assert not peers.stuck()
    peers.own_published(12.0)
    peers.own_heard(12.5)
    assert not peers.stuck()


def test_while_the_broker_takes_no_heartbeat_a_silent_consumer_is_not_stuck():
    peers = _clock()
    peers.own_heard(0.0)
    for t in range(1, 40):  # the broker went away at 5 s: publishing fails from then on
        peers.own_published(float(t)) if t < 5 else peers.own_not_published()
    assert not peers.stuck()


def test_a_peer_known_from_a_request_gets_its_silence_before_it_counts_as_gone():
    peers = _clock()
    for t in range(6):
        peers.own_heard(float(t))
    peers.expect("gw", 3.0)
    assert not peers.gone("gw", 5.0)
    peers.own_heard(6.5)
    assert peers.gone("gw", 6.5)
    peers.forget_old(200.0)
    assert not peers.gone("gw", 200.0)
