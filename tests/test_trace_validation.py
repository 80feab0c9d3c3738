"""Traces are checked completely when they are loaded: a bad replay log or device trace is a one-line
error naming the file, line (or round) and value, raised before a run directory exists."""

import pytest

from coordinator.availability.participation import Replay
from coordinator.availability.traces import DeviceTraceAvailability
from coordinator.cli import main
from coordinator.errors import UserError
from edge_client.battery import BatteryError, Reading, TraceBattery

SIM = ["sim", "--dataset", "fmnist", "--clients", "2", "--model", "logreg", "--steps", "1", "--batch-size", "8",
       "--rounds", "2", "--no-progress"]
HEADER = "device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps\n"


def _log(tmp_path, rounds, n=2, extra=""):
    p = tmp_path / "participation.csv"
    p.write_text("round,client,status,reason\n"
                 + "".join(f"{t},{c},participated,\n" for t in rounds for c in range(n)) + extra)
    return p


def test_replay_trace_with_a_missing_round_is_refused_before_the_run(tmp_path, capsys):
    trace = _log(tmp_path, [0, 1, 3])
    out = tmp_path / "run"
    assert main([*SIM, "--availability", "replay", "--trace", str(trace), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "lacks round 2" in err and str(trace) in err
    assert not out.exists()


def test_replay_missing_rounds_are_all_named(tmp_path):
    with pytest.raises(UserError, match=r"lacks rounds 0, 2\.\.4"):
        Replay(_log(tmp_path, [1, 5]), 2)


@pytest.mark.parametrize("extra,needle", [
    ("2,5,participated,\n", r"participation.csv:6: column 'client': client 5 is outside 0\.\.1"),
    ("2,-1,participated,\n", r"participation.csv:6: column 'client': -1 is negative"),
    ("2,one,participated,\n", r"participation.csv:6: column 'client': 'one' is not an integer"),
    ("2.0,0,participated,\n", r"participation.csv:6: column 'round': '2.0' is not an integer"),
    ("1,0,unavailable,battery\n", r"participation.csv:6: round 1, client 0 again \(first on line 4\)"),
    ("2,0,gone,\n", r"participation.csv:6: column 'status': unknown status 'gone'"),
    ("2,0,unavailable,sleepy\n", r"participation.csv:6: column 'reason': unknown reason 'sleepy'"),
    ("2,0\n", r"participation.csv:6: the row has 2 fields, the header 4"),
    ("2,0,participated,\n", r"round 2 has no row for client 1 \(--clients 2\)"),
])
def test_replay_bad_rows_name_file_line_and_column(tmp_path, extra, needle):
    with pytest.raises(UserError, match=needle):
        Replay(_log(tmp_path, [0, 1], extra=extra), 2)


def test_replay_bad_client_id_via_the_cli(tmp_path, capsys):
    trace = _log(tmp_path, [0, 1], n=3)  # recorded with 3 clients, replayed with 2
    out = tmp_path / "run"
    assert main([*SIM, "--availability", "replay", "--trace", str(trace), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "participation.csv:4: column 'client': client 2 is outside 0..1 (--clients 2)" in err
    assert not out.exists()


@pytest.mark.parametrize("cell", ["nan", "NaN", "-1", "150", "inf"])
def test_bad_battery_is_refused_by_the_coordinator_and_the_agent(tmp_path, cell):
    p = tmp_path / "trace.csv"
    p.write_text(HEADER + "a,0,1,80,0,,\n" + f"b,0,1,{cell},0,,\n")
    needle = rf"trace.csv:3: column 'battery_pct': '{cell}' is not a level in 0\.\.100 %"
    with pytest.raises(UserError, match=needle):
        DeviceTraceAvailability(p, 2, round_s=60, min_battery=20)
    with pytest.raises(BatteryError, match=needle):
        TraceBattery(p, "b")
    with pytest.raises(BatteryError, match=needle):  # the whole file is checked, not only this device's rows
        TraceBattery(p, "a")


def test_bad_battery_is_refused_before_the_sim_run(tmp_path, capsys):
    p = tmp_path / "trace.csv"
    p.write_text(HEADER + "0,0,1,80,0,,\n1,0,1,nan,0,,\n")
    out = tmp_path / "run"
    assert main([*SIM, "--availability", "device-trace", "--device-trace", str(p), "--round-seconds", "60",
                 "--min-battery", "20", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trace.csv:3: column 'battery_pct': 'nan'" in err
    assert not out.exists()


@pytest.mark.parametrize("row,needle", [
    ("b,-5,1,50,0,,", r"column 't_s': '-5' is not a finite time"),
    ("b,inf,1,50,0,,", r"column 't_s': 'inf' is not a finite time"),
    ("b,,1,50,0,,", r"column 't_s' is empty"),
    ("b,0,1,50,0,-1,", r"column 'uplink_Bps': '-1' is not a finite rate"),
    ("b,0,1,50,0,,nan", r"column 'downlink_Bps': 'nan' is not a finite rate"),
    ("b,0,yes,50,0,,", r"column 'online': 'yes' is not a number"),
    ("b,0,1,50,2,,", r"column 'charging': '2' is not 0 or 1"),
    (",0,1,50,0,,", r"column 'device' is empty"),
    ("b,0,1,50", r"the row has 4 fields, the header 7"),
])
def test_bad_times_rates_flags_and_ids_are_refused(tmp_path, row, needle):
    p = tmp_path / "trace.csv"
    p.write_text(HEADER + "a,0,1,80,0,,\n" + row + "\n")
    with pytest.raises(UserError, match="trace.csv:3: " + needle):
        DeviceTraceAvailability(p, 1, round_s=60)
    with pytest.raises(BatteryError, match="trace.csv:3: " + needle):
        TraceBattery(p, "a")


def test_devices_that_are_the_same_number_are_refused(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text(HEADER + "1,0,1,80,0,,\n01,0,1,80,0,,\n")
    with pytest.raises(UserError, match=r"trace.csv:3: device '01' and device '1' \(line 2\) are the same number"):
        DeviceTraceAvailability(p, 2, round_s=60)


def test_unknown_agent_device_lists_the_devices(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text(HEADER + "a,0,1,80,0,,\nb,0,1,80,0,,\n")
    with pytest.raises(BatteryError, match=r"no rows for device 'zz' \(it has 'a', 'b'\)"):
        TraceBattery(p, "zz")


def test_an_empty_battery_cell_is_still_unknown_and_never_blocks(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text(HEADER + "0,0,1,,0,,\n1,0,1,10,0,,\n")
    m = DeviceTraceAvailability(p, 2, round_s=60, min_battery=20)
    r = m.round(0)
    assert r.available.tolist() == [True, False] and r.reasons == {1: "battery"}
    assert TraceBattery(p, "0").read(0) == Reading(None, False, True)
