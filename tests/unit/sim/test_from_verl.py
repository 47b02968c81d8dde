"""``tidal calibrate --verl-log``: a synthetic verl-format log round-trips through the fit."""

import json

import pytest

from tidal.errors import ConfigError
from tidal.sim.from_verl import expected_max_normal, read_verl_log, scenario_from_verl
from tidal.testing.verl_logs import verl_rows, write_verl_log

TRUTH = {
    "samples": 128,
    "gpus": 16,
    "median": 3000.0,
    "sigma": 0.6,
    "cap": 16384.0,
    "prompt": 400,
    "tok_s_per_gpu": 900.0,
    "seq_cap": 60.0,
    "train_tok_s_per_gpu": 2500.0,
    "sync_s": 4.0,
}


def test_expected_max_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / 3.14159265**0.5, rel=1e-4)
    assert expected_max_normal(100) == pytest.approx(2.5076, abs=1e-3)


@pytest.mark.parametrize("fmt", ["jsonl", "console", "csv"])
def test_fit_recovers_the_parameters_that_wrote_the_log(tmp_path, fmt):
    rows = verl_rows(steps=60, seed=3, **TRUTH)
    path = write_verl_log(tmp_path / f"run.{'csv' if fmt == 'csv' else 'jsonl'}", rows, fmt)
    sc, f = scenario_from_verl(path, group_size=8)
    assert (f.gpus, f.samples_per_step, f.prompt_tokens, f.steps) == (16, 128, 400, 60)
    assert f.decode_median == pytest.approx(TRUTH["median"], rel=0.10)
    assert f.decode_sigma == pytest.approx(TRUTH["sigma"], rel=0.10)
    assert f.decode_cap in (None, TRUTH["cap"])
    assert f.decode_tok_s_per_gpu == pytest.approx(TRUTH["tok_s_per_gpu"], rel=0.02)
    assert f.seq_cap_tok_s == pytest.approx(TRUTH["seq_cap"], rel=0.02)
    assert f.train_tok_s_per_gpu == pytest.approx(TRUTH["train_tok_s_per_gpu"], rel=1e-6)
    assert f.sync_s == pytest.approx(TRUTH["sync_s"])
    assert f.logged_s == pytest.approx(sum(r["timing_s/step"] for r in rows))
    assert sc.control.batch_groups == 16 and sc.control.group_size == 8
    assert len(sc.cluster.cell_specs()) == 2 and sc.total_steps == 60


def test_a_clipped_run_gives_the_cap(tmp_path):
    rows = verl_rows(steps=30, seed=1, **{**TRUTH, "cap": 6000.0})
    assert any(r["response_length/clip_ratio"] > 0 for r in rows)
    _, f = scenario_from_verl(write_verl_log(tmp_path / "c.jsonl", rows), group_size=8)
    assert f.decode_cap == 6000.0


def test_bad_logs_are_one_line_errors_naming_what_is_wrong(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"step": 1, "data": {"timing_s/gen": 3.0}}) + "\n")
    with pytest.raises(ConfigError, match="lacks verl's timing_s/update_actor"):
        read_verl_log(p)
    p.write_text("not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: neither JSON"):
        read_verl_log(p)
    good = write_verl_log(tmp_path / "g.jsonl", verl_rows(steps=10, **TRUTH))
    with pytest.raises(ConfigError, match="--group-size"):
        scenario_from_verl(good, group_size=48)
    with pytest.raises(ConfigError, match="--cell-gpus"):
        scenario_from_verl(good, group_size=8, cell_gpus=5)
