"""A trial's agents supervised as a device's service manager supervises its agent.

On a device, systemd runs the agent with `Restart=on-failure` (provisioning/dropfl-agent.service): an agent that
crashes or is killed comes back after a delay, one that exits cleanly (the run finished, or a signal it handled)
stays down. `dropfl trial --restart-agents on-failure` (the default) does the same for its agents, so a trial
behaves like a deployment: a killed agent rejoins, as a device would after a crash or a power cut.

The rule, one agent at a time:
- exit 0 (finished, or stopped by SIGTERM/SIGINT, which the agent handles): not restarted;
- exit 2 (the agent refused its own config: restarting cannot help): not restarted, said once;
- anything else (an uncaught error, killed by a signal such as SIGKILL): restarted after the current delay. The
  delay starts at `delay_s` and doubles after each restart up to `max_delay_s` (15 s: the unit's `RestartSec`);
  it is back to `delay_s` once an agent has run `stable_s` without failing.
Each restart is a line in the agent's log and the trial's log, and counted in `restarts`.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("dropfl.trial")

POLICIES = ("on-failure", "no")
NOT_RESTARTED = {0: "it exited cleanly", 2: "it refused its config (exit 2); fix agent.json"}


@dataclass
class Supervised:
    """One agent: how to start it, its current process, and its restart bookkeeping."""
    name: str
    start: Callable[[], subprocess.Popen]
    proc: subprocess.Popen
    started_at: float
    restarts: int = 0
    delay_s: float = 0.0
    due_at: float | None = None     # when the pending restart happens (None: none pending)
    exits: list[int] = field(default_factory=list)
    done: bool = False              # not restarted again (a clean exit or exit 2)


class Supervisor:
    """Call `poll()` often (every ~0.2 s) while the trial runs; `procs` are the agents' current processes."""

    def __init__(self, policy: str = "on-failure", delay_s: float = 1.0, max_delay_s: float = 15.0,
                 stable_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
        if not 0 < delay_s <= max_delay_s:
            raise ValueError(f"delays {delay_s}, {max_delay_s}: need 0 < delay <= max delay")
        self.policy, self.delay_s, self.max_delay_s, self.stable_s = policy, delay_s, max_delay_s, stable_s
        self.clock = clock
        self.agents: list[Supervised] = []

    def add(self, name: str, start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        proc = start()
        self.agents.append(Supervised(name, start, proc, self.clock(), delay_s=self.delay_s))
        return proc

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [a.proc for a in self.agents]

    @property
    def restarts(self) -> dict[str, int]:
        return {a.name: a.restarts for a in self.agents if a.restarts}

    def poll(self) -> None:
        now = self.clock()
        for a in self.agents:
            if a.done:
                continue
            rc = a.proc.poll()
            if rc is None:
                if now - a.started_at >= self.stable_s:
                    a.delay_s = self.delay_s   # it has run long enough: the next failure restarts quickly
                continue
            if a.due_at is None:
                a.exits.append(rc)
                if self.policy == "no" or rc in NOT_RESTARTED:
                    a.done = True
                    if rc != 0:
                        log.warning("agent %s exited with %d and is not restarted: %s", a.name, rc,
                                    NOT_RESTARTED.get(rc, "--restart-agents no"))
                    continue
                a.due_at = now + a.delay_s
                log.info("agent %s exited with %d; restarting it in %.1f s (--restart-agents on-failure)",
                         a.name, rc, a.delay_s)
            if now >= a.due_at:
                a.proc = a.start()
                a.restarts += 1
                a.started_at, a.due_at = now, None
                a.delay_s = min(2 * a.delay_s, self.max_delay_s)
                log.info("agent %s restarted (restart %d)", a.name, a.restarts,
                         extra={"fields": {"agent": a.name, "restarts": a.restarts, "exit": a.exits[-1]}})
