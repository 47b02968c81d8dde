"""The core trainer alone: staleness bound at consumption, stream close, publication."""

from __future__ import annotations

import os

import torch
from satellite_harness import GROUP_SIZE, build_model, params, tiny_dir

from tidal.clock import WallClock
from tidal.models import LlamaForCausalLM
from tidal.training.core import CoreTrainer, TrainerConfig
from tidal.training.flat import ParamLayout
from tidal.training.packing import PackingConfig
from tidal.training.records import single_call_record
from tidal.training.satellite import ModelSpec
from tidal.training.satellite import build_model as build_from_spec
from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig
from tidal.training.transport import FilePublisher, SharedMemoryTransport, load_into

SHM = f"tidal-test-pub-{os.getpid()}"

torch.set_num_threads(1)


def add_group(buf, gid: str, version: int) -> None:
    for i in range(GROUP_SIZE):
        out = [5 + i, 6, 7, 8 + i]
        buf.add(
            single_call_record(f"{gid}-{i}", gid, [1, 2, 3], out, [-3.0] * 4, version, float(i % 2))
        )


def make(max_lag: int, groups_per_step: int, initial_version: int, publishers=None):
    clock = WallClock()
    buf = TrajectoryBuffer(
        TrajectoryBufferConfig(group_size=GROUP_SIZE, max_policy_lag=max_lag), clock
    )
    cfg = TrainerConfig(
        groups_per_step=groups_per_step,
        lr=1e-2,
        data_poll_s=0.01,
        packing=PackingConfig(token_budget=64),
    )
    core = CoreTrainer(
        build_model(0), cfg, buf, clock, publishers=publishers, initial_version=initial_version
    )
    return core, buf


def test_data_older_than_the_max_lag_is_never_trained():
    core, buf = make(max_lag=1, groups_per_step=2, initial_version=3)
    try:
        for v in (0, 1, 2, 3, 2):
            add_group(buf, f"v{v}-{len(buf)}", v)
        r1 = core.train_step(final=False)  # trains at v3: only versions >= 2 qualify
        assert sorted(r1.group_ids) == ["v2-2", "v3-3"]
        assert r1.max_staleness == 1
        add_group(buf, "late-v3", 3)
        buf.close()
        r2 = core.train_step(final=True)  # trains at v4: the remaining v2 group is too old
        assert r2.group_ids == ["late-v3"]
        trained = r1.group_ids + r2.group_ids
        assert not any(g.startswith(("v0", "v1")) for g in trained)
        assert buf.stats.groups_dropped_stale == 3
        assert sorted(buf.stats.dropped_group_ids) == ["v0-0", "v1-1", "v2-4"]
    finally:
        core.close()


def test_stream_close_drains_a_partial_batch_and_publishes_in_place():
    layout = ParamLayout.of(build_model(0))
    shm = SharedMemoryTransport(SHM, layout, create=True)
    core, buf = make(max_lag=4, groups_per_step=4, initial_version=0, publishers=[shm])
    try:
        add_group(buf, "a", 0)
        add_group(buf, "b", 0)
        buf.close()  # only 2 of 4 groups will ever come
        report = core.train_step(final=True)
        assert report.n_groups == 2 and core.version == 1
        assert core.train_step(final=True) is None  # nothing left: no update
        # An engine-side model picks up v1 without being rebuilt.
        engine = LlamaForCausalLM.load(tiny_dir())  # the built-in engine's model
        ptr = engine.model.embed_tokens.weight.data_ptr()
        reader = SharedMemoryTransport(SHM, ParamLayout.of(engine), create=False)
        assert load_into(engine, reader, min_version=1) == 1
        assert engine.model.embed_tokens.weight.data_ptr() == ptr
        assert torch.equal(params(engine), params(core.model))
        reader.close()
    finally:
        core.close()
        shm.close()


def test_file_publisher_feeds_engines_that_load_from_a_path(tmp_path):
    from tidal.models import read_weights

    policy = build_model(0)
    layout = ParamLayout.of(policy)
    pub = FilePublisher(tmp_path, layout, keep=1)
    pub.publish(1, layout.params_to_flat(policy))
    pub.publish(2, layout.params_to_flat(policy))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2.safetensors"]
    engine = LlamaForCausalLM.load(tiny_dir())
    engine.load_weights(read_weights(pub.path(2)))
    assert torch.equal(params(engine), params(policy))


def test_satellite_spec_builds_the_cores_layout():
    spec = ModelSpec(model_dir=str(tiny_dir()))
    theirs, ours = ParamLayout.of(build_from_spec(spec)), ParamLayout.of(build_model(0))
    assert theirs.fingerprint() == ours.fingerprint()


def test_a_qwen2_model_trains_and_its_published_weights_serve(tmp_path):
    """The second architecture through the same path: transformers Qwen2 trained by the core,
    published to a file, loaded in place by the built-in engine, which then agrees with the
    trained model."""
    from tidal.models import create_tiny, load_model, load_training_model, read_weights

    qwen_dir = create_tiny(
        tmp_path / "qwen2", seed=3, arch="qwen2", n_layers=1, d_model=32, n_heads=2, max_seq_len=64
    )
    policy = load_training_model(qwen_dir)
    clock = WallClock()
    buf = TrajectoryBuffer(TrajectoryBufferConfig(group_size=GROUP_SIZE, max_policy_lag=1), clock)
    publisher = FilePublisher(tmp_path / "weights", ParamLayout.of(policy), keep=1)
    core = CoreTrainer(
        policy,
        TrainerConfig(
            groups_per_step=2, lr=1e-2, data_poll_s=0.01, packing=PackingConfig(token_budget=64)
        ),
        buf,
        clock,
        publishers=[publisher],
    )
    try:
        add_group(buf, "a", 0)
        add_group(buf, "b", 0)
        report = core.train_step(final=True)
        assert report.n_groups == 2 and report.grad_norm > 0
    finally:
        core.close()
    engine, _ = load_model(qwen_dir)
    before = engine(torch.tensor([[1, 2, 3, 5]]))
    engine.load_weights(read_weights(publisher.path(1)))
    ids = torch.tensor([[1, 2, 3, 5]])
    with torch.no_grad():
        trained = policy.eval()(ids).logits
    assert not torch.allclose(before, trained)
    torch.testing.assert_close(engine(ids), trained, atol=1e-5, rtol=1e-4)
