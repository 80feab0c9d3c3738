"""Typed configuration: every value from a config file or a flag is checked against its field's type and
range before anything runs, with one line naming the key, the value and where it came from."""

import dataclasses
from dataclasses import dataclass, field

import pytest

from coordinator import config
from coordinator.cli import main
from edge_client.configfile import check_value, fill_sections

TINY = ["--dataset", "fmnist", "--clients", "4", "--model", "logreg", "--steps", "1", "--rounds", "1",
        "--no-progress"]


def _refused(tmp_path, capsys, *args) -> str:
    """Run `dropfl sim` with `args`; it must refuse (exit 2) with one line and write nothing."""
    out = tmp_path / "run"
    assert main(["sim", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert not out.exists()
    return err[0]


@pytest.mark.parametrize("name,text,needle", [
    ("run.toml", '[data]\nclients = "abc"\n', 'data.clients must be an integer ≥ 1 (got "abc" in {f})'),
    ("run.toml", "[data]\nclients = 2.5\n", "data.clients must be an integer ≥ 1 (got 2.5 in {f})"),
    ("run.toml", "[data]\nclients = 0\n", "data.clients must be an integer ≥ 1 (got 0 in {f})"),
    ("run.toml", "[data]\nclients = true\n", "data.clients must be an integer ≥ 1 (got true in {f})"),
    ("run.json", '{"train": {"lr": NaN}}', "train.lr must be a finite number > 0 (got nan in {f})"),
    ("run.toml", "[train]\nlr = inf\n", "train.lr must be a finite number > 0 (got inf in {f})"),
    ("run.toml", '[train]\nlr = "0.1"\n', 'train.lr must be a finite number > 0 (got "0.1" in {f})'),
    ("run.toml", "[availability]\nfirst_round_all = 1\n",
     "availability.first_round_all must be true or false (got 1 in {f})"),
    ("run.toml", "[data]\ndataset = 5\n",
     "data.dataset must be one of: fmnist, mnist, cifar10, npz, imagefolder, leaf (got 5 in {f})"),
    ("run.toml", '[strategy]\nalgo = "nope"\n', 'strategy.algo must be one of: fedavg, '),
    ("run.toml", "[data]\nclinets = 3\n", "unknown key data.clinets in {f} (did you mean data.clients?)"),
    ("run.json", '{"run": {"seed": 99999999999}}',
     f"run.seed must be an integer in 0..{config.SEED_MAX} (got 99999999999 in {{f}})"),
    ("run.toml", "[run]\nseed = -1\n", f"run.seed must be an integer in 0..{config.SEED_MAX} (got -1 in {{f}})"),
])
def test_bad_config_file_value(tmp_path, capsys, name, text, needle):
    f = tmp_path / name
    f.write_text(text)
    assert needle.format(f=f) in _refused(tmp_path, capsys, "--config", str(f), "--no-progress")


@pytest.mark.parametrize("args,needle", [
    (["--lr", "inf"], "train.lr must be a finite number > 0 (got inf from --lr)"),
    (["--lr", "nan"], "train.lr must be a finite number > 0 (got nan from --lr)"),
    (["--lr", "0"], "train.lr must be a finite number > 0 (got 0.0 from --lr)"),
    (["--clients", "0"], "data.clients must be an integer ≥ 1 (got 0 from --clients)"),
    (["--availability", "static", "--p", "1.5"], "availability.p must be a finite number in (0, 1] (got 1.5 from --p)"),
    (["--dropout", "1"], "model.dropout must be a finite number in [0, 1) (got 1.0 from --dropout)"),
    (["--seed", "99999999999"], f"run.seed must be an integer in 0..{config.SEED_MAX} (got 99999999999 from --seed)"),
    (["--seed", str(config.SEED_MAX), "--rounds", "20000"],
     f"run.seed must be an integer in 0..{config.max_seed(20000, 4)} for 20000 rounds of 4 clients"),
    (["--epochs", "0", "--steps", "0"], "train.steps must be an integer ≥ 1 (got 0 from --steps)"),
])
def test_bad_flag_value(tmp_path, capsys, args, needle):
    assert needle in _refused(tmp_path, capsys, *TINY, *args)


def test_flag_overrides_file_and_is_named(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nlr = 0.1\n")
    assert "(got -1.0 from --lr)" in _refused(tmp_path, capsys, "--config", str(f), *TINY, "--lr", "-1")


def test_good_values_are_normalised(tmp_path):
    f = tmp_path / "run.json"
    f.write_text('{"train": {"lr": 1, "steps": null}, "model": {"dropout": 0}}')
    parts = fill_sections(config.SECTIONS, config.load_file(str(f)), config.UserError, source=str(f))
    assert parts["train"].lr == 1.0 and isinstance(parts["train"].lr, float) and parts["train"].steps is None
    assert parts["model"].dropout == 0.0 and isinstance(parts["model"].dropout, float)


def test_seed_limit_is_the_trainers():
    """max_seed mirrors edge_client/trainer.client_generator: its torch seed fits 64 bits up to the limit."""
    from edge_client.trainer import client_generator
    for rounds, clients in [(1, 1), (200, 30), (20000, 100)]:
        s = config.max_seed(rounds, clients)
        client_generator(s, rounds - 1, clients - 1)
        with pytest.raises((ValueError, RuntimeError)):
            client_generator(s + 1, rounds - 1, clients - 1)
    assert config.max_seed(1, 1) == config.SEED_MAX == 18446080


def test_every_numeric_field_has_a_default_inside_its_range():
    cfg = config.SimConfig()
    config.validate(cfg, ["fedavg"])  # the defaults pass their own checks
    for section in config.SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            assert "minimum" in f.metadata  # every field is declared through opt()


class FakeAgentError(Exception):
    pass


@dataclass
class Sec:
    client: int = 0
    heartbeat_s: float = 1.0
    device_id: str | None = None
    exit_when_done: bool = True
    plugged: list[list[float]] = field(default_factory=list)


@pytest.mark.parametrize("values,needle", [
    ({"client": "3"}, 'agent.client must be an integer (got "3" in agent config)'),
    ({"client": True}, "agent.client must be an integer (got true in agent config)"),
    ({"heartbeat_s": float("inf")}, "agent.heartbeat_s must be a finite number (got inf in agent config)"),
    ({"device_id": 7}, "agent.device_id must be a string (got 7 in agent config)"),
    ({"exit_when_done": "yes"}, 'agent.exit_when_done must be true or false (got "yes" in agent config)'),
    ({"plugged": [[0, "x"]]}, "agent.plugged must be a list of lists of finite numbers"),
    ({"nope": 1}, "agent config: unknown key agent.nope"),
])
def test_agent_sections_are_type_checked(values, needle):
    """The agent's dataclasses have no metadata: their annotations give the types."""
    with pytest.raises(FakeAgentError) as e:
        fill_sections({"agent": Sec}, {"agent": values}, FakeAgentError, "agent config")
    assert needle in str(e.value)


def test_agent_config_through_the_agent():
    agent = pytest.importorskip("edge_client.agent")
    with pytest.raises(agent.AgentError, match=r'data\.clients must be an integer ≥ 1 \(got "5" in agent config\)'):
        agent.config_from_dict({"data": {"clients": "5"}})
    cfg = agent.config_from_dict({"agent": {"heartbeat_s": 2, "device_id": None}, "battery": {"plugged": [[0, 10]]}})
    assert cfg.agent.heartbeat_s == 2.0 and cfg.battery.plugged == [[0.0, 10.0]]


def test_check_value_ranges_in_words():
    meta = {"minimum": 0, "maximum": 10}
    with pytest.raises(ValueError, match=r"^x must be an integer in 0\.\.10 \(got 11\)$"):
        check_value("x", 11, int, meta)
    with pytest.raises(ValueError, match=r"must be a finite number in \[0, 1\) \(got 1 from --y\)"):
        check_value("y", 1, float, {"minimum": 0, "lt": 1}, "from --y")
    assert check_value("z", None, int | None, {"minimum": 1}) is None
    assert check_value("z", 3, int | None, {"minimum": 1}) == 3
