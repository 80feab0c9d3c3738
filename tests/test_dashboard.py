"""The live dashboard (coordinator/dashboard/, docs/dashboard.md): its JSON endpoints against the run directory's
files, its one-line errors, and the page in a real browser (Debian's chromium driven by selenium through
chromium-driver): the charts hold the run's rows, an appended round is drawn, and the console stays clean.
Every wait is bounded; the server and the browser are stopped in teardown."""

import json
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest

from coordinator.cli import main
from coordinator.errors import UserError

pytest.importorskip("fastapi", reason="the dashboard extra (fastapi, uvicorn) is not installed")
from coordinator.dashboard.rundata import RunData  # noqa: E402
from coordinator.dashboard.server import DashboardServer, serving  # noqa: E402

TINY = ["--dataset", "fmnist", "--clients", "8", "--model", "logreg", "--steps", "2", "--batch-size", "8",
        "--lr", "0.05", "--rounds", "5", "--availability", "static", "--p", "0.5", "--no-progress"]
HTTP_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two short simulations: FedAvg and FedDD (whose dropout rates the page shows)."""
    base = tmp_path_factory.mktemp("runs")
    for algo in ("fedavg", "feddd"):
        assert main(["sim", *TINY, "--algo", algo, "--out", str(base / algo)]) == 0
    return base


def _copy(runs, tmp_path, names=("fedavg", "feddd")) -> list[Path]:
    """A private copy of the runs: tests append to them."""
    out = []
    for name in names:
        shutil.copytree(runs / name, tmp_path / name)
        out.append(tmp_path / name)
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:
        return json.loads(r.read())


@pytest.fixture
def server():
    started = []

    def start(dirs, **kw):
        srv = DashboardServer(dirs, port=0, **kw).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def _append_round(path: Path) -> dict:
    """A further round, as the round loop appends it (one JSON line)."""
    rows = _lines(path)
    row = dict(rows[-1], round=rows[-1]["round"] + 1, accuracy=0.5, loss=1.25)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def test_endpoints_serve_the_run_directory(runs, tmp_path, server):
    fedavg, feddd = _copy(runs, tmp_path)
    srv = server([fedavg, feddd])
    listed = _get(srv.url + "api/runs")["runs"]
    assert [(r["name"], r["algo"], r["kind"], r["rounds_done"], r["finished"]) for r in listed] == \
        [("fedavg", "fedavg", "sim", 5, True), ("feddd", "feddd", "sim", 5, True)]
    # what the page prints: rounds from 1 as `dropfl sim` prints them (metrics.jsonl: 0..4), FedDD's panel for FedDD
    assert [(r["label"], r["progress"], r["last_round"]) for r in listed] == \
        [("fedavg", "round 5/5", 4), ("feddd", "round 5/5", 4)]
    assert "dropout" not in listed[0]["panels"] and "dropout" in listed[1]["panels"]
    for i, d in enumerate((fedavg, feddd)):
        assert _get(f"{srv.url}api/runs/{i}/metrics")["rows"] == _lines(d / "metrics.jsonl")
        raster = _get(f"{srv.url}api/runs/{i}/participation")
        part = [r.split(",") for r in (d / "participation.csv").read_text().splitlines()[1:]]
        assert raster["clients"] == 8 and raster["rounds"] == list(range(5))
        for t, c, status, reason in part:
            assert raster["status"][int(t)][int(c)] == status[0].upper()
            assert raster["reasons"][int(t)].get(c, "") == reason
        devices = _get(f"{srv.url}api/runs/{i}/devices")["rows"]
        assert [r["rounds_trained"] for r in devices] == \
            [sum(1 for t, c, s, _ in part if int(c) == k and s == "participated") for k in range(8)]
        timing = _get(f"{srv.url}api/runs/{i}/timing")
        assert timing["seconds"] == [r["seconds"] for r in _lines(d / "metrics.jsonl")]
        log = _get(f"{srv.url}api/runs/{i}/log")
        records = _lines(d / "log.jsonl")
        assert (log["total"], log["debug"]) == (sum(r["level"] != "debug" for r in records),
                                                sum(r["level"] == "debug" for r in records))
        assert log["records"][-1]["message"] == [r for r in records if r["level"] != "debug"][-1]["message"]
    dropout = _get(srv.url + "api/runs/1/dropout")
    tasks = [r["tasks"] for r in _lines(feddd / "reports.jsonl")]
    assert dropout["mean"] == [sum(t["dropout_rate"] for t in ts.values()) / len(ts) for ts in tasks]
    assert dropout["max"] == [max(t["dropout_rate"] for t in ts.values()) for ts in tasks]
    assert _get(srv.url + "api/runs/0/dropout")["rounds"] == []  # FedAvg sets no dropout rates
    for bad in ("api/runs/2/metrics", "api/runs/0/nothing"):
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(srv.url + bad)
        assert e.value.code == 404
    with urllib.request.urlopen(srv.url, timeout=HTTP_TIMEOUT_S) as r:
        assert b"dropfl dashboard" in r.read()


def test_rows_appended_while_serving(runs, tmp_path, server):
    (fedavg,) = _copy(runs, tmp_path, ("fedavg",))
    srv = server([fedavg])
    version = _get(srv.url + "api/runs")["runs"][0]["version"]
    row = _append_round(fedavg / "metrics.jsonl")
    listed = _get(srv.url + "api/runs")["runs"][0]
    assert listed["version"] != version and listed["rounds_done"] == 6 and listed["last_round"] == row["round"]
    assert _get(srv.url + "api/runs/0/metrics")["rows"][-1] == row
    with open(fedavg / "metrics.jsonl", "a") as f:  # a row still being written: not read yet, no problem
        f.write('{"round": 7, "accu')
    assert len(_get(srv.url + "api/runs/0/metrics")["rows"]) == 6
    with open(fedavg / "metrics.jsonl", "a") as f:  # completed, and then a damaged line: reported, not skipped
        f.write('racy": 0.5}\nnot json\n')
    got = _get(srv.url + "api/runs/0/metrics")
    assert got["rows"][-1] == {"round": 7, "accuracy": 0.5}
    assert len(got["problems"]) == 1 and got["problems"][0].startswith("metrics.jsonl:8:")
    assert _get(srv.url + "api/runs")["runs"][0]["problems"] == got["problems"]


def test_columnar_participation_log_gives_the_same_raster(runs, tmp_path, server, capsys):
    """A run with --participation-format npz (RUN/participation/) shows the raster its participation.csv
    would: the same letters, reasons and counts, and the same device rows. (The run also serves itself with
    --dashboard, which prints its URL.)"""
    npz = tmp_path / "npz"
    assert main(["sim", *TINY, "--algo", "fedavg", "--participation-format", "npz", "--out", str(npz),
                 "--dashboard"]) == 0
    assert "dashboard: http://127.0.0.1:" in capsys.readouterr().err
    assert not (npz / "participation.csv").exists() and (npz / "participation").is_dir()
    srv = server([runs / "fedavg", npz])
    for panel in ("participation", "devices"):
        csv_, col = (_get(f"{srv.url}api/runs/{i}/{panel}") for i in (0, 1))
        if panel == "devices":
            for row in csv_["rows"] + col["rows"]:
                assert row.pop("sources") in (["participation.csv"], ["participation/"])
            csv_.pop("now"), col.pop("now")
        assert col == csv_


def test_raster_of_more_clients_than_shown(tmp_path):
    """Beyond MAX_CLIENTS the raster and the device rows hold the first clients; the counts hold all."""
    from coordinator.dashboard.participation import MAX_CLIENTS

    n = MAX_CLIENTS + 3
    (tmp_path / "participation.csv").write_text("round,client,status,reason\n" + "".join(
        f"0,{c},{'unavailable' if c % 2 else 'participated'},{'battery' if c % 2 else ''}\n" for c in range(n)))
    data = RunData(tmp_path)
    raster = data.raster()
    assert (raster["clients"], raster["shown"], len(raster["status"][0])) == (n, MAX_CLIENTS, MAX_CLIENTS)
    assert raster["counts"]["unavailable"] == [n // 2] and raster["counts"]["participated"] == [n - n // 2]
    assert len(raster["reasons"][0]) == MAX_CLIENTS // 2
    assert len(data.devices()["rows"]) == MAX_CLIENTS


def _field_run(tmp_path) -> Path:
    """A trial's device files, as coordinator/trial, coordinator/field and the agents write them."""
    run = tmp_path / "trial"
    (run / "agents" / "client-1").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"data": {"clients": 2}, "strategy": {"algo": "fedavg"}}))
    (run / "trial.json").write_text("{}")
    (run / "participation.csv").write_text("round,client,status,reason\n0,0,participated,\n0,1,participated,\n"
                                           "1,0,participated,\n1,1,unavailable,battery\n")
    (run / "field.jsonl").write_text(
        json.dumps({"event": "agent", "device": "dev-a", "client": 0, "state": "online", "time": 100.0}) + "\n" +
        json.dumps({"event": "round", "round": 1, "clients": {"0": {"uplink_Bps": 5000.0, "train_s": 0.25}}}) + "\n" +
        json.dumps({"event": "agent", "device": "dev-a", "client": 0, "state": "offline", "time": 130.0}) + "\n")
    (run / "agents" / "client-1" / "agent.json").write_text(json.dumps({"agent": {"client": 1}}))
    (run / "agents" / "client-1" / "trace.csv").write_text(
        "device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps\n"
        "client-1,0.5,1,21.00,0,,\nclient-1,1.0,1,19.50,1,800,9000\nclient-1,1.5,1,19.4")  # last row: being written
    (run / "telemetry.jsonl").write_text(
        json.dumps({"round": 0, "client": 0, "energy_j": 1.5, "train_energy_j": 1.0, "energy_source": "modelled",
                    "temp_c": 41.0, "battery_after_pct": 80.0}) + "\n" +
        json.dumps({"round": 1, "client": 0, "energy_j": 2.0, "energy_source": "modelled", "temp_c": 43.5,
                    "battery_after_pct": 79.0}) + "\n")
    return run


