"""dropfl trial supervises its agents as a device's systemd unit does (Restart=on-failure, with a doubling delay):
the rule on short real processes and a hand-driven clock, then a trial whose agent is killed with SIGKILL and comes
back, its earlier trace kept."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from coordinator.trial.supervise import Supervisor


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def exits_with(code: int):
    """A start function whose process exits with `code` at once; counts its starts."""
    starts = []

    def start():
        starts.append(1)
        return subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])
    return start, starts


def killed():
    """A start function whose process is killed with SIGKILL at once (a power cut, the OOM killer)."""
    starts = []

    def start():
        starts.append(1)
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        p.kill()
        return p
    return start, starts


def settle(sup: Supervisor) -> None:
    for p in sup.procs:
        p.wait(timeout=30)


def test_a_failing_agent_is_restarted_with_a_doubling_delay_up_to_the_cap():
    clock = Clock()
    sup = Supervisor("on-failure", delay_s=1.0, max_delay_s=3.0, clock=clock)
    start, starts = exits_with(1)
    sup.add("client-0", start)
    due = []
    for _ in range(4):
        settle(sup)
        sup.poll()                         # notices the exit: a restart is due after the current delay
        a = sup.agents[0]
        due.append(a.due_at - clock.t)
        clock.t = a.due_at - 0.01
        sup.poll()
        assert len(starts) == 1 + len(due) - 1   # not before the delay
        clock.t = a.due_at
        sup.poll()                         # restarted
        assert len(starts) == 1 + len(due)
    assert due == [1.0, 2.0, 3.0, 3.0]     # 1, 2, then capped at max_delay_s
    assert sup.restarts == {"client-0": 4} and sup.agents[0].exits == [1, 1, 1, 1]


def test_a_clean_exit_or_a_refused_config_is_not_restarted_and_no_means_no(caplog):
    for policy, code, restarted in (("on-failure", 0, False), ("on-failure", 2, False), ("on-failure", -9, True),
                                    ("no", 1, False)):
        clock = Clock()
        sup = Supervisor(policy, clock=clock)
        start, starts = killed() if code == -9 else exits_with(code)
        sup.add("client-0", start)
        settle(sup)
        sup.poll()
        clock.t += 100
        sup.poll()
        assert (len(starts) == 2) is restarted, (policy, code)
        assert sup.agents[0].exits[0] == code
    assert "exited with 2 and is not restarted: it refused its config" in caplog.text


def test_the_delay_is_short_again_after_a_stable_run():
    clock = Clock()
    sup = Supervisor("on-failure", delay_s=1.0, max_delay_s=15.0, stable_s=60.0, clock=clock)
    runs = []

    def start():
        runs.append(1)
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)" if len(runs) < 3 else
                                 "import time; time.sleep(30)"])
    sup.add("client-0", start)
    for _ in range(2):
        settle(sup)
        sup.poll()
        clock.t = sup.agents[0].due_at
        sup.poll()
    assert sup.agents[0].delay_s == 4.0          # two restarts: 1 -> 2 -> 4
    clock.t += 61                                 # the third run keeps going past stable_s
    sup.poll()
    assert sup.agents[0].delay_s == 1.0
    sup.procs[0].kill()
    sup.procs[0].wait()


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="policy"):
        Supervisor("always")
    with pytest.raises(ValueError, match="need 0 < delay"):
        Supervisor("on-failure", delay_s=0)


@pytest.mark.mosquitto
def test_a_trial_restarts_an_agent_killed_with_sigkill_and_keeps_its_first_trace(tmp_path):
    """Agent 1 killed with SIGKILL once round 1 is open: the supervisor starts it again (its log says so, its
    first session's trace is kept as trace.1.csv), it takes part again in a later round, and the trial ends with
    exit 0 and every round recorded."""
    from fieldkit import CLI, ROOT

    out = tmp_path / "run"
    # agent 2 spends 0.05 s more per step (--max-slowdown): rounds of ~2 s, time for agent 1 to come back
    cmd = [*CLI, "trial", "--agents", "3", "--rounds", "10", "--dataset", "fmnist", "--model", "logreg",
           "--partition", "iid", "--steps", "40", "--max-slowdown", "0.05", "--deadline", "30", "--profiles", "mains",
           "--out", str(out), "--no-progress", "--restart-delay", "0.5", "--threads", "1"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        log1 = out / "agents" / "client-1" / "agent.log"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:   # round 1 open: metrics.jsonl has round 0
            m = out / "metrics.jsonl"
            if m.exists() and m.read_text().count("\n") >= 1:
                break
            time.sleep(0.2)
        else:
            pytest.fail("round 0 never finished")
        pid = int(subprocess.run(["pgrep", "-f", f"{out}/agents/client-1/agent.json"], capture_output=True,
                                 text=True).stdout.split()[0])
        os.kill(pid, signal.SIGKILL)
        stdout, _ = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, stdout[-2000:]
    assert "restarted by dropfl trial's supervisor" in log1.read_text()
    adir = out / "agents" / "client-1"
    assert (adir / "trace.1.csv").exists() and (adir / "trace.csv").exists()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(10))
    with open(out / "participation.csv", newline="") as f:
        part = [r for r in csv.DictReader(f) if r["client"] == "1" and r["status"] == "participated"]
    assert int(part[-1]["round"]) >= 3, part   # back after the kill
    assert "agents restarted: client-1 1x" in stdout
