"""Link emulation (coordinator/field/netem.py): link files, and — as root with `ip netns` — that a tbf rate
limit really limits a transfer through the veth, and that a trace's outage produces an `offline` or
`deadline` dropout in a field run. The root tests create and delete their own namespaces."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
from fieldkit import CLI, ROOT, Watcher, kill_group, participants

from coordinator.availability.participation import read_rows
from coordinator.errors import UserError
from coordinator.field import netem
from coordinator.rundir import read_metrics
from coordinator.trial.broker import Mosquitto


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


needs_netns = pytest.mark.skipif(_netns_usable() is not None, reason=str(_netns_usable()))


def test_profiles_json_csv_and_trace(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"agents": [{"agent": 1, "up_Bps": 2e4, "down_Bps": 1e5},
                                                            {"agent": 0, "up_Bps": 4e5, "down_Bps": 1e6}]}))
    plan = netem.load_links(tmp_path / "p.json", 2)
    assert plan.up_Bps == [4e5, 2e4] and plan.down_Bps == [1e6, 1e5] and plan.online == [True, True]
    assert plan.events == []
    (tmp_path / "p.csv").write_text("agent,up_Bps,down_Bps\n0,1000,2000\n1,3000,4000\n")
    assert netem.load_links(tmp_path / "p.csv", 2).up_Bps == [1000.0, 3000.0]
    (tmp_path / "t.csv").write_text(
        "device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps\n"
        "client-0,0,1,,,1000,8000\nclient-1,0,1,,,2000,9000\nclient-1,5,0,,,,\nclient-1,9,1,,,500,\n"
        "client-0,7,,,,3000,\n")
    plan = netem.load_links(tmp_path / "t.csv", 2)
    assert plan.up_Bps == [1000.0, 2000.0] and plan.down_Bps == [8000.0, 9000.0]
    assert [(e.t_s, e.agent, e.online, e.up_Bps, e.down_Bps) for e in plan.events] == [
        (5.0, 1, False, None, None), (7.0, 0, None, 3000.0, None), (9.0, 1, True, 500.0, None)]


def test_bad_link_files_are_named(tmp_path):
    (tmp_path / "short.csv").write_text("agent,up_Bps,down_Bps\n0,1000,2000\n")
    with pytest.raises(UserError, match=r"no link for agents \[1\]"):
        netem.load_links(tmp_path / "short.csv", 2)
    (tmp_path / "zero.csv").write_text("agent,up_Bps,down_Bps\n0,0,2000\n")
    with pytest.raises(UserError, match="agent 0 up_Bps must be a finite rate > 0"):
        netem.load_links(tmp_path / "zero.csv", 1)
    (tmp_path / "cols.csv").write_text("client,rate\n0,1\n")
    with pytest.raises(UserError, match="expected columns agent,up_Bps,down_Bps"):
        netem.load_links(tmp_path / "cols.csv", 1)
    with pytest.raises(UserError, match="cannot read"):
        netem.load_links(tmp_path / "missing.json", 1)


def _receive_rate(srv: socket.socket, out: dict) -> None:
    """Accept one connection and measure its bytes/s from the first to the last byte received."""
    conn, _ = srv.accept()
    n, first = 0, None
    while chunk := conn.recv(65536):
        first = first or time.perf_counter()
        n += len(chunk)
    out["rate"], out["bytes"] = n / (time.perf_counter() - first), n
    conn.close()


@needs_netns
def test_tbf_limits_the_rate_in_each_direction():
    up, down, n_bytes = 40_000.0, 160_000.0, 160_000
    with netem.Links(netem.LinkPlan([up], [down], [True])) as links:
        assert links.ns(0) in netem.namespaces()
        # uplink: a sender inside the namespace, the receiver on the host end
        srv = socket.create_server((links.host_address(0), 0))
        got: dict = {}
        th = threading.Thread(target=_receive_rate, args=(srv, got))
        th.start()
        send = (f"import socket; s = socket.create_connection(('{links.host_address(0)}', "
                f"{srv.getsockname()[1]})); s.sendall(b'x' * {n_bytes}); s.close()")
        subprocess.run(links.exec_prefix(0) + [sys.executable, "-c", send], check=True, timeout=60)
        th.join(timeout=60)
        srv.close()
        assert got["bytes"] == n_bytes
        assert up / 2 < got["rate"] < up * 2, got  # the mechanism works (not a performance check)
        # downlink: the receiver inside the namespace, the sender on the host
        recv = ("import socket, time; srv = socket.create_server(('0.0.0.0', 0)); print(srv.getsockname()[1], "
                "flush=True); c, _ = srv.accept(); n = 0; t = None\n"
                "while b := c.recv(65536):\n    t = t or time.perf_counter(); n += len(b)\n"
                "print(n, n / (time.perf_counter() - t), flush=True)")
        p = subprocess.Popen(links.exec_prefix(0) + [sys.executable, "-c", recv], stdout=subprocess.PIPE, text=True)
        port = int(p.stdout.readline())
        with socket.create_connection((links.agent_address(0), port)) as s:
            s.sendall(b"y" * 4 * n_bytes)
        n, rate = p.stdout.readline().split()
        p.wait(timeout=30)
        assert int(n) == 4 * n_bytes and down / 2 < float(rate) < down * 2, (n, rate)
    assert links.ns(0) not in netem.namespaces()  # torn down


@needs_netns
def test_teardown_on_failure_and_stale_cleanup():
    plan = netem.LinkPlan([1e5], [1e5], [True])
    with pytest.raises(RuntimeError, match="boom"):
        with netem.Links(plan) as links:
            name = links.ns(0)
            raise RuntimeError("boom")
    assert name not in netem.namespaces()
    stale = f"{netem.NS_PREFIX}999999999-0"  # an owner pid that cannot exist
    subprocess.run(["ip", "netns", "add", stale], check=True)
    assert stale in netem.cleanup() and stale not in netem.namespaces()


@needs_netns
def test_trace_outage_drops_the_agent_as_offline_or_deadline(tmp_path):
    # agent 1's link goes down at trace time 0 (the clock is started once round 0 is complete) for good
    plan = netem.LinkPlan([200_000.0, 200_000.0], [1e6, 1e6], [True, True],
                          [netem.LinkEvent(0.0, 1, online=False)])
    procs: list[subprocess.Popen] = []
    with netem.Links(plan) as links, Mosquitto(workdir=tmp_path / "broker", hosts=links.hosts) as broker:
        watcher = Watcher(broker.port)
        try:
            for i in range(2):
                cfg = {"agent": {"client": i, "broker": f"mqtt://{links.host_address(i)}:{broker.port}",
                                 "heartbeat_s": 0.3, "out": str(tmp_path / f"client-{i}")},
                       "data": {"dataset": "fmnist", "partition": "iid", "clients": 2, "seed": 1},
                       "model": {"model": "logreg"}, "battery": {"source": "mains"}}
                path = tmp_path / f"client-{i}.json"
                path.write_text(json.dumps(cfg))
                with open(tmp_path / f"client-{i}.log", "w") as log:
                    procs.append(subprocess.Popen(links.exec_prefix(i) + CLI + ["client", "--config", str(path)],
                                                  stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                                  start_new_session=True))
            out = tmp_path / "run"
            cmd = CLI + ["coordinator", "--broker", broker.url, "--out", str(out), "--rounds", "6", "--algo",
                         "fedavg", "--clients", "2", "--model", "logreg", "--partition", "iid", "--seed", "1",
                         "--steps", "2", "--threads", "1", "--deadline", "20", "--heartbeat-timeout", "2",
                         "--no-progress"]
            with open(tmp_path / "coordinator.log", "w") as log:
                coord = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            procs.append(coord)
            watcher.wait_for(lambda topic, h: topic == "dropfl/v1/device/client-1/update/stats" and h.round == 0,
                             timeout=90)
            links.start_clock()
            assert coord.wait(timeout=90) == 0
        finally:
            watcher.close()
            for p in procs:
                kill_group(p)
    assert [e.agent for _, e in links.applied] == [1]
    rows = read_rows(out / "participation.csv")
    agent1 = [(r["status"], r["reason"]) for r in rows if r["client"] == "1"]
    assert agent1[0] == ("participated", "")
    assert agent1[-1] == ("unavailable", "offline")  # the link never came back
    assert all(reason in ("", "offline", "deadline") for _, reason in agent1)
    assert all(r["status"] == "participated" for r in rows if r["client"] == "0")


# --- resuming a trial with emulated links: the trace goes on where it stopped ---


def test_the_clock_starts_at_a_trace_time_and_catches_up_in_order(monkeypatch):
    """start_clock(from_s): the events before from_s are applied at once, in trace order, and recorded at
    about from_s; the later ones wait for their time (no root: `apply` is recorded instead of run)."""
    plan = netem.LinkPlan([1e5, 1e5], [1e6, 1e6], [True, True],
                          [netem.LinkEvent(1.0, 0, up_Bps=2e5), netem.LinkEvent(2.0, 1, online=False),
                           netem.LinkEvent(3600.0, 0, online=False)])
    done: list[netem.LinkEvent] = []
    monkeypatch.setattr(netem.Links, "apply", lambda self, e: done.append(e))
    links = netem.Links(plan)
    assert links.trace_time() is None
    links.start_clock(from_s=50.0)
    deadline = time.monotonic() + 10
    while len(done) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == plan.events[:2]                                   # the past, in order; not the 1-hour event
    assert [round(at) for at, _ in links.applied] == [50, 50] and links.clock_from_s == 50.0
    assert 50.0 <= links.trace_time() < 60.0
    links._stop.set()


def test_the_links_record_keeps_every_session(tmp_path):
    from coordinator.trial.run import _links_record, _write_links_record

    class Net:  # what _write_links_record reads of a Links
        def __init__(self, plan, applied, from_s, now):
            self.plan, self.applied, self.clock_from_s, self._now = plan, applied, from_s, now

        def trace_time(self):
            return self._now

    plan = netem.LinkPlan([1e5], [1e6], [True], [netem.LinkEvent(1.0, 0, online=False)])
    assert _links_record(tmp_path) == {}
    _write_links_record(tmp_path, Net(plan, [(1.01, plan.events[0])], 0.0, 12.5), {})
    first = _links_record(tmp_path)
    assert first["clock_s"] == 12.5 and first["sessions"] == [{"from_s": 0.0, "to_s": 12.5}]
    _write_links_record(tmp_path, Net(plan, [(12.5, plan.events[0])], 12.5, 20.0), first)
    both = json.loads((tmp_path / "links.json").read_text())
    assert both["sessions"] == [{"from_s": 0.0, "to_s": 12.5}, {"from_s": 12.5, "to_s": 20.0}]
    assert [a["at_s"] for a in both["applied"]] == [1.01, 12.5] and both["clock_s"] == 20.0
    assert both["agents"] == plan.to_json()["agents"] and not (tmp_path / "links.json.tmp").exists()
    (tmp_path / "links.json").write_text("{not json")
    with pytest.raises(UserError, match="links.json is damaged"):
        _links_record(tmp_path)


@needs_netns
def test_trial_resume_with_links_goes_on_with_the_trace(tmp_path):
    """A trial behind emulated links loses its broker after round 1 and stops (exit 1); `dropfl trial
    --resume` builds the links again and goes on with the trace from the time the first session reached:
    the agent-1 rate change at trace time 1 s is in force again (applied at once), the 1-hour outage is still
    ahead, the record keeps both sessions, and the run finishes all its rounds with everyone."""
    from test_field_outage import _trial_cmd, stop_by_broker_loss

    trace = tmp_path / "links.csv"
    trace.write_text("device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps\n"
                     + "".join(f"client-{i},0,1,,,2000000,2000000\n" for i in range(3))
                     + "client-1,1,,,,1000000,\nclient-0,3600,0,,,,\n")
    out = tmp_path / "run"
    stop_by_broker_loss(_trial_cmd(out, "--links", str(trace), "--broker-outage-timeout", "3"))
    first = json.loads((out / "links.json").read_text())
    assert len(first["sessions"]) == 1 and first["clock_s"] > 1.0
    assert [(a["agent"], a["up_Bps"]) for a in first["applied"]] == [(1, 1000000.0)]

    resumed = subprocess.run(CLI + ["trial", "--resume", str(out), "--no-progress"], cwd=ROOT, capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:] + (out / "coordinator.log").read_text()[-3000:]
    rec = json.loads((out / "links.json").read_text())
    s1, s2 = rec["sessions"]
    assert s1 == first["sessions"][0] and s2["from_s"] == first["clock_s"] and rec["clock_s"] == s2["to_s"]
    assert rec["applied"][0] == first["applied"][0]                        # the first session's record is kept
    again = rec["applied"][1:]
    assert [(a["agent"], a["up_Bps"]) for a in again] == [(1, 1000000.0)]  # in force again, at once
    assert abs(again[0]["at_s"] - first["clock_s"]) < 5
    rounds = [m["round"] for m in read_metrics(out / "metrics.jsonl")]
    assert rounds == [0, 1, 2, 3]
    assert {t for t, who in participants(out / "participation.csv").items() if who == {0, 1, 2}} == {0, 1, 2, 3}
    assert netem.namespaces() == []
