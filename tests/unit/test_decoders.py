"""`[backend.options] decode`: resolved per device (retrain/engines/decoders.py), refused
by the config's validation where it cannot run (graphs off CUDA; compiled without the
compiler torch.compile needs), and said by `explain`."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
from option_config import option_config

from retrain.config import load_config
from retrain.engines.decoders import DECODERS, decoder_for, describe
from retrain.errors import BackendError, ConfigError


def test_auto_is_graphs_on_cuda_and_dynamic_elsewhere():
    assert decoder_for("auto", "cuda") == "graphs"
    assert decoder_for("auto", "cpu") == "dynamic"
    for name in DECODERS:
        if name != "graphs":
            assert decoder_for(name, "cpu") == name
        assert decoder_for(name, "cuda") == name
    with pytest.raises(BackendError, match='decode = "graphs" needs a CUDA device'):
        decoder_for("graphs", "cpu")
    with pytest.raises(BackendError, match="'eager': one of auto, dynamic"):
        decoder_for("eager", "cpu")


def test_a_sharded_base_samples_without_cuda_graphs():
    """Under `shard = true` the sampler's gathered blocks are allocated anew after every
    training step, which a captured graph would not follow: auto is static on CUDA, and
    what captures a graph there is refused; off CUDA nothing changes."""
    assert decoder_for("auto", "cuda", sharded=True) == "static"
    assert decoder_for("static", "cuda", sharded=True) == "static"
    assert decoder_for("auto", "cpu", sharded=True) == "dynamic"
    assert decoder_for("compiled", "cpu", sharded=True) == "compiled"
    for name in ("graphs", "compiled"):
        with pytest.raises(BackendError, match=f'decode = "{name}" with .*shard = true'):
            decoder_for(name, "cuda", sharded=True)


def test_describe_says_where_the_compiled_step_is_captured():
    assert describe("compiled", "cuda").endswith(
        "compiled by torch.compile, captured as a CUDA graph)"
    )
    assert describe("compiled", "cpu").endswith("compiled by torch.compile)")
    assert describe("dynamic", "cpu") == f"dynamic ({DECODERS['dynamic']})"


def test_graphs_on_a_cpu_sampler_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(
            option_config(tmp_path, "cpu,gpu:0", decode="graphs")
        )  # samples on the first: the CPU
    text = str(err.value)
    assert "[backend.options] decode" in text and "retrain.toml:4" in text and "Fix:" in text


def test_compiled_needs_a_cpp_compiler_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(ConfigError, match=r"no C\+\+ compiler .*no-such-g\+\+.* on PATH"):
        load_config(option_config(tmp_path, "cpu", decode="compiled"))
    monkeypatch.setenv("CXX", "sh")  # any program on PATH passes the check
    assert (
        load_config(option_config(tmp_path, "cpu", decode="compiled")).backend.options["decode"]
        == "compiled"
    )


def test_compiled_on_a_gpu_needs_triton(tmp_path):
    path = option_config(tmp_path, "gpu:0", decode="compiled")
    if find_spec("triton") is None:  # this machine: torch's CPU build has no triton
        with pytest.raises(ConfigError, match="triton is not installed"):
            load_config(path)
    else:
        assert load_config(path).backend.options["decode"] == "compiled"


def test_explain_says_the_decoder(tmp_path, capsys):
    from retrain.cli.main import main

    main(
        ["explain", str(option_config(tmp_path, "gpu:0", decode="auto"))]
    )  # 2 here: no gpu:0 on this machine
    out = capsys.readouterr().out
    assert "Sampling:    pytorch on gpu:0, decode: graphs (a preallocated cache" in out
    assert main(["explain", str(option_config(tmp_path, "cpu", decode="graphs"))]) == 2
    assert "[backend.options] decode (" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--backend-opt", "decode=graphs"], "--backend-opt"),
        (["--backend-options", '{"decode": "graphs"}'], "--backend-options"),
    ],
)
def test_a_refused_option_given_by_a_flag_names_the_flag(tmp_path, capsys, flags, named):
    from retrain.cli.main import main

    path = tmp_path / "retrain.toml"
    path.write_text('[backend]\ndevices = "cpu"\n')
    assert main(["explain", str(path), *flags]) == 2
    assert f"[backend.options] decode (from {named}): " in capsys.readouterr().err
