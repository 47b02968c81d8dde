"""A core cell sharded with FSDP2: the same update as the plain trainer (AdamW, clipping), its
publication streamed parameter by parameter into a file the built-in engine loads, and the
checkpoint of a 2-rank core (each rank its own shards, through DCP) restored into a fresh 2-rank
and a 1-rank core."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from satellite_harness import build_model, make_core, make_records, tiny_dir, trainer_config

from tidal.errors import ConfigError
from tidal.models import LlamaForCausalLM, read_weights
from tidal.runtime import checkpoint
from tidal.training.flat import ParamLayout
from tidal.training.sharded import ShardConfig
from tidal.training.transport import FilePublisher

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
torch.set_num_threads(1)


def adamw(shard: ShardConfig | None):
    return trainer_config(groups_per_step=3).model_copy(
        update={"optimizer": "adamw", "lr": 1e-3, "max_grad_norm": 0.05, "shard": shard}
    )


def two_steps(records, shard, publish_dir=None):
    core, buf = make_core(adamw(shard))
    if publish_dir is not None:
        core.publishers = [FilePublisher(publish_dir, core.layout, keep=1)]
    try:
        for r in records:
            buf.add(r)
        reports = [core.train_step(final=False), core.train_step(final=True)]
        return core.full_params(), reports
    finally:
        core.close()


def test_two_rank_core_matches_the_plain_trainer_and_streams_its_publication(tmp_path):
    records = make_records(build_model(0), 6, seed=3)
    plain, plain_reports = two_steps(records, None)
    sharded, reports = two_steps(records, ShardConfig(ranks=2), tmp_path)
    assert [r.grad_norm for r in reports] == [
        pytest.approx(r.grad_norm, rel=1e-5) for r in plain_reports
    ]
    assert all(r.grad_norm > 0.05 for r in reports), "clipping must be exercised"
    # AdamW divides by sqrt(v): float reordering in a tiny gradient moves its update a little,
    # so the update itself (not the parameter) is compared, as one vector
    init = build_model(0)
    start = ParamLayout.of(init).params_to_flat(init)
    rel = float((sharded - plain).norm() / (plain - start).norm())
    print(
        f"2-rank FSDP2 core vs plain trainer (AdamW, clipped): relative update difference {rel:.3g}"
    )
    assert rel < 1e-4
    engine = LlamaForCausalLM.load(tiny_dir())  # the built-in engine reads the streamed file
    engine.load_weights(read_weights(tmp_path / "v2.safetensors"))
    assert torch.equal(ParamLayout.of(engine).params_to_flat(engine), sharded)


def _next_step(core, buf, records):
    for r in records:
        buf.add(r)
    core.train_step(final=True)
    return core.full_params()


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs() / want.abs().clamp_min(1e-3)).max())


def test_two_rank_dcp_checkpoint_restores_the_same_trainer_on_two_and_one_ranks(tmp_path):
    records = make_records(build_model(0), 6, seed=4)
    core, buf = make_core(adamw(ShardConfig(ranks=2)))
    try:
        for r in records[:12]:
            buf.add(r)
        core.train_step(final=True)
        st = checkpoint.RunState(
            step=1, bursts_published=1, published_version=1, published_path=None
        )
        where = checkpoint.save(tmp_path, st, [], core.state_dict())
        expected = _next_step(core, buf, records[12:])
    finally:
        core.close()
    shards = sorted((where / checkpoint.SHARDED).iterdir())
    assert [p.suffix for p in shards] == [".safetensors"] * 2, "one file per rank, no .metadata"
    assert all(not p.read_bytes().startswith(b"\x80") for p in shards)
    damaged = tmp_path / "damaged"
    shutil.copytree(where, damaged / "checkpoint")
    with (
        open(shards[1], "rb") as src,
        open(damaged / "checkpoint" / checkpoint.SHARDED / shards[1].name, "wb") as dst,
    ):
        dst.write(src.read()[:40])
    for ranks in (2, 1):
        again, buf = make_core(adamw(ShardConfig(ranks=ranks)), seed=5)
        try:
            if ranks == 1:
                with pytest.raises(ConfigError) as err:
                    again.load_state_dict(checkpoint.load(damaged).trainer)
                assert "\n" not in str(err.value) and shards[1].parent.name in str(err.value)
                print(f"damaged shard: {err.value}")
            again.load_state_dict(checkpoint.load(tmp_path).trainer)
            assert again.version == 1
            rel = _max_rel(_next_step(again, buf, records[12:]), expected)
        finally:
            again.close()
        print(
            f"2-rank DCP checkpoint -> {ranks}-rank core, next step: max relative param "
            f"difference {rel:.3g}"
        )
        assert rel < 1e-5


def test_a_plain_core_refuses_sharded_state_naming_the_field():
    core, _ = make_core(adamw(None))
    try:
        with pytest.raises(ConfigError, match=r"^runtime\.fsdp: "):
            core.load_state_dict(
                {"dcp": "/nowhere/trainer.dcp", "param_groups": [], "version": 1, "step": 1}
            )
    finally:
        core.close()
