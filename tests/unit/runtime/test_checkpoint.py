"""Checkpoints without pickle: the core's state (model and AdamW state, version, step) round-
trips exactly through ``trainer.safetensors`` + ``trainer.json``; a damaged checkpoint, whichever
file is hit, is one ``ConfigError`` line naming it, never a traceback."""

from __future__ import annotations

import json

import pytest
import torch

from tidal.contracts.calls import ExecutionRecord
from tidal.errors import ConfigError
from tidal.runtime import checkpoint


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model[1].weight = torch.nn.Parameter(model[0].weight.T.clone())  # shapes like a tied head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "version": 3, "step": 7}


def _save(tmp_path, trainer=None):
    st = checkpoint.RunState(
        step=2,
        bursts_published=1,
        published_version=1,
        published_path=str(tmp_path / "v1.bin"),
        trained_groups=["b0-g0"],
    )
    recs = [ExecutionRecord(execution_id="b1-g0-e0", group_id="b1-g0", calls=[], reward=1.0)]
    return checkpoint.save(tmp_path, st, recs, trainer or _state())


def test_the_trainer_state_round_trips_without_pickle(tmp_path):
    want = _state()
    where = _save(tmp_path, want)
    assert sorted(p.name for p in where.iterdir()) == [
        "records.jsonl",
        "state.json",
        "trainer.json",
        "trainer.safetensors",
    ]
    for p in where.iterdir():
        assert not p.read_bytes().startswith(b"\x80"), f"{p.name} looks pickled"
    ck = checkpoint.load(tmp_path)
    got = ck.trainer
    assert (got["version"], got["step"]) == (3, 7)
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # a tuple again
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()  # int keys
    for i, slot in want["optimizer"]["state"].items():
        for k, v in slot.items():
            assert torch.equal(got["optimizer"]["state"][i][k], v), (i, k)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    model.load_state_dict(got["model"])
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(got["optimizer"])
    assert ck.state.trained_groups == ["b0-g0"] and ck.records[0].execution_id == "b1-g0-e0"


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("trainer.safetensors", lambda b: b[: len(b) // 2]),
        ("trainer.safetensors", lambda b: b"\x00" * 16),
        ("trainer.json", lambda b: b[:10]),
        ("state.json", lambda b: b"{not json"),
        ("records.jsonl", lambda b: b'{"execution_id": 1}\n'),
    ],
)
def test_a_damaged_checkpoint_is_one_line(tmp_path, name, damage):
    where = _save(tmp_path)
    (where / name).write_bytes(damage((where / name).read_bytes()))
    with pytest.raises(ConfigError) as info:
        checkpoint.load(tmp_path)
    msg = str(info.value)
    assert msg.startswith("--resume: ") and "\n" not in msg
    assert f"{name} is damaged" in msg


def test_an_older_format_is_refused_by_name(tmp_path):
    where = _save(tmp_path)
    data = json.loads((where / "state.json").read_text())
    (where / "state.json").write_text(json.dumps({**data, "format": 1}))
    with pytest.raises(ConfigError, match="checkpoint format is not 3"):
        checkpoint.load(tmp_path)


def test_tied_and_view_tensors_are_stored_once_each(tmp_path):
    """Tied weights (one tensor under two names) and views into one flat buffer: safetensors
    stores no aliases, so each later alias is copied; values survive."""
    flat = torch.arange(12, dtype=torch.float32)
    emb = torch.randn(3, 4)
    state = {
        "model": {"embed": emb, "head": emb, "a": flat[:6].view(2, 3), "b": flat[6:]},
        "optimizer": {"state": {}, "param_groups": []},
        "version": 1,
        "step": 1,
    }
    _save(tmp_path, state)
    got = checkpoint.load(tmp_path).trainer["model"]
    assert torch.equal(got["embed"], emb) and torch.equal(got["head"], emb)
    assert torch.equal(got["a"], flat[:6].view(2, 3)) and torch.equal(got["b"], flat[6:])


def test_sharded_state_is_written_inside_the_atomic_checkpoint(tmp_path):
    """A sharded core's writer gets ``checkpoint.tmp/trainer.dcp`` (its ranks write there) and
    its JSON rest joins ``trainer.json``; the swapped-in checkpoint names its directory."""
    seen = []

    def write(path):
        seen.append(path)
        path.mkdir()
        (path / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"shard")
        return {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["w"]}]}

    where = _save(tmp_path, {"dcp": write, "version": 2, "step": 5})
    assert seen == [tmp_path / "checkpoint.tmp" / checkpoint.SHARDED]
    got = checkpoint.load(tmp_path).trainer
    assert got["dcp"] == str(where / checkpoint.SHARDED)
    assert (
        where / checkpoint.SHARDED / "shard-00001-model-00001-of-00001.safetensors"
    ).read_bytes() == b"shard"
    assert got["param_groups"][0]["betas"] == (0.9, 0.95) and (got["version"], got["step"]) == (
        2,
        5,
    )
