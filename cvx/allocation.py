"""FedDD dropout-rate allocation (Feng et al., "FedDD", eqs. 13-17), as a cvxpy LP built once.

The paper's problem (eq. 14-15), in its epigraph form (eq. 16-17), with D_n the fraction of client
n's model NOT uploaded next round:

    min_{D, T}  T + δ Σ_n re_n D_n
    s.t.        0 <= D_n <= D_max                                    for every n
                Σ_n U_n (1 − D_n) = A_server Σ_n U_n                 (upload budget, an equality)
                t_n^cmp + U_n (1 − D_n) (1/r_n^u + 1/r_n^d) <= T     for every n   (T >= eq. 12)
    re_n = (m_n / m) · q_n · (U_n / U) · loss_n                                    (eq. 13)

Units: times in seconds, sizes in bytes, rates in bytes/s. δ is in seconds per unit of re (the
paper's trade-off between round time and the regulariser).

The problem is built once per client count with `cp.Parameter`s and re-solved every round
(DPP: cvxpy caches the canonicalisation). For conditioning, the parameters hold the data scaled by
T0 = max_n(t_n^cmp + a_n), the modelled round time at D = 0 (a_n = U_n (1/r^u + 1/r^d)), and the
budget row is normalised by Σ U_n. Dividing an objective by a positive constant does not move its
minimiser, so this is the same problem. δ·re enters as one parameter (a product of two parameters
is not DPP).

Invalid or infeasible inputs raise `AllocationError` (a ValueError) naming the input. If the solver
fails, `solve` falls back to the uniform rule D_n = 1 − A_server for every client (always feasible
when the inputs are valid: it meets the budget exactly whatever the U_n) and logs a warning.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import cvxpy as cp
import numpy as np

log = logging.getLogger(__name__)

OK_STATUSES = (cp.OPTIMAL, cp.OPTIMAL_INACCURATE)
BUDGET_TOL = 1e-5  # max |Σ u_n (1 − D_n) − A_server| accepted from the solver (u = U / ΣU)


class AllocationError(ValueError):
    """Invalid or infeasible allocation inputs; `input` names the offending one."""

    def __init__(self, input: str, message: str):
        super().__init__(f"{input}: {message}")
        self.input = input


@dataclass(frozen=True)
class AllocationInputs:
    """Everything the allocation of one round depends on (arrays have one entry per client)."""

    compute_s: np.ndarray     # t_n^cmp: seconds of local training per round (measured)
    up_rate: np.ndarray       # r_n^u: uplink bytes/s (measured)
    down_rate: np.ndarray     # r_n^d: downlink bytes/s (measured)
    model_bytes: np.ndarray   # U_n: bytes of client n's full (dense) model
    global_bytes: float       # U: bytes of the global model (U >= U_n)
    num_samples: np.ndarray   # m_n
    label_score: np.ndarray   # q_n = Σ_c min(C · dis_n^c, 1), in [1, C]
    loss: np.ndarray          # loss_n^t, the last reported training loss
    delta: float = 0.0        # δ >= 0, penalty factor
    d_max: float = 0.8        # D_max in [0, 1]
    a_server: float = 0.6     # A_server in [1 − D_max, 1]


@dataclass(frozen=True)
class Allocation:
    dropout: np.ndarray       # D_n for the next round, in [0, D_max]
    round_time: float         # modelled round time max_n(...) at that D (eq. 12), seconds
    objective: float          # T + δ Σ re_n D_n, seconds
    status: str               # cvxpy status, or "fallback"
    fallback: str | None      # None, or why the uniform rule was used
    solve_s: float            # wall time of problem.solve


def regulariser(inp: AllocationInputs) -> np.ndarray:
    """FedDD eq. (13): re_n = (m_n/m) · q_n · (U_n/U) · loss_n."""
    m = np.asarray(inp.num_samples, float)
    return (m / m.sum()) * inp.label_score * (inp.model_bytes / inp.global_bytes) * inp.loss


def client_times(inp: AllocationInputs, dropout: np.ndarray) -> np.ndarray:
    """FedDD eqs. (7), (9), (11): t_n^cmp + U_n (1 − D_n)/r_n^u + U_n (1 − D_n)/r_n^d."""
    kept = inp.model_bytes * (1.0 - dropout)
    return inp.compute_s + kept / inp.up_rate + kept / inp.down_rate


def uniform_fallback(n: int, a_server: float) -> np.ndarray:
    """The fallback rule: every client drops 1 − A_server (meets the budget for any U_n)."""
    return np.full(n, 1.0 - a_server)


def validate(inp: AllocationInputs, n: int) -> None:
    """Raise AllocationError naming the first invalid or infeasible input."""
    arrays = {"compute_s": inp.compute_s, "up_rate": inp.up_rate, "down_rate": inp.down_rate,
              "model_bytes": inp.model_bytes, "num_samples": inp.num_samples, "label_score": inp.label_score,
              "loss": inp.loss}
    for name, v in arrays.items():
        a = np.asarray(v, float)
        if a.shape != (n,):
            raise AllocationError(name, f"expected shape ({n},), got {a.shape}")
        if not np.isfinite(a).all():
            bad = np.flatnonzero(~np.isfinite(a))[:5].tolist()
            raise AllocationError(name, f"must be finite (NaN/inf at clients {bad})")
    for name in ("up_rate", "down_rate", "model_bytes"):
        bad = np.flatnonzero(np.asarray(arrays[name], float) <= 0)
        if bad.size:
            raise AllocationError(name, f"must be > 0 (clients {bad[:5].tolist()})")
    for name in ("compute_s", "num_samples", "label_score", "loss"):
        bad = np.flatnonzero(np.asarray(arrays[name], float) < 0)
        if bad.size:
            raise AllocationError(name, f"must be >= 0 (clients {bad[:5].tolist()})")
    if np.sum(inp.num_samples) <= 0:
        raise AllocationError("num_samples", "must not all be 0")
    for name in ("global_bytes", "delta", "d_max", "a_server"):
        if not np.isfinite(getattr(inp, name)):
            raise AllocationError(name, "must be finite")
    if inp.global_bytes < np.max(inp.model_bytes):
        raise AllocationError("global_bytes", f"U = {inp.global_bytes} is smaller than max U_n = "
                                              f"{np.max(inp.model_bytes)} (the paper has U >= U_n)")
    if inp.delta < 0:
        raise AllocationError("delta", f"must be >= 0, got {inp.delta}")
    if not 0.0 <= inp.d_max <= 1.0:
        raise AllocationError("d_max", f"must be in [0, 1], got {inp.d_max}")
    if not 1.0 - inp.d_max <= inp.a_server <= 1.0:
        raise AllocationError("a_server", f"infeasible: A_server = {inp.a_server} must be in "
                                          f"[1 − D_max, 1] = [{1.0 - inp.d_max:g}, 1]")


class DropoutAllocator:
    """The allocation LP for `n_clients`, canonicalised on the first solve, re-solved every round.

    Args:
        n_clients: N, fixed for the allocator's life (one entry per client in every input).
        solver: cvxpy solver name (CLARABEL by default; HIGHS also solves it exactly).
        solver_opts: extra keyword arguments for `problem.solve`.
    """

    def __init__(self, n_clients: int, *, solver: str = "CLARABEL", solver_opts: dict | None = None):
        if n_clients < 1:
            raise AllocationError("n_clients", f"must be >= 1, got {n_clients}")
        self.n, self.solver, self.solver_opts = n_clients, solver, dict(solver_opts or {})
        n = n_clients
        self.t_cmp = cp.Parameter(n, nonneg=True, name="t_cmp")      # t_n^cmp / T0
        self.a = cp.Parameter(n, nonneg=True, name="a")              # U_n (1/r^u + 1/r^d) / T0
        self.w = cp.Parameter(n, nonneg=True, name="delta_re")       # δ re_n / T0
        self.u = cp.Parameter(n, nonneg=True, name="u")              # U_n / Σ U
        self.d_max = cp.Parameter(nonneg=True, name="d_max")
        self.a_server = cp.Parameter(nonneg=True, name="a_server")
        self.D = cp.Variable(n, name="D")
        self.T = cp.Variable(name="t_server")
        constraints = [
            self.D >= 0, self.D <= self.d_max,                                 # eq. (17): 0 <= D_n <= D_max
            self.u @ (1 - self.D) == self.a_server,                            # eq. (17): upload budget
            self.t_cmp + cp.multiply(self.a, 1 - self.D) <= self.T,            # eq. (17): epigraph of eq. (12)
        ]
        self.problem = cp.Problem(cp.Minimize(self.T + self.w @ self.D), constraints)  # eq. (16)
        assert self.problem.is_dpp(), "the allocation problem must be DPP to be re-solved cheaply"

    def solve(self, inp: AllocationInputs) -> Allocation:
        validate(inp, self.n)
        U = np.asarray(inp.model_bytes, float)
        a = U * (1.0 / np.asarray(inp.up_rate, float) + 1.0 / np.asarray(inp.down_rate, float))
        t_cmp = np.asarray(inp.compute_s, float)
        t0 = float(np.max(t_cmp + a))                     # round time at D = 0; > 0 since a_n > 0
        self.t_cmp.value, self.a.value = t_cmp / t0, a / t0
        self.w.value = inp.delta * regulariser(inp) / t0
        self.u.value = U / U.sum()
        self.d_max.value, self.a_server.value = float(inp.d_max), float(inp.a_server)
        start = time.perf_counter()
        fallback = None
        try:
            self.problem.solve(solver=self.solver, **self.solver_opts)
            status = self.problem.status
        except cp.error.SolverError as e:
            status, fallback = "solver_error", f"solver {self.solver} failed: {e}"
        seconds = time.perf_counter() - start
        dropout = None
        if fallback is None:
            if status not in OK_STATUSES or self.D.value is None:
                fallback = f"solver {self.solver} returned status {status!r}"
            else:
                dropout = np.clip(self.D.value, 0.0, inp.d_max)
                residual = abs(float(self.u.value @ (1.0 - dropout)) - inp.a_server)
                if residual > BUDGET_TOL:
                    fallback = f"solver {self.solver} ({status}) misses the upload budget by {residual:.2e}"
        if fallback is not None:
            log.warning("FedDD allocation: %s; using the uniform rule D_n = 1 − A_server = %g",
                        fallback, 1.0 - inp.a_server)
            dropout, status = uniform_fallback(self.n, inp.a_server), "fallback"
        round_time = float(np.max(client_times(inp, dropout)))
        objective = round_time + inp.delta * float(regulariser(inp) @ dropout)
        return Allocation(dropout, round_time, objective, status, fallback, seconds)
