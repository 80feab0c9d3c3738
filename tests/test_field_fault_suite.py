"""The fault-injection suite (tests/faultkit.py; docs/field-mode.md "Faults and what dropfl does"): one test per
fault, each a small federation (3 agents, logreg, fedavg) with its own private mosquitto, the fault injected
for real (signals, `ip link`, `tc tbf`) once a round is open, and the four invariants checked on the run
directory: every aggregated update really sent by its agent in that round, every drop's reason one the fault
causes (and the fault's own record there, e.g. a broker outage), nothing lost or aggregated twice, and the
model equal to its replay bit for bit. The link faults run the agents in network namespaces (root); the
cluster node kill is in tests/test_field_cluster.py (RabbitMQ). Each test tears down its broker, agents,
coordinator and namespaces.

Where an older test covers the same fault with narrower checks: broker_freeze — test_field_outage.py
test_broker_frozen_with_its_socket_open_is_an_outage_not_dropouts; broker_kill_restart —
test_field_faults.py test_broker_restart_mid_run_everyone_reconnects_and_the_run_completes (a graceful
restart there, SIGKILL here); agent_kill_restart — test_field_faults.py
test_agent_killed_mid_upload_is_a_dropout_and_rejoins_next_round; coordinator_kill_resume — test_field_faults.py
test_coordinator_killed_and_resumed_matches_an_uninterrupted_run; slow_uplink — test_field_slow_link.py."""

from __future__ import annotations

import pytest
from faultkit import SCENARIOS, run_scenario
from fieldkit import needs_mosquitto
from test_netem import needs_netns


def test_an_agents_silence_counts_only_while_the_broker_answers(tmp_path, monkeypatch):
    """registry.py `is_online`: a frozen broker delivers nothing, so every agent falls silent with it; their
    silence counts only up to CONTACT_SLACK_S past the broker's last delivery to the coordinator, so none is
    `offline` before the broker's silence is noticed (BROKER_SILENT_S, outage.py), however short the
    heartbeat timeout. Once the broker answers again, an agent still silent is offline."""
    import time

    from test_field_hub import make_hub

    from coordinator.field.outage import CONTACT_SLACK_S

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    hub = make_hub(tmp_path)                   # statuses and heartbeats at t = 1000
    hub.cfg.heartbeat_timeout_s = 3.0
    a = hub.registry.by_client[0]
    # never connected: the plain timeout
    assert hub.registry.is_online(a, 1002.9) and not hub.registry.is_online(a, 1003.1)
    hub.outage.last_contact = 1000.0           # the broker's last delivery; then it froze
    assert hub.registry.is_online(a, 1000.0 + 3.0 + CONTACT_SLACK_S - 0.01)
    assert hub.registry.is_online(a, 1030.0)   # silent with the broker: not offline
    hub.outage.last_contact = 1029.5           # the broker answers again (its probe's echo); the agent is silent
    assert not hub.registry.is_online(a, 1030.0)


def run(name: str, tmp_path):
    o = run_scenario(SCENARIOS[name], tmp_path)
    print(f"{name}: recorded {o.recorded}, recovered in {o.recover_s} s, {o.wall_s:.0f} s")
    o.assert_held()
    return o


@needs_mosquitto
def test_broker_frozen_is_an_outage_and_nobody_is_dropped(tmp_path):
    """SIGSTOP for 6 s (twice the heartbeat timeout) while round 1 is open: recorded as round 1's broker outage,
    no agent dropped."""
    run("broker_freeze", tmp_path)


@needs_mosquitto
def test_broker_killed_and_restarted_is_an_outage_and_nobody_is_dropped(tmp_path):
    """SIGKILL of mosquitto while round 1 is open (no persistence: everything it held is gone), restarted on the
    same port 2 s later: round 1 waits, its outage recorded; agents reconnect and the round completes."""
    run("broker_kill_restart", tmp_path)


@needs_mosquitto
def test_agent_killed_for_good_is_offline_from_then_on(tmp_path):
    """SIGKILL of agent 1 while it trains round 1, never restarted: `offline` in rounds 1 and 2, nobody else
    dropped, nothing it had not sent aggregated."""
    o = run("agent_kill", tmp_path)
    assert o.recorded["participants"] == [3, 2, 2]


@needs_mosquitto
def test_agent_killed_and_restarted_misses_one_round_at_most(tmp_path):
    """SIGKILL of agent 1 while it trains round 1, restarted at once (as a service manager would): at most
    round 1 is lost to it (`offline`), and it takes part again in round 2."""
    o = run("agent_kill_restart", tmp_path)
    assert o.recorded["participants"][2] == 3


@needs_mosquitto
def test_coordinator_killed_and_resumed_loses_nothing(tmp_path):
    """SIGKILL of the coordinator while round 2 is open, then `--resume`: round 2 is redone, every agent in every
    round, each update aggregated once, the model equal to its replay."""
    o = run("coordinator_kill_resume", tmp_path)
    assert o.exits == [-9, 0] and o.recorded["participants"] == [3, 3, 3, 3]


@needs_mosquitto
@pytest.mark.root
@needs_netns
def test_slow_uplink_is_never_offline(tmp_path):
    """Agent 1's uplink cut to 6 kB/s by `tc tbf` (its update takes longer than the 3 s heartbeat timeout):
    never dropped, aggregated in every round."""
    o = run("slow_uplink", tmp_path)
    assert o.recorded["participants"] == [3, 3, 3]


@needs_mosquitto
@pytest.mark.root
@needs_netns
def test_link_down_then_up_is_offline_then_back(tmp_path):
    """Agent 1's veth down for 6 s (twice the heartbeat timeout) while it trains round 1, then up: `offline` in
    round 1 (it was unreachable), back in round 2 (`--round-wait` gives it the time); its round-1 update, sent
    once the link is back, logged as discarded, never aggregated into another round."""
    o = run("link_down", tmp_path)
    assert o.recorded["participants"] == [3, 2, 3]
