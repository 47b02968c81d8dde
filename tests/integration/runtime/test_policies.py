"""``tidal run`` under other registered policies, unchanged: verl's scheduler on hybrid cells
(its activate / deactivate plans run through the same actuator), and a static split whose
second training cell is a satellite that joins the core's optimizer steps."""

from __future__ import annotations

import json

import yaml

from tidal.cli import main

from .test_tiny_run import CONFIG, expected_groups


def _trained(out) -> list[str]:
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted(g for m in metrics for g in m["groups"])


def test_verl_default_on_hybrid_cells(tmp_path):
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["cluster"]["cell_kind"] = "hybrid"
    cfg["policy"] = {"name": "verl-default"}
    config = tmp_path / "verl.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == "verl-default"
    # hybrids start training, are activated after a weight sync and deactivated again
    assert s["switches_to_rollout"] >= 1 and s["switches_to_training"] >= 1
    assert s["failed_requests"] == 0 and s["lost_executions"] == 0 and s["plans_aborted"] == 0
    assert _trained(out) == expected_groups(cfg)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    kinds = {st["step"] for st in steps}
    assert {
        "remove_from_load_balancer",
        "abort_inflight",
        "sleep_engine",
        "sync_weights",
        "add_to_load_balancer",
        "resume_generation",
    } <= kinds, kinds
    assert all(st["ok"] for st in steps)
    assert "dynamic_resource/resource_utilization" in (out / "metrics.jsonl").read_text()
    assert (out / "report.md").is_file() and (out / "roles.png").stat().st_size > 0


def test_static_split_trains_with_a_satellite_on_reserved_gpus(tmp_path):
    # GPUs declared to the local Ray (none exist here): each engine actor reserves its
    # bundle's GPU through the placement group; torch on CPU ignores CUDA_VISIBLE_DEVICES.
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["runtime"].update(use_gpus=True, ray_num_gpus=3)
    config = tmp_path / "gpus.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    assert main(["run", str(config), "--policy", "static:cells=2", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    gpus = [e["gpu_ids"] for e in s["engines"].values()]
    assert sorted(g for ids in gpus for g in ids) == ["0", "1", "2"], gpus
    assert s["switches_to_training"] == s["switches_to_rollout"] == 0
    assert s["satellite_joins"] >= 1, s
    assert s["failed_requests"] == 0 and s["lost_executions"] == 0
    assert _trained(out) == expected_groups(yaml.safe_load(CONFIG.read_text()))
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(m["satellites"] == [1] for m in metrics)


def test_a_cluster_without_the_gpus_is_one_clear_error(tmp_path, capsys):
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["runtime"].update(use_gpus=True, ray_num_gpus=1, start_timeout_s=5)
    config = tmp_path / "gpus.yaml"
    config.write_text(yaml.safe_dump(cfg))
    # refused before Ray starts (tidal check says the same): one line naming the field
    assert main(["run", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tidal: error: runtime.use_gpus: the engines reserve 3 GPUs") and (
        "the local Ray has 1" in err and err.count("\n") == 1
    ), err
