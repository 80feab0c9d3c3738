"""dropfl edge agent: runs on a Raspberry Pi / Jetson (or a process here).

Never imports `coordinator` or `cvxpy`. Shared pieces (datasets, partitions, models,
local training, wire format) live here and the coordinator imports them.
"""
