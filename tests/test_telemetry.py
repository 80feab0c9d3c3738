"""Device telemetry and the thermal policy: every sensor kind on a fake sysfs tree (edge_client/sensors.py),
energy integration (edge_client/telemetry.py), the agent's round record and `thermal` declines, and the
coordinator's validation and rows (coordinator/field/telemetry.py)."""

from __future__ import annotations

import json
import stat

import pytest

from coordinator.availability.traces import DeviceTraceAvailability
from coordinator.field import checks
from coordinator.field import telemetry as ftel
from coordinator.loop import DECLINED
from edge_client import sensors, telemetry, wire
from edge_client.battery import BatteryConfig, Reading
from edge_client.monitor import PolicyConfig, decide
from edge_client.telemetry import EnergyCounter, RoundRecord, Telemetry, TelemetryConfig, between


def put(root, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n")


def jetson_iio(root, mw: dict[str, int]) -> None:
    d = "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    for i, (name, v) in enumerate(mw.items()):
        put(root, f"{d}/rail_name_{i}", name)
        put(root, f"{d}/in_power{i}_input", str(v))


def jetson_hwmon(root, channels: dict[str, tuple[int, int]], power: bool = False, hwmon: str = "hwmon3") -> None:
    d = f"sys/class/hwmon/{hwmon}"
    put(root, f"{d}/name", "ina3221")
    for i, (label, (mv, ma)) in enumerate(channels.items(), 1):
        put(root, f"{d}/in{i}_label", label)
        put(root, f"{d}/in{i}_input", str(mv))
        if power:
            put(root, f"{d}/power{i}_input", str(mv * ma))  # µW
        else:
            put(root, f"{d}/curr{i}_input", str(ma))


def thermal(root, temps_mc: list[int]) -> None:
    for i, v in enumerate(temps_mc):
        put(root, f"sys/class/thermal/thermal_zone{i}/type", f"zone{i}")
        put(root, f"sys/class/thermal/thermal_zone{i}/temp", str(v))


PMIC = """\
     3V7_WL_SW_A current(0)=0.10000000A
       3V3_SYS_A current(1)=0.20000000A
      DDR_VDD2_A current(4)=0.05000000A
     3V7_WL_SW_V volt(8)=3.70000000V
       3V3_SYS_V volt(9)=3.30000000V
        EXT5V_V volt(24)=5.10000000V
"""


def fake_vcgencmd(tmp_path, output: str = PMIC, rc: int = 0):
    script = tmp_path / "vcgencmd"
    (tmp_path / "pmic.txt").write_text(output)
    script.write_text(f"#!/bin/sh\n[ \"$1\" = pmic_read_adc ] || exit 2\ncat {tmp_path / 'pmic.txt'}\nexit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


# --- sensors, one fake tree per kind ---

def test_jetson_ina3221_iio_reads_the_input_rail_only(tmp_path):
    jetson_iio(tmp_path, {"POM_5V_IN": 3000, "POM_5V_GPU": 1000, "POM_5V_CPU": 800})
    s = sensors.find_power(tmp_path, vcgencmd=None)
    assert s.name == "ina3221-iio:POM_5V_IN" and s.kind == "power" and s.read() == 3.0


def test_jetson_ina3221_iio_without_an_input_rail_adds_all_rails(tmp_path):
    jetson_iio(tmp_path, {"VDD_GPU": 1000, "VDD_CPU": 500})
    assert sensors.find_power(tmp_path, vcgencmd=None).read() == 1.5


@pytest.mark.parametrize("power_files", [False, True])
def test_jetson_ina3221_hwmon_volts_times_amps_or_power(tmp_path, power_files):
    put(tmp_path, "sys/class/hwmon/hwmon0/name", "cpu_thermal")  # another hwmon device: not a power sensor
    jetson_hwmon(tmp_path, {"VDD_IN": (5000, 1200), "VDD_CPU_GPU_CV": (5000, 400), "VDD_SOC": (5000, 300)},
                 power=power_files)
    put(tmp_path, "sys/class/hwmon/hwmon3/in4_input", "12")  # the driver's shunt voltage and summed current:
    put(tmp_path, "sys/class/hwmon/hwmon3/curr4_input", "1900")  # not a channel
    s = sensors.find_power(tmp_path, vcgencmd=None)
    assert s.name == "ina3221:VDD_IN" and s.read() == pytest.approx(6.0)


def test_a_vanished_or_garbled_reading_is_none_never_a_guess(tmp_path):
    jetson_hwmon(tmp_path, {"VDD_IN": (5000, 1200)})
    s = sensors.find_power(tmp_path, vcgencmd=None)
    put(tmp_path, "sys/class/hwmon/hwmon3/curr1_input", "garbage")
    assert s.read() is None
    (tmp_path / "sys/class/hwmon/hwmon3/curr1_input").unlink()
    assert s.read() is None


def test_raspberry_pi_5_pmic_sums_current_times_voltage(tmp_path):
    assert sensors.parse_pmic(PMIC) == pytest.approx(0.1 * 3.7 + 0.2 * 3.3)  # DDR_VDD2 has no volts: left out
    assert sensors.parse_pmic("vcgencmd: unknown command") is None
    s = sensors.find_power(tmp_path, vcgencmd=fake_vcgencmd(tmp_path))
    assert s.name == "pmic" and s.read() == pytest.approx(1.03)


def test_a_pi_without_pmic_readings_and_no_vcgencmd_have_no_sensor(tmp_path):
    assert sensors.find_power(tmp_path, vcgencmd=fake_vcgencmd(tmp_path, "", rc=1)) is None
    assert sensors.find_power(tmp_path, vcgencmd=str(tmp_path / "absent")) is None


def battery_dir(root, status: str, **files: int) -> None:
    put(root, "sys/class/power_supply/AC/type", "Mains")
    put(root, "sys/class/power_supply/BAT0/type", "Battery")
    put(root, "sys/class/power_supply/BAT0/status", status)
    for k, v in files.items():
        put(root, f"sys/class/power_supply/BAT0/{k}", str(v))


def test_power_supply_power_now_counts_only_while_discharging(tmp_path):
    battery_dir(tmp_path, "Discharging", power_now=7_500_000, energy_now=40_000_000)
    s = sensors.find_power(tmp_path, vcgencmd=None)
    assert s.name == "power_supply:BAT0" and s.kind == "power" and s.read() == 7.5
    put(tmp_path, "sys/class/power_supply/BAT0/status", "Charging")
    assert s.read() is None


def test_power_supply_current_times_voltage(tmp_path):
    battery_dir(tmp_path, "Discharging", current_now=500_000, voltage_now=12_000_000)
    assert sensors.find_power(tmp_path, vcgencmd=None).read() == pytest.approx(6.0)


def test_power_supply_energy_now_is_a_counter(tmp_path):
    battery_dir(tmp_path, "Discharging", energy_now=40_000_000)  # µWh
    s = sensors.find_power(tmp_path, vcgencmd=None)
    c = EnergyCounter(s, 0.1)
    a = c.open()
    put(tmp_path, "sys/class/power_supply/BAT0/energy_now", "39999000")  # 1000 µWh = 3.6 J drawn
    assert between(a, c.close()) == pytest.approx(3.6)
    b = c.open()
    put(tmp_path, "sys/class/power_supply/BAT0/energy_now", "40001000")  # it went up: charged, not drawn
    assert between(b, c.close()) is None


def test_a_tree_without_sensors_has_none(tmp_path):
    battery_dir(tmp_path, "Discharging")  # a battery with no readings
    assert sensors.find_power(tmp_path, vcgencmd=None) is None
    th = sensors.Thermal(tmp_path)
    assert not th.present and th.read() is None


def test_thermal_is_the_hottest_plausible_zone(tmp_path):
    thermal(tmp_path, [45000, 71500, -273000, 900000])
    assert sensors.Thermal(tmp_path).read() == 71.5


def test_psutil_temperatures_on_the_real_root_without_zones(monkeypatch):
    from types import SimpleNamespace
    monkeypatch.setattr(sensors.Path, "glob", lambda self, pattern: iter(()))
    monkeypatch.setattr(sensors.psutil, "sensors_temperatures", lambda: {
        "coretemp": [SimpleNamespace(current=55.0), SimpleNamespace(current=61.0)]}, raising=False)
    th = sensors.Thermal("/")
    assert th.present and th.read() == 61.0


# --- energy ---

class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class LinearPower(sensors.PowerSensor):
    """P(t) = 2 + 0.5 t watts on the fake clock: trapezoids integrate it exactly, however it is sampled."""

    def __init__(self, clock: Clock):
        self.clock, self.fail = clock, False
        super().__init__("fake", "power")

    def read(self):
        return None if self.fail else 2.0 + 0.5 * self.clock()


def test_energy_counter_integrates_power_exactly_and_a_failed_read_voids_the_phase(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(telemetry.time, "monotonic", clock)
    s = LinearPower(clock)
    c = EnergyCounter(s, interval_s=3600.0)  # the thread is not started: samples at open/close and by hand
    a = c.open()
    for t in (101.0, 102.5, 104.0):
        clock.t = t
        with c.lock:
            c._sample()
    clock.t = 106.0
    b = c.close()
    exact = 2.0 * 6.0 + 0.25 * (106.0 ** 2 - 100.0 ** 2)
    assert between(a, b) == pytest.approx(exact, rel=1e-12)
    a = c.open()
    s.fail = True
    with c.lock:
        c._sample()
    s.fail = False
    clock.t = 107.0
    assert between(a, c.close()) is None


def test_round_record_with_a_sensor_says_its_name(tmp_path):
    jetson_hwmon(tmp_path, {"VDD_IN": (5000, 1000)})  # 5 W
    thermal(tmp_path, [52000])
    tel = Telemetry(TelemetryConfig(sysfs_root=str(tmp_path), vcgencmd="", interval_s=0.01), BatteryConfig())
    tel.start()
    try:
        rec = RoundRecord(tel, 80.0)
        rec.begin("train", busy=True)
        rec.end()
        rec.begin("upload", busy=False)
        rec.end()
        out = rec.finish(79.5)
    finally:
        tel.stop()
    assert out["energy_source"] == "ina3221:VDD_IN" and out["temp_c"] == 52.0
    assert out["energy_j"] == pytest.approx(out["train_energy_j"] + out["upload_energy_j"])
    assert out["energy_j"] >= 0 and (out["battery_before_pct"], out["battery_after_pct"]) == (80.0, 79.5)
    assert ftel.check({"telemetry": out}) is None


def test_round_record_without_a_sensor_is_modelled_from_the_battery_watts(tmp_path):
    tel = Telemetry(TelemetryConfig(sysfs_root=str(tmp_path), vcgencmd=""), BatteryConfig(train_w=4.0, idle_w=0.5))
    for rnd in (6, 7):  # two evaluations before the next update: they add up, under the latest round
        ev = telemetry.EvalMeter(tel)
        ev.resume()
        ev.pause()
        ev.resume()
        ev.done(rnd)
    assert tel.last_eval["phase"][2] == 4.0 * tel.last_eval["phase"][0]
    rec = RoundRecord(tel, None)
    rec.begin("train", busy=True)
    rec.begin("upload", busy=False)  # begin ends the open phase
    out = rec.finish(None)
    (train_s, _, _), (up_s, _, _) = rec.phases["train"], rec.phases["upload"]
    assert out["energy_source"] == "modelled" and out["temp_c"] is None
    assert out["train_energy_j"] == 4.0 * train_s and out["upload_energy_j"] == 0.5 * up_s
    assert out["eval_round"] == 7 and out["eval_energy_j"] == 4.0 * out["eval_s"]
    assert tel.last_eval is None and rec.finish(None)["eval_round"] == 7  # a re-send keeps its evaluation
    rss = out["rss_peak_bytes"]
    assert rss is None or rss > 0


# --- thermal policy ---

def test_thermal_policy_is_off_by_default_and_checked_last():
    hot, ok = 91.0, Reading(80.0, True)
    assert decide(PolicyConfig(), ok, True, hot) is None
    assert decide(PolicyConfig(thermal_limit_c=85), ok, True, hot) == "thermal"
    assert decide(PolicyConfig(thermal_limit_c=85), ok, True, None) is None  # unknown: never unavailable
    assert decide(PolicyConfig(thermal_limit_c=85), Reading(5.0, False), True, hot) == "battery"
    assert "thermal" in DECLINED


def offline_agent(tmp_path, monkeypatch, **sections):
    from test_field_agent import offline_agent as agent_without_broker

    return agent_without_broker(tmp_path, monkeypatch, agent={"out": str(tmp_path / "out")}, **sections)


TASK = {"lr": 0.1, "batch_size": 8, "steps": 1, "seed": 2}


def test_a_hot_agent_declines_with_reason_thermal_and_says_so_in_its_heartbeat(tmp_path, monkeypatch):
    thermal(tmp_path, [88000])
    a, sent = offline_agent(tmp_path, monkeypatch, policy={"thermal_limit_c": 85},
                            telemetry={"sysfs_root": str(tmp_path), "vcgencmd": ""})
    a.heartbeat.beat()
    a._handle("dropfl/v1/device/client-1/control", wire.encode("task", "run", 0, 1, meta=TASK)[0], False, 0.0)
    hb, decline = (wire.decode([p]) for _, p in sent)
    assert hb.meta["available"] is False and hb.meta["reason"] == "thermal" and hb.meta["temp_c"] == 88.0
    assert decline.kind == "decline" and decline.meta == {"reason": "thermal"}
    a.heartbeat._trace_file.flush()
    row = (tmp_path / "out" / "trace.csv").read_text().splitlines()
    assert row[0].endswith(",temp_c") and row[1].endswith(",88.0")
    put(tmp_path, "sys/class/thermal/thermal_zone0/temp", "60000")  # cooled down: trains again
    assert a.heartbeat.policy_reason() is None


def test_the_agent_sends_its_round_telemetry_with_the_stats(tmp_path, monkeypatch):
    from edge_client.models import build_model, get_flat

    a, sent = offline_agent(tmp_path, monkeypatch, telemetry={"sysfs_root": str(tmp_path), "vcgencmd": ""})
    w = get_flat(build_model("logreg", (1, 28, 28), 10, 2))
    for f in wire.encode("task", "run", 0, 1, meta=TASK) + wire.encode("model", "run", 0, -1, w):
        a._handle("dropfl/v1/device/client-1/control", f, False, 0.0)
    a.work.step()
    stats = wire.decode([p for t, p in sent if t.endswith("/stats")])
    tel = stats.meta["telemetry"]
    assert tel["energy_source"] == "modelled" and tel["battery_before_pct"] is None
    assert checks.stats(stats) is None and "eval_round" not in tel


# --- the coordinator's side ---

@pytest.mark.parametrize("tel, words", [
    ({"energy_j": "lots"}, "energy_j"), ({"energy_j": float("nan")}, "energy_j"), ({"temp_c": 900}, "temp_c"),
    ({"cpu_pct": True}, "cpu_pct"), ({"eval_round": 1.5}, "eval_round"), ({"event": "x"}, "unknown keys"),
    ({"energy_source": "a b"}, "energy_source"), ({"energy_source": "x" * 200}, "energy_source"),
    ([1, 2], "not an object"), ({"battery_after_pct": -1}, "battery_after_pct")])
def test_invalid_telemetry_rejects_the_stats(tel, words):
    m = wire.decode(wire.encode("stats", "r", 0, 0, meta={"upload_s": 1.0, "telemetry": tel}))
    code, reason = checks.stats(m)
    assert code == checks.META and words in reason


def test_telemetry_rows_carry_the_update_stats_and_telemetry():
    tel = {"energy_source": "modelled", "energy_j": 3.0, "temp_c": None, "eval_round": 2}
    r = ftel.row(3, 1, "client-1", {"train_s": 0.5, "download_s": 0.1}, {"upload_s": 0.2, "upload_bytes": 900,
                                                                      "telemetry": tel}, 4000)
    assert list(r) == list(ftel.ROW) and r["round"] == 3 and r["device"] == "client-1"
    got = (r["train_s"], r["upload_s"], r["download_bytes"], r["energy_j"], r["eval_round"])
    assert got == (0.5, 0.2, 4000, 3.0, 2)
    old = ftel.row(3, 2, "client-2", {"train_s": 0.5}, {}, 4000)  # an agent without telemetry: still a row
    assert old["energy_source"] is None and old["train_s"] == 0.5
    json.dumps(r)


def test_device_trace_replays_thermal_declines(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps,temp_c\n"
                 "a,0,1,90,1,,,40.0\nb,0,1,90,1,,,95.5\nc,0,1,90,1,,,\n")
    avail = DeviceTraceAvailability(p, 3, 60.0, max_temp_c=90.0).round(0)
    assert avail.active == [0, 2] and avail.reasons == {1: "thermal"}
    assert DeviceTraceAvailability(p, 3, 60.0).round(0).active == [0, 1, 2]  # off by default
    bad = tmp_path / "bad.csv"
    bad.write_text("device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps,temp_c\na,0,1,,,,,999\n")
    from coordinator.errors import UserError
    with pytest.raises(UserError, match="temp_c"):
        DeviceTraceAvailability(bad, 1, 60.0)


def test_telemetry_config_and_thermal_limit_are_checked():
    import edge_client.agent as ag
    cfg = ag.config_from_dict({"telemetry": {"sysfs_root": "/host", "interval_s": 0.5},
                               "policy": {"thermal_limit_c": 80}})
    assert cfg.telemetry.sysfs_root == "/host" and cfg.policy.thermal_limit_c == 80.0
    for bad in ({"telemetry": {"interval_s": 0}}, {"policy": {"thermal_limit_c": 500}},
                {"telemetry": {"sysfs": "/"}}):
        with pytest.raises(ag.AgentError):
            ag.config_from_dict(bad)


# --- dropfl report: energy per round, time-to-accuracy against energy ---

def fake_run(d, accs: list[float], joules: list[list[float]], source: str = "modelled"):
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"round": t, "participants": 2, "uploads": t + 1,
                                                         "accuracy": a, "elapsed": 10.0 * (t + 1)}) + "\n"
                                             for t, a in enumerate(accs)))
    rows = [ftel.row(t, c, f"d{c}", {}, {"telemetry": {"energy_source": source, "energy_j": j}}, 4)
            for t, js in enumerate(joules) for c, j in enumerate(js)]
    ftel.write_rows(d / "telemetry.jsonl", rows)
    return d


