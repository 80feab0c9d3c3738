"""Simulation: the in-process transport (`transport.py`), the batched engine that trains a round's clients as
one computation (`batched.py`) with its native kernels (`kernels/`), FedDD's simulated clients and virtual
clock (`clock.py`), and `run.py`, which runs a simulation."""
