"""Run-directory retention (``runtime.keep_checkpoints`` / ``keep_weights``): during a run the
newest checkpoint is there (and with keep N > 1 the N - 1 before it); after a successful run
``retain`` leaves only what was asked for."""

from __future__ import annotations

import torch

from tidal.runtime import checkpoint


def _save(root, step: int, keep: int) -> None:
    st = checkpoint.RunState(
        step=step, bursts_published=0, published_version=step, published_path=None
    )
    checkpoint.save(root, st, [], {"w": torch.full((256,), float(step)), "step": step}, keep)


def _weights(root, versions) -> None:
    (root / "weights").mkdir(exist_ok=True)
    for v in versions:
        (root / "weights" / f"v{v}.safetensors").write_bytes(b"x" * 1000)


def _names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_one_checkpoint_during_a_run_none_after_success(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=1)
    _weights(tmp_path, [2, 3])
    assert _names(tmp_path) == ["checkpoint", "weights"]
    assert checkpoint.load(tmp_path).state.step == 3  # what --resume needs is there
    freed = checkpoint.retain(tmp_path, keep_checkpoints=0, keep_weights=0)
    assert _names(tmp_path) == [] and freed > 2000


def test_kept_checkpoints_and_weights_are_the_newest(tmp_path):
    for step in range(1, 12):  # step 10 before 9 when sorted as text: must be by number
        _save(tmp_path, step, keep=3)
    assert _names(tmp_path) == ["checkpoint", "checkpoint-step10", "checkpoint-step9"]
    assert checkpoint.load(tmp_path).trainer["step"] == 11
    _weights(tmp_path, [8, 9, 10, 11])
    checkpoint.retain(tmp_path, keep_checkpoints=2, keep_weights=1)
    assert _names(tmp_path) == ["checkpoint", "checkpoint-step10", "weights"]
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v11.safetensors"]
    checkpoint.clear(tmp_path)  # a fresh run into the directory drops every checkpoint
    assert _names(tmp_path) == ["weights"]