def test_energy_report_sums_devices_per_round_and_finds_time_and_energy_to_accuracy(tmp_path):
    from coordinator.report.compare import load_runs
    from coordinator.report.energy import energy_curve, energy_report, load_telemetry, time_to_accuracy

    a = fake_run(tmp_path / "a", [0.5, 0.7, 0.8], [[1.0, 2.0], [1.5, 2.5], [1.0, 1.0]])
    b = fake_run(tmp_path / "b", [0.6, 0.75, 0.74], [[3.0, 3.0], [3.0, 3.0], [3.0, 3.0]], "ina3221:VDD_IN")
    with open(b / "telemetry.jsonl", "a") as f:  # round 2 written again by a resumed run: the later row counts
        f.write(json.dumps(ftel.row(2, 0, "d0", {}, {"telemetry": {"energy_j": 5.0}}, 4)) + "\n")
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "metrics.jsonl").write_text(json.dumps({"round": 0, "accuracy": 0.9}) + "\n")
    runs = load_runs([str(a), str(b), str(sim)])
    ra, rb = runs[0], runs[1]
    ca = energy_curve(ra, load_telemetry(ra))
    assert [x["energy_j"] for x in ca] == [3.0, 4.0, 2.0] and [x["cumulative_j"] for x in ca] == [3.0, 7.0, 9.0]
    assert time_to_accuracy(ca, 0.75) == (2, 30.0, 9.0) and time_to_accuracy(ca, 0.9) is None
    cb = energy_curve(rb, load_telemetry(rb))
    assert [x["energy_j"] for x in cb] == [6.0, 6.0, 8.0]
    out = tmp_path / "rep"
    out.mkdir()
    files, table = energy_report(runs, out)
    assert "target accuracy: 75.00 %" in table  # the lower of the best accuracies (80 %, 75 %)
    assert "| a | 3 | modelled | 9.0 | 3.0 | 3 | 30.0 | 9.0 |" in table
    assert "| b | 3 | ina3221:VDD_IN | 20.0 | 6.7 | 2 | 20.0 | 12.0 |" in table
    assert "without telemetry.jsonl (not field runs): sim" in table
    assert {p.name for p in files.values()} == {"energy_per_round.png", "accuracy_vs_energy.png", "energy.md"}
    _, table = energy_report(runs, out, target_pct=79)
    assert "| b | 3 | ina3221:VDD_IN | 20.0 | 6.7 | not reached | – | – |" in table
    assert energy_report([runs[2]], out) == ({}, "")


