"""`[backend.options] overlap` is refused where the sampler shares the trained weights, by
config loading, so `retrain explain` and `retrain doctor` report it before any model load."""

from __future__ import annotations

import pytest

from retrain.cli.main import main
from retrain.config import load_config
from retrain.errors import ConfigError

SINGLE = '[backend]\ndevices = "cpu"\n[backend.options]\noverlap = true\n'


def write(tmp_path, text: str):
    path = tmp_path / "retrain.toml"
    path.write_text(text)
    return path


def test_overlap_with_one_device_and_the_pytorch_engine_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, SINGLE))
    text = str(err.value)
    assert "[backend.options] overlap" in text and "'cpu' is one device" in text
    assert 'devices = "gpu:0,gpu:1"' in text and "overlap = false" in text and "Fix:" in text


@pytest.mark.parametrize(
    "text",
    [
        '[backend]\ndevices = "cpu,cpu"\n[backend.options]\noverlap = true\n',
        '[backend]\ndevices = "gpu:0, gpu:1"\n[backend.options]\noverlap = true\n',
        # a server samples while this process trains
        '[inference]\nengine = "vllm"\nurl = "http://127.0.0.1:9"\n[backend.options]\noverlap = true\n',
        '[backend]\ndevices = "cpu"\n[backend.options]\noverlap = false\n',
    ],
)
def test_overlap_is_accepted_where_the_sampler_has_its_own_weights(tmp_path, text):
    config = load_config(write(tmp_path, text))
    assert config.backend.options["overlap"] in (True, False)


def test_a_non_bool_overlap_is_reported_once_as_a_type_error(tmp_path):
    bad = SINGLE.replace("overlap = true", 'overlap = "yes"')
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, bad))
    text = str(err.value)
    assert text.count("[backend.options] overlap") == 1
    assert "[backend.options] overlap (" in text and "expects bool, got 'yes'" in text


def test_explain_and_doctor_report_it_before_loading_a_model(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, SINGLE)
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert "[backend.options] overlap" in err and "Traceback" not in err

    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--no-network"]) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["config"])
    assert line.startswith("FAIL") and "[backend.options] overlap" in line
