"""``tidal check`` runs every check ``tidal run`` makes before it starts Ray (issue 29, item 8):
each config below is valid YAML and schema, cannot run here, and is refused by ``tidal check``
in one line naming its field, exit code 2, no traceback; the same checks stop ``tidal run``
before anything starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from tidal.cli import main

TINY = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml").read_text())
NO_VLLM = sys.executable  # this venv's python: vLLM lives in its own venv (make vllm-venv)
HF = {"model": "smollm2-135m"}


def _not_a_model(tmp: Path) -> dict:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "README.md").write_text("not a model\n")
    return {"model": str(tmp / "notes")}


CASES = [  # (name, runtime section or a function of tmp_path giving it, field)
    ("missing model directory", {"model": "/nonexistent/model"}, "runtime.model"),
    ("a directory that is not a model", _not_a_model, "runtime.model"),
    ("use_gpus without a GPU", {"use_gpus": True}, "runtime.use_gpus"),
    ("cpus_per_engine beyond the machine", {"cpus_per_engine": 100}, "runtime.cpus_per_engine"),
    (
        "vLLM standalone engines without vLLM",
        {**HF, "standalone_backend": "vllm", "vllm": {"python": NO_VLLM}},
        "runtime.vllm.python",
    ),
    (
        "vLLM cells without vLLM",
        {**HF, "cell_backend": "vllm", "vllm": {"python": NO_VLLM}},
        "runtime.vllm.python",
    ),
    ("a temperature below the floor", {"temperature": 1e-300}, "runtime.temperature"),
    (
        "max_tokens beyond the context",
        {"max_tokens": 300, "tiny_max_seq_len": 256},
        "runtime.max_tokens",
    ),
    ("fsdp_ranks beyond the cores", {"fsdp_ranks": 4096}, "runtime.fsdp_ranks"),
    # runtime.deterministic: what it cannot make token-identical
    (
        "deterministic with vLLM standalone engines",
        {**HF, "deterministic": True, "standalone_backend": "vllm", "vllm": {"python": NO_VLLM}},
        "runtime.standalone_backend",
    ),
    (
        "deterministic with SGLang cells",
        {"deterministic": True, "cell_backend": "sglang"},
        "runtime.cell_backend",
    ),
    ("deterministic on GPUs", {"deterministic": True, "use_gpus": True}, "runtime.use_gpus"),
    (
        "deterministic over several FSDP ranks",
        {"deterministic": True, "fsdp_ranks": 2},
        "runtime.fsdp_ranks",
    ),
]


@pytest.mark.parametrize("name, runtime, field", CASES, ids=[c[0] for c in CASES])
def test_tidal_check_refuses_what_tidal_run_cannot_run_in_one_line(
    name, runtime, field, tmp_path, capsys
):
    if name == "use_gpus without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["runtime"].update(runtime(tmp_path) if callable(runtime) else runtime)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["check", str(path)]) == 2, name
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tidal: error: {field}: "), err


def test_tidal_run_refuses_them_before_it_starts_anything(tmp_path, capsys, monkeypatch):
    """... and warns about the spill files older versions left in the temp dir (item 5)."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "tidal-spill-140020366376656.safetensors").write_bytes(b"x" * 2_000_000)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["runtime"]["fsdp_ranks"] = 4096
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning == (
        f"tidal: warning: 1 stale engine spill files (2 MB of model weights) "
        f"of older tidal runs in {tmp}; nothing uses them: remove them with "
        f"'rm {tmp}/tidal-spill-*'"
    )
    assert error.startswith("tidal: error: runtime.fsdp_ranks: ")
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_the_shipped_run_configs_pass_tidal_check_here():
    root = Path(__file__).resolve().parents[2] / "configs"
    for name in ("tiny.yaml", "quickstart.yaml"):
        assert main(["check", "-q", str(root / name)]) == 0, name
