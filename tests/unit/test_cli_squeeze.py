"""`retrain squeeze ADAPTER ...` and the standalone `[squeeze]` TOML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from retrain.cli.main import main as cli_main  # noqa: E402
from retrain.cli.squeeze import main as squeeze_main  # noqa: E402
from retrain.errors import RetrainError, UsageError  # noqa: E402

# One layer with a known spectrum: V(1) = 100/126, V(2) = 125/126 ~ 0.992, V(4) = 1.
SPECTRUM = [10.0, 5.0, 1.0, 0.0]


def make_adapter(path: Path, rank: int = 4) -> Path:
    gen = torch.Generator().manual_seed(0)
    out_dim, in_dim = 12, 10
    q_out, _ = torch.linalg.qr(torch.randn(out_dim, rank, generator=gen, dtype=torch.float64))
    q_in, _ = torch.linalg.qr(torch.randn(in_dim, rank, generator=gen, dtype=torch.float64))
    s = torch.tensor(SPECTRUM[:rank], dtype=torch.float64)
    b = (q_out * s).float()  # out x r
    a = q_in.T.contiguous().float()  # r x in
    path.mkdir(parents=True)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b.contiguous()},
        str(path / "adapter_model.safetensors"),
    )
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": ["q_proj"],
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": "tiny",
            }
        )
    )
    return path


@pytest.fixture
def adapter(tmp_path):
    return make_adapter(tmp_path / "adapter")


def test_table_with_recommended_row(adapter, capsys):
    assert squeeze_main([str(adapter)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    marked = [line for line in lines if "<- recommended" in line]
    assert len(marked) == 1 and marked[0].split()[0] == "2"
    assert "recommended rank: 2 (of 4)" in out
    assert [line.split()[0] for line in lines if line.strip()[:1].isdigit()] == ["1", "2", "4"]


def test_json_and_options(adapter, capsys):
    assert (
        cli_main(
            [
                "squeeze",
                str(adapter),
                "--json",
                "--target-ranks",
                "1,3",
                "--min-variance-retention",
                "0.7",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["recommended_rank"] == 1 and data["source_rank"] == 4
    assert [r["rank"] for r in data["ranks"]] == [1, 3, 4]
    assert data["ranks"][0]["mean_variance"] == pytest.approx(100 / 126, abs=1e-6)


def test_compression_to_a_given_rank(adapter, tmp_path, capsys):
    out_dir = tmp_path / "small"
    assert (
        squeeze_main([str(adapter), "--output", str(out_dir), "--compress-to", "1", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["compressed_rank"] == 1 and data["compressed_path"] == str(out_dir)
    cfg = json.loads((out_dir / "adapter_config.json").read_text())
    assert cfg["r"] == 1 and cfg["lora_alpha"] == 2
    weights = load_file(str(out_dir / "adapter_model.safetensors"))
    assert {tuple(t.shape) for t in weights.values()} == {(1, 10), (12, 1)}


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--compress-to", "2"], "needs --output"),
        (["--target-ranks", "4,x"], "not an integer"),
        (["--target-ranks", "0"], ">= 1"),
        (["--min-variance-retention", "1.5"], r"\(0, 1\]"),
        (["--bogus"], "unrecognized"),
    ],
)
def test_usage_errors(adapter, argv, match):
    with pytest.raises(UsageError, match=match):
        squeeze_main([str(adapter), *argv])


def test_missing_adapter_is_a_clean_error(tmp_path):
    with pytest.raises(RetrainError, match="not found"):
        squeeze_main([str(tmp_path / "nope")])
    # a problem with what was asked: exit 2, like a config error
    assert cli_main(["squeeze", str(tmp_path / "nope")]) == 2


def test_standalone_toml_analyses_and_compresses(adapter, tmp_path, capsys):
    out_dir = tmp_path / "squeezed"
    toml = tmp_path / "squeeze.toml"
    toml.write_text(
        f'[squeeze]\nadapter_path = "{adapter}"\nmin_variance_retention = 0.99\n'
        f'output_path = "{out_dir}"\n'
    )
    assert cli_main([str(toml)]) == 0
    out = capsys.readouterr().out
    assert "<- recommended" in out and "recommended rank: 2 (of 4)" in out
    assert f"compressed adapter (rank 2): {out_dir}" in out
    assert json.loads((out_dir / "adapter_config.json").read_text())["r"] == 2
