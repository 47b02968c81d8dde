"""The cost model: profiles from spec sheets and config.json, the decode roofline and its
invariants (the oracle relies on them), derived speeds, drift, mechanics as an axis."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.errors import ConfigError
from tidal.sim import perf
from tidal.sim.profiles import load_gpu, load_model, model_from_config
from tidal.sim.runner import run_policy
from tidal.sim.scenario import Drift, ExecutionClass, load
from tidal.sim.workloads import ClassWorkload
from tidal.testing.sim_scenarios import tiny_scenario


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [("qwen2.5-7b", 7.6, 7.6), ("qwen3-30b-a3b", 30.5, 3.3), ("qwen3.5-35b-a3b", 35.0, 3.0)],
)
def test_parameter_counts_match_the_published_sizes(name, total_b, active_b):
    m = load_model(name)
    assert m.total_params / 1e9 == pytest.approx(total_b, rel=0.05)
    assert m.active_params / 1e9 == pytest.approx(active_b, rel=0.16)


def test_linear_attention_shrinks_the_kv_cache_and_adds_state():
    dense_attn, hybrid = load_model("qwen3-30b-a3b"), load_model("qwen3.5-35b-a3b")
    assert hybrid.full_attention_layers == 10 and hybrid.state_bytes_per_seq > 0
    assert hybrid.kv_bytes_per_token < dense_attn.kv_bytes_per_token / 4


def test_kv_heads_are_replicated_past_the_tensor_parallel_degree():
    # vLLM / SGLang keep max(1, kv_heads // tp) KV heads per rank: Qwen3.5-35B-A3B has 2, so
    # TP4 holds (and every decode step reads) 2 copies of each head, TP8 4 copies
    m = load_model("qwen3.5-35b-a3b")
    assert m.kv_heads == 2
    assert [m.kv_bytes_per_token_tp(tp) / m.kv_bytes_per_token for tp in (1, 2, 4, 8)] == [
        1.0,
        1.0,
        2.0,
        4.0,
    ]
    dense = load_model("qwen3-30b-a3b")  # 4 KV heads: sharded, never replicated up to TP4
    assert dense.kv_bytes_per_token_tp(4) == dense.kv_bytes_per_token
    assert dense.kv_bytes_per_token_tp(8) == 2 * dense.kv_bytes_per_token
    tp4, tp8 = engine(gpu="H100", tp=4), engine(gpu="H100", tp=8)
    assert tp8.kv_bytes_per_token == 2 * tp4.kv_bytes_per_token
    # the same context costs each rank the same KV read at TP4 and TP8 (one head per rank)
    assert tp8.kv_bytes_per_token / 8 == tp4.kv_bytes_per_token / 4
    # and the replicas fill the cache: capacity in tokens counts every copy
    assert tp4.kv_capacity_seqs(10_000) < tp4.kv_capacity_bytes / (
        m.kv_bytes_per_token * 10_000 + tp4.state_bytes_per_seq
    )


def test_bad_profiles_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"costmodel\.gpu"):
        load_gpu("Z9000")
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        model_from_config({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 8}, "x")
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "vocab_size": 100,
                "num_attention_heads": 4,
                "intermediate_size": 128,
            }
        )
    )
    assert load_model(str(cfg)).total_params == pytest.approx(
        2 * 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128)
    )


def engine(mem_fraction=0.85, gpu="H20", tp=8):
    return perf.build_engine(
        load_gpu(gpu), load_model("qwen3.5-35b-a3b"), tp, mem_fraction, 0.27, 0.44, 0.003
    )


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 512), ctx=st.floats(0, 300_000), mem=st.floats(0.3, 0.95))
def test_decode_roofline_keeps_the_oracles_bounds(n, ctx, mem):
    e = engine(mem)
    r = e.seq_rate(n, n * ctx)
    assert 0 < r <= e.seq_rate(1, 0.0)  # the per-sequence cap
    assert e.seq_rate(n + 1, (n + 1) * ctx) <= r  # more sequences never speed one up
    assert e.seq_rate(n, n * (ctx + 1000)) <= r  # nor does more context
    # Throughput never falls with the batch and never beats the zero-context peak.
    assert (
        e.throughput_tok_s(n + 1, ctx) >= e.throughput_tok_s(n, ctx) * (1 - 1e-9)
        or e.kv_capacity_seqs(ctx) < n + 1
    )
    assert e.throughput_tok_s(n, ctx) <= e.throughput_tok_s(n, 0.0) * (1 + 1e-9)


def test_kv_capacity_limits_concurrency_and_the_saturation_point_is_queryable():
    e = engine(0.85, "H200", 4)
    ctx = 400_000
    cap = e.kv_capacity_seqs(ctx)
    assert 1 < cap < 200
    below, above = e.throughput_tok_s(int(cap), ctx), e.throughput_tok_s(4 * int(cap), ctx)
    assert above == pytest.approx(below, rel=0.05)  # beyond the cache, sequences take turns
    sat = e.saturation_batch(4000, 512)
    best = max(e.throughput_tok_s(n, 4000) for n in range(1, 513))
    assert e.throughput_tok_s(sat, 4000) >= 0.9 * best > e.throughput_tok_s(sat - 1, 4000)
    assert e.saturation_batch(ctx, 512) <= int(cap)


def test_the_saturation_point_of_a_scenario_is_within_its_slots():
    sc = load("dapo-math-32gpu")
    sat = perf.saturation_point(sc, 6000)
    assert 1 <= sat <= sc.cluster.standalone_slots
    assert perf.saturation_point(sc, 6000, hybrid=True) <= sc.cluster.cell_specs()[0].slots
    with pytest.raises(ConfigError, match="costmodel"):
        perf.saturation_point(tiny_scenario(), 6000)


def test_resolve_derives_speeds_and_is_idempotent():
    sc = load("dapo-math-32gpu")
    r = perf.resolve(sc)
    assert perf.resolve(r) == r
    assert r.trainer.train_tok_s_per_gpu != sc.trainer.train_tok_s_per_gpu
    assert r.costs.sync_s == pytest.approx(1.0 + r.costs.weight_gb / (50 * 0.25))
    cm = sc.costmodel
    with_ref = sc.model_copy(update={"costmodel": cm.model_copy(update={"ref_log_prob": True})})
    # fwd+bwd (3) + recompute (1) + old log-probs (1) = 5 passes; a reference pass makes 6.
    assert perf.resolve(with_ref).trainer.train_tok_s_per_gpu == pytest.approx(
        r.trainer.train_tok_s_per_gpu * 5 / 6
    )


def test_drift_lengthens_responses_in_draw_order():
    cls = ExecutionClass(
        decode_tokens={"median": 1000, "sigma": 0.0}, drift=Drift(decode_growth_per_step=0.5)
    )
    wl = ClassWorkload([cls], 3, batch_groups=2)
    lengths = [wl.group(2)[0].decode_tokens for _ in range(6)]
    assert lengths == [1000, 1250, 1500, 1750, 2000, 2250]
    again = ClassWorkload([cls], 3, batch_groups=2)
    assert [again.group(2)[0].decode_tokens for _ in range(6)] == lengths


@pytest.mark.parametrize("mechanics", ["verl", "tidal", "waterlevel", "colocate"])
def test_every_policy_runs_with_every_mechanics_set(mechanics):
    sc = tiny_scenario(mechanics=mechanics, control={"bursts": 2})
    for spec in ("static:train=8", "verl-default", "tidal"):
        res = run_policy(sc, spec, keep_log=False)
        assert res.world.profile == sc.profile_for("static")
        assert res.summary["trainer_steps"] == sc.total_steps
        assert res.summary["makespan_s"] >= res.summary["oracle_makespan_s"]


def test_unknown_mechanics_is_an_error():
    with pytest.raises(ValueError, match="mechanics"):
        tiny_scenario(mechanics="magic")


def test_without_partial_rollout_an_aborted_turn_starts_over():
    base = tiny_scenario(control={"bursts": 3})
    off = base.model_copy(
        update={
            "profiles": {
                "verl-default": base.profile_for("verl-default").model_copy(
                    update={"partial_rollout": False}
                )
            }
        }
    )
    kept = run_policy(base, "verl-default", keep_log=False).summary
    lost = run_policy(off, "verl-default", keep_log=False).summary
    assert kept["wasted_tokens"] == 0 < lost["wasted_tokens"]


def test_a_scenario_with_an_unknown_gpu_is_refused_at_load(tmp_path):
    from tidal.sim.scenario import load as load_scenario

    f = tmp_path / "bad.yaml"
    f.write_text(
        "name: bad\ncluster: {cell_count: 1}\ncontrol: {bursts: 1}\n"
        "costmodel: {gpu: Z9, model: qwen2.5-7b, "
        "efficiency: {decode: 0.3, mfu: 0.4}}\n"
    )
    with pytest.raises(ConfigError, match="unknown GPU 'Z9'"):
        load_scenario(str(f))


def test_an_engine_of_two_tp4_replicas_shares_its_sequences_between_them():
    from tidal.sim.engines import Engine

    tp4 = engine(0.85, "H200", 4)
    e = Engine("e", 8, 64, 1.0, 1.0, model=tp4)
    assert e.replicas == 2
    e.add(1, 100.0, 0.0, ctx_tokens=1000)
    alone = e.rate()
    assert alone == pytest.approx(tp4.seq_rate(1, 1050))  # alone on one replica
    for seq in range(2, 33):
        e.add(seq, 100.0, 0.0, ctx_tokens=1000)
    assert e.rate() == pytest.approx(tp4.seq_rate(16, 16 * 1050)) and e.rate() < alone
    e.remove(2, 0.0)
    assert e.rate() == pytest.approx(tp4.seq_rate(15.5, 15.5 * 1050))
    e.set_paused(True, 0.0)
    assert e.rate() == 0.0 and e.next_finish() is None


def test_engine_tp_must_divide_every_engine():
    sc = load("dapo-math-32gpu")
    data = sc.model_dump(mode="json")
    data["costmodel"]["engine_tp"] = 3
    with pytest.raises(ValueError, match="engine_tp"):
        type(sc).model_validate(data)