def test_device_panel_of_a_field_run(tmp_path):
    run = _field_run(tmp_path)
    data = RunData(run)
    assert data.summary()["kind"] == "trial"
    a, b = data.devices()["rows"]
    assert (a["device"], a["connection"], a["last_seen"], a["rounds_trained"], a["uplink_Bps"], a["train_s"]) == \
        ("dev-a", "offline", 130.0, 2, 5000.0, 0.25)
    assert (a["energy_j"], a["energy_source"], a["temp_c"], a["battery_pct"]) == (3.5, "modelled", 43.5, 79.0)
    assert (b["device"], b["connection"], b["battery_pct"], b["charging"], b["uplink_Bps"], b["downlink_Bps"]) == \
        ("client-1", "online", 19.5, 1.0, 800.0, 9000.0)
    assert (b["rounds_trained"], b["last_status"], b["last_reason"], b["last_round"]) == \
        (1, "unavailable", "battery", 1)
    assert b["last_seen"] == pytest.approx((run / "agents" / "client-1" / "trace.csv").stat().st_mtime)
    summary = data.summary()
    assert (summary["label"], summary["progress"], summary["finished"]) == ("fedavg (trial)", "no round yet", False)
    assert summary["panels"] == ["accuracy", "loss", "participation", "devices", "timing", "log"]  # no FedDD panel