def test_report_refuses_a_bad_target_and_a_damaged_telemetry_file_before_writing(tmp_path):
    from types import SimpleNamespace

    from coordinator.cli.report import run
    from coordinator.errors import UserError

    a = fake_run(tmp_path / "a", [0.5], [[1.0]])
    args = SimpleNamespace(runs=[str(a)], out=str(tmp_path / "rep"), no_progress=True, target_accuracy=0.0)
    with pytest.raises(UserError, match="--target-accuracy"):
        run(args)
    with open(a / "telemetry.jsonl", "a") as f:
        f.write('{"round": "x"}\n{"round": 1, "client": 0}\n')
    args.target_accuracy = None
    with pytest.raises(UserError, match="telemetry.jsonl:2"):
        run(args)
    assert not (tmp_path / "rep").exists()


def test_a_replayed_device_trace_drives_the_thermal_policy_too(tmp_path, monkeypatch):
    trace = tmp_path / "trace.csv"
    trace.write_text("device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps,temp_c\n"
                     "client-1,0,1,90,1,,,95.0\n")
    a, sent = offline_agent(tmp_path, monkeypatch, policy={"thermal_limit_c": 85},
                            battery={"source": "trace", "trace": str(trace)},
                            telemetry={"sysfs_root": str(tmp_path), "vcgencmd": ""})
    assert a.heartbeat.policy_reason() == "thermal"
    a.heartbeat.beat()
    assert wire.decode([sent[0][1]]).meta["temp_c"] == 95.0
