import pytest

from coordinator.config import DataConfig, RunConfig
from coordinator.errors import UserError
from edge_client.configfile import fill_sections, read_config_file

SECTIONS = {"data": DataConfig, "run": RunConfig}


def test_fill_sections_sets_values_and_keeps_defaults():
    parts = fill_sections(SECTIONS, {"data": {"clients": 7}}, UserError)
    assert parts["data"].clients == 7 and parts["data"].dataset == "fmnist" and parts["run"].rounds == 200


@pytest.mark.parametrize("data,needle", [({"nope": {}}, "unknown section"), ({"data": {"bogus": 1}}, "data.bogus"),
                                         ({"data": 3}, "must be a table")])
def test_fill_sections_refuses_unknown_names(data, needle):
    with pytest.raises(UserError, match=needle):
        fill_sections(SECTIONS, data, UserError)


def test_read_config_file_toml_json_and_errors(tmp_path):
    (tmp_path / "a.toml").write_text("[data]\nclients = 3\n")
    (tmp_path / "a.json").write_text('{"data": {"clients": 4}}')
    (tmp_path / "bad.toml").write_text("[data\n")
    assert read_config_file(tmp_path / "a.toml", UserError) == {"data": {"clients": 3}}
    assert read_config_file(tmp_path / "a.json", UserError) == {"data": {"clients": 4}}
    with pytest.raises(UserError, match="not valid TOML"):
        read_config_file(tmp_path / "bad.toml", UserError)
    with pytest.raises(UserError, match="cannot read"):
        read_config_file(tmp_path / "missing.toml", UserError)