def test_a_finished_trials_agents_are_gone_not_online(tmp_path):
    """After the run ended (model.pt), the agent whose last heartbeat said online is shown as gone."""
    run = _field_run(tmp_path)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"round": t, "accuracy": 0.5}) + "\n" for t in range(2)))
    (run / "model.pt").write_bytes(b"")
    data = RunData(run)
    a, b = data.devices()["rows"]
    assert (a["connection"], b["connection"]) == ("offline", "gone")
    summary = data.summary()
    assert (summary["finished"], summary["progress"]) == (True, "round 2/?")  # config.json plans no rounds here


def test_progress_text_and_panels():
    from coordinator.dashboard.rundata import panels, progress_text

    assert [progress_text(4, 5), progress_text(None, 5), progress_text(0, None)] == \
        ["round 5/5", "no round yet (of 5)", "round 1/?"]
    assert "dropout" in panels("feddd") and "dropout" in panels(None) and "dropout" not in panels("fedavg")


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    not_run = tmp_path / "empty"
    not_run.mkdir()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        cases = [(["dashboard", str(tmp_path / "missing")], "is not a directory"),
                 (["dashboard", str(not_run)], "holds no run"),
                 (["dashboard", str(runs / "fedavg"), "--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                 (["dashboard", str(runs / "fedavg"), "--port", "70000"], "a TCP port is 0..65535"),
                 (["dashboard", str(runs / "fedavg"), "--poll", "0"], "--poll 0.0"),
                 (["sim", *TINY, "--out", str(tmp_path / "new"), "--dashboard", str(port)], "--dashboard")]
        for args, needle in cases:
            capsys.readouterr()
            assert main(args) == 2, args
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("dropfl: error: ") and needle in err, err
        assert not (tmp_path / "new").exists()  # refused before anything was written
    finally:
        busy.close()


def test_dashboard_serves_a_run_not_yet_started(tmp_path):
    """`--dashboard` starts before the run directory exists: the page shows it empty, then as it is written."""
    out = tmp_path / "run"
    with serving(Namespace(dashboard=0, dashboard_host="127.0.0.1"), out) as srv:
        listed = _get(srv.url + "api/runs")["runs"]
        assert (listed[0]["rounds_done"], listed[0]["finished"]) == (0, False)
        assert _get(srv.url + "api/runs/0/participation")["rounds"] == []
    with pytest.raises(OSError):  # stopped with the run
        urllib.request.urlopen(srv.url + "api/runs", timeout=2)


@pytest.mark.parametrize("command", ["trial", "coordinator"])
def test_field_commands_serve_their_run_directory(tmp_path, monkeypatch, capsys, command):
    """`dropfl trial|coordinator --dashboard PORT`: the run directory is served while the run goes on (the run
    itself, which needs a broker and agents, is replaced by a stub that asks the dashboard), and no longer after."""
    import coordinator.cli.coordinator as coord_cli
    import coordinator.cli.trial as trial_cli

    seen = {}

    def during_run(*args, **kwargs):
        url = capsys.readouterr().err.split("dashboard: ")[1].split()[0]
        seen["url"], seen["runs"] = url, _get(url + "api/runs")["runs"]
        return "summary"

    monkeypatch.setattr(trial_cli, "run_trial", during_run)
    monkeypatch.setattr(coord_cli, "run_field", during_run)
    with socket.socket() as probe:  # a free port, given back for the command to take
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    out = tmp_path / "run"
    head = ["trial", "--agents", "2"] if command == "trial" else ["coordinator", "--clients", "2"]
    args = ["--dataset", "fmnist", "--model", "logreg", "--rounds", "1", "--no-progress", "--out", str(out)]
    assert main([*head, *args, "--dashboard", str(free)]) == 0
    assert seen["url"] == f"http://127.0.0.1:{free}/"
    assert [(r["name"], r["path"]) for r in seen["runs"]] == [("run", str(out.resolve()))]
    with pytest.raises(OSError):
        urllib.request.urlopen(seen["url"] + "api/runs", timeout=2)


# --- the page in a real browser ---

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser(tmp_path):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install chromium "
                    "chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the browser-test extra) is missing")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1600",
              f"--user-data-dir={tmp_path / 'chromium'}", "--no-first-run", "--disable-extensions"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def _wait(driver, condition, what: str, timeout_s: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda d: condition(d), message=what)


@pytest.mark.slow
def test_page_in_a_browser_draws_the_run_and_its_new_rounds(runs, tmp_path, server, browser):
    fedavg, feddd = _copy(runs, tmp_path)
    srv = server([fedavg, feddd, _field_run(tmp_path)], poll_s=0.2)
    browser.get(srv.url)
    _wait(browser, lambda d: int(d.find_element("tag name", "body").get_attribute("data-updates")) >= 1,
          "the page drew the runs")
    n_rounds = len(_lines(fedavg / "metrics.jsonl"))

    def chart(name):  # what uPlot holds: [rounds, one array per series]
        return browser.execute_script(f"return state.charts['chart-{name}'].plot.data")

    def attr(css, name):
        return browser.find_element("css selector", css).get_attribute(name)

    acc = chart("accuracy")
    assert int(attr("#chart-accuracy", "data-points")) == n_rounds
    assert acc[0] == [r["round"] + 1 for r in _lines(fedavg / "metrics.jsonl")]  # rounds from 1, as printed
    assert acc[1:3] == [[100 * r["accuracy"] for r in _lines(d / "metrics.jsonl")] for d in (fedavg, feddd)]  # %
    loss = chart("loss")
    assert loss[1] == [r.get("loss") for r in _lines(fedavg / "metrics.jsonl")]
    assert loss[2] == [r.get("train_loss") for r in _lines(fedavg / "metrics.jsonl")]
    tasks = [r["tasks"] for r in _lines(feddd / "reports.jsonl")]
    assert chart("dropout")[2] == pytest.approx([sum(t["dropout_rate"] for t in ts.values()) / len(ts) for ts in tasks])
    assert int(attr("#chart-timing", "data-points")) == n_rounds
    assert (attr("#raster-0", "data-rounds"), attr("#raster-0", "data-clients")) == (str(n_rounds), "8")
    assert attr("#devices-0", "data-rows") == "8"
    assert attr("#panel-dropout", "hidden") is None  # a FedDD run among them: FedDD's panel is shown
    device = attr('#devices-2 tr[data-client="1"]', "textContent")  # the field run's device panel
    assert "client-1" in device and "19.5 %" in device and "unavailable (battery) in round 2" in device  # log: 1
    before = int(attr("body", "data-updates"))

    row = _append_round(fedavg / "metrics.jsonl")  # a round arrives: the page redraws with it
    _wait(browser, lambda d: int(d.find_element("id", "chart-accuracy").get_attribute("data-points")) == n_rounds + 1,
          "the appended round was drawn")
    acc = chart("accuracy")
    assert acc[0][-1] == row["round"] + 1 and acc[1][-1] == 100 * row["accuracy"] and acc[2][-1] is None
    assert int(attr("body", "data-updates")) > before
    assert row["round"] == n_rounds
    assert f"round {n_rounds + 1}/{n_rounds}" in attr('#runs [data-run="0"]', "textContent")  # from 1, as printed

    if os.environ.get("DROPFL_DASHBOARD_SCREENSHOT"):  # docs/dashboard.md: how docs/img/dashboard.png is made
        browser.save_screenshot(os.environ["DROPFL_DASHBOARD_SCREENSHOT"])
    time.sleep(0.5)  # one more poll, so that an error it raises reaches the log
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == [], errors

    browser.get(server([fedavg], poll_s=0.2).url)  # FedAvg alone: no FedDD panel
    _wait(browser, lambda d: int(d.find_element("tag name", "body").get_attribute("data-updates")) >= 1,
          "the page drew the FedAvg run")
    assert attr("#panel-dropout", "hidden") == "true"


def test_bad_host_is_one_line():
    with pytest.raises(UserError, match="not an address"):
        DashboardServer([Path(".")], host="no-such-host.invalid", port=0)


@pytest.mark.slow
def test_page_says_when_its_finished_runs_server_has_stopped(runs, tmp_path, browser):
    """A `sim --dashboard` server stops with its run: the page then says the runs finished and what it shows
    is final (not "no answer"); with a run still going it keeps saying there is no answer."""
    for finished in (True, False):
        (fedavg,) = _copy(runs, tmp_path / str(finished), names=("fedavg",))
        if not finished:
            (fedavg / "model.pt").unlink()   # as a run that is still going
        srv = DashboardServer([fedavg], port=0, poll_s=0.2).start()
        try:
            browser.get(srv.url)
            _wait(browser, lambda d: int(d.find_element("tag name", "body").get_attribute("data-updates")) >= 1,
                  "the page drew the run")
        finally:
            srv.stop()
        status = _wait(browser, lambda d: (lambda s: s if "server" in s and "updated" not in s else False)(
            d.find_element("id", "status").text), "the page noticed the server stopped")
        if finished:
            assert status.startswith("every run has finished and the dashboard server has stopped"), status
        else:
            assert status.startswith("no answer from the dashboard server"), status
