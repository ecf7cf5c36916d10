"""This host's clock against the collector's (agent/clock.py): the quickest round trip's
offset, half its round trip as the error; a loopback collector is this host's clock."""

from __future__ import annotations

import math
import time

import pytest

from agent import Agent, AgentConfig
from agent.clock import ClockSync, is_loopback
from agent.transport import HttpClient
from tests.unit.agent.ingest_server import IngestAnswer, serve


def test_one_round_trip_gives_the_midpoint_offset_and_half_the_trip_as_error():
    sync = ClockSync(local=False)
    assert (sync.offset_s, sync.error_s, sync.num_samples) == (0.0, math.inf, 0)  # unknown before an answer
    sync.add(100.0, 100.25, 105.125)  # the collector read 105.125 while this host read 100.0 .. 100.25
    assert (sync.offset_s, sync.error_s, sync.num_samples) == (5.0, 0.125, 1)


def test_the_quickest_round_trip_is_kept_whatever_the_order():
    sync = ClockSync(local=False)
    sync.add(0.0, 0.5, 10.25)  # slow: offset 10.0 +- 0.25
    sync.add(1.0, 1.0625, 11.53125)  # quick: offset 10.5 +- 0.03125
    assert (sync.offset_s, sync.error_s) == (10.5, 0.03125)
    sync.add(2.0, 3.0, 20.0)  # slower again, a skewed answer: ignored while the quick one is in the window
    assert (sync.offset_s, sync.error_s, sync.num_samples) == (10.5, 0.03125, 3)


def test_the_window_lets_a_drift_in_once_the_quick_trip_is_old():
    sync = ClockSync(local=False, window=2)
    sync.add(0.0, 0.0625, 5.03125)  # offset 5.0, the quickest ever
    sync.add(1.0, 1.5, 7.25)  # offset 6.0
    assert sync.offset_s == 5.0
    sync.add(2.0, 2.5, 8.25)  # offset 6.0: the quick one left the window
    assert (sync.offset_s, sync.error_s) == (6.0, 0.25)


@pytest.mark.parametrize("server_ts", [None, "1700000000.0", math.nan, math.inf, -math.inf, [1.0], {"ts": 1.0}])
def test_an_answer_without_a_usable_server_ts_is_ignored(server_ts):
    sync = ClockSync(local=False)
    sync.add(0.0, 0.5, 3.25)
    sync.add(1.0, 1.0625, server_ts)
    assert (sync.offset_s, sync.error_s, sync.num_samples) == (3.0, 0.25, 1)


def test_a_round_trip_answered_before_it_was_sent_is_ignored():
    sync = ClockSync(local=False)
    sync.add(10.0, 9.0, 100.0)  # this host's clock stepped back mid-trip
    assert (sync.offset_s, sync.error_s, sync.num_samples) == (0.0, math.inf, 0)


def test_a_loopback_collector_is_this_hosts_clock_and_estimates_nothing():
    sync = ClockSync(local=True)
    assert (sync.offset_s, sync.error_s) == (0.0, 0.0)
    sync.add(0.0, 0.001, 1e9)
    assert (sync.offset_s, sync.error_s, sync.num_samples) == (0.0, 0.0, 0)


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("localhost.localdomain", True), ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
    ("[::1]", True), ("10.0.0.7", False), ("0.0.0.0", False), ("::", False), ("collector.example", False),
    ("", False), ("fe80::1", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_the_http_client_measures_against_its_host():
    assert HttpClient("http://127.0.0.1:8428", None, 1.0).clock.local is True
    assert HttpClient("http://localhost:8428", None, 1.0).clock.local is True
    assert HttpClient("http://[::1]:8428", None, 1.0).clock.local is True
    assert HttpClient("http://10.1.2.3:8428", None, 1.0).clock.local is False


@pytest.fixture
def answering():
    server = serve(ahead_s=100.0)  # the collector's clock 100 s ahead of this host's
    yield server
    server.shutdown()
    server.server_close()


def test_an_ingest_answers_server_ts_feeds_the_clock(answering):
    client = HttpClient(f"http://127.0.0.1:{answering.server_address[1]}", None, 2.0)
    client.clock = ClockSync(local=False)  # as if the collector were on another host
    try:
        for _ in range(3):
            assert client.post(b"batch").status == "ok"
    finally:
        client.close()
    sync = client.clock
    assert sync.num_samples == 3
    assert 0.0 < sync.error_s < 1.0
    assert abs(sync.offset_s - 100.0) <= sync.error_s + 1e-6


def test_a_loopback_client_keeps_offset_zero_whatever_the_answer(answering):
    client = HttpClient(f"http://127.0.0.1:{answering.server_address[1]}", None, 2.0)
    try:
        assert client.post(b"batch").status == "ok"
    finally:
        client.close()
    assert (client.clock.offset_s, client.clock.error_s, client.clock.num_samples) == (0.0, 0.0, 0)


def test_the_agent_has_no_offset_without_a_collector():
    agent = Agent(AgentConfig(url=None, device_health=False), run_id="r", rank=0)
    assert agent.clock_offset() == (0.0, math.inf)
    agent.close()


# -- through a node's relay (collector/relay.py) -----------------------------------------------
def test_a_relays_hold_is_taken_out_of_the_trip_and_its_own_error_added():
    sync = ClockSync(local=False)
    # sent at 100.0, answered at 100.52; the relay held it 0.5 s, read the collector's clock as
    # 105.26 at the middle of its hold, and knows that clock within 0.002 s
    sync.add(100.0, 100.52, 105.26, hold_s=0.5, upstream_error_s=0.002)
    assert sync.offset_s == pytest.approx(5.0) and sync.error_s == pytest.approx(0.01 + 0.002)
    sync.add(101.0, 101.04, 106.02, hold_s=0.0, upstream_error_s=1.0)  # a quicker trip, a worse relay estimate
    assert sync.error_s == pytest.approx(0.012)  # the better bound is kept
    sync.add(102.0, 102.3, 107.15, hold_s=0.9)  # a hold longer than the trip (clocks): no negative error
    assert sync.error_s == 0.0


def test_a_relayed_answer_turns_a_loopback_clients_one_clock_off():
    sync = ClockSync(local=True)
    sync.relayed()
    assert (sync.local, sync.error_s) == (False, math.inf)  # unknown until a sample
    sync.add(0.0, 0.01, 3.005, hold_s=0.008, upstream_error_s=0.0005)
    assert sync.offset_s == pytest.approx(3.0) and sync.error_s == pytest.approx(0.0015)


class _Relayed(IngestAnswer):
    """A relay's answer: the collector's clock (100 s ahead) at the middle of a 0.2 s hold."""

    def answer(self) -> dict:
        arrived = time.time()
        time.sleep(0.2)  # the relay waits for the collector's commit
        hold = time.time() - arrived
        return {"server_ts": arrived + 0.5 * hold + 100.0, "commands": [],
                "relayed": {"hold_s": hold, "error_s": 0.001}}


def test_a_loopback_client_behind_a_relay_estimates_the_collectors_clock():
    server = serve(_Relayed)
    client = HttpClient(f"http://127.0.0.1:{server.server_address[1]}", None, 2.0)
    try:
        assert client.clock.local is True
        for _ in range(3):
            assert client.post(b"batch").status == "ok"
    finally:
        client.close()
        server.shutdown()
        server.server_close()
    sync = client.clock
    assert sync.local is False and sync.num_samples == 3
    assert sync.error_s < 0.1  # the 0.2 s hold widens nothing: a loopback trip and the relay's 1 ms
    assert abs(sync.offset_s - 100.0) <= sync.error_s + 1e-6
