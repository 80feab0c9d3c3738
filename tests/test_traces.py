import pickle

import pytest

from coordinator.availability.traces import DeviceTraceAvailability, import_fedscale, read_device_trace
from coordinator.errors import UserError

TRACE = """device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps
0,0,1,90,0,100000,
0,120,1,15,0,,
1,0,0,,,,
1,60,1,50,1,,
2,0,1,80,0,1000,
"""


def test_device_trace_virtual_clock(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text(TRACE)
    m = DeviceTraceAvailability(p, 3, round_s=60, min_battery=20, min_uplink_Bps=5000)
    r0, r1, r2 = m.round(0), m.round(1), m.round(2)
    assert r0.available.tolist() == [True, False, False]
    assert r0.reasons == {1: "offline", 2: "slow_link"}
    assert r1.available.tolist() == [True, True, False]
    assert r2.available.tolist() == [False, True, False] and r2.reasons[0] == "battery"
    charging = DeviceTraceAvailability(p, 3, round_s=60, require_charging=True)
    assert charging.round(1).reasons == {0: "charging", 2: "charging"}


def test_device_trace_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("device,t\n0,1\n")
    with pytest.raises(UserError, match="lacks columns"):
        read_device_trace(bad)
    p = tmp_path / "ok.csv"
    p.write_text(TRACE)
    with pytest.raises(UserError, match="fewer than --clients"):
        DeviceTraceAvailability(p, 5, round_s=60)


def test_fedscale_import_matches_fedscale_rule(tmp_path):
    data = {1: {"active": [10, 50], "inactive": [20, 70], "finish_time": 100},
            2: {"active": [0], "inactive": [90], "finish_time": 100}}
    pkl = tmp_path / "client_behave_trace"
    pkl.write_bytes(pickle.dumps(data))
    out = tmp_path / "trace.csv"
    assert import_fedscale(pkl, out, horizon_s=200) == 2
    m = DeviceTraceAvailability(out, 2, round_s=5)

    def fedscale_online(tr, t):  # FedScale: active[k] ≤ t mod T ≤ inactive[k]
        n = t % tr["finish_time"]
        return any(a <= n <= b for a, b in zip(tr["active"], tr["inactive"]))

    for t in range(40):
        got = m.round(t).available
        assert got.tolist() == [fedscale_online(data[1], 5 * t), fedscale_online(data[2], 5 * t)], t


def test_fedscale_import_rejects_garbage(tmp_path):
    p = tmp_path / "x.pkl"
    p.write_bytes(b"garbage")
    with pytest.raises(UserError, match="not a pickled FedScale trace"):
        import_fedscale(p, tmp_path / "o.csv")


def test_fedscale_import_checks_everything_before_writing(tmp_path):
    """A bad device after a good one, a horizon of a billion seconds and an existing output are refused
    with one line, before anything is written; an existing output is replaced only with overwrite."""
    good = {"active": [10], "inactive": [20], "finish_time": 100}
    pkl = tmp_path / "t.pkl"
    out = tmp_path / "trace.csv"
    pkl.write_bytes(pickle.dumps({0: good, 1: {"active": [1], "inactive": []}}))
    with pytest.raises(UserError, match="client 1 lacks"):
        import_fedscale(pkl, out)
    pkl.write_bytes(pickle.dumps({0: good, 1: {"active": [float("nan")], "inactive": [5], "finish_time": 100}}))
    with pytest.raises(UserError, match="client 1: .* must be finite"):
        import_fedscale(pkl, out)
    pkl.write_bytes(pickle.dumps({i: good for i in range(3)}))
    with pytest.raises(UserError, match=r"to --horizon 1e\+09 s gives up to 90,000,000 rows \(limit 50,000,000\)"):
        import_fedscale(pkl, out, horizon_s=1e9)   # 3 devices × 1e7 periods × 3 rows: refused, not ground through
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.pkl"]   # nothing written, no temporary left
    assert import_fedscale(pkl, out, horizon_s=300, max_rows=27) == 3  # 3 × 3 periods × (off, on, off) = 27
    first = out.read_text()
    assert len(first.splitlines()) == 1 + 27
    with pytest.raises(UserError, match="exists; choose another output file or pass --overwrite"):
        import_fedscale(pkl, out, horizon_s=100)
    assert out.read_text() == first
    assert import_fedscale(pkl, out, horizon_s=100, overwrite=True) == 3 and out.read_text() != first
    with pytest.raises(UserError, match="limit 26"):
        import_fedscale(pkl, tmp_path / "other.csv", horizon_s=300, max_rows=26)
