"""vLLM tier (``make test-vllm``): ``tidal run configs/vllm.yaml``: one standalone engine and two
elastic cells, every engine a real vLLM server, all serving SmolLM2, under waterlevel.

Checks: the run completes with nothing failed or lost while cells move both ways in every burst
(each cell keeps one vLLM server process for the whole run: drained, memory released, woken, the
published version loaded in place and read back before it rejoins); every call in flight on a
cell at its drain continued on another engine (how many were in flight is timing); the summary
names each engine's backend, the re-prefilled tokens and the switch times per direction; the
vLLM engines serve tokens of every published version they loaded (v0 in burst 0, v2 in burst 1)
and end at the final version; and the log-probabilities vLLM reported for its tokens are those
of the version their label names (recomputed here with tidal's model from the published weight
files), so the label is not merely set, the weights behind it are loaded (invariant 6).

Skipped unless ``TIDAL_VLLM_PYTHON`` names the vLLM venv's python (the Makefile target sets it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from tidal.cli import main
from tidal.runtime import bridge

VLLM_PYTHON = os.environ.get("TIDAL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set TIDAL_VLLM_PYTHON (make test-vllm)"),
]
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "vllm.yaml"


def _logprobs(model, prompt: list[int], out: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out]))[0].float()
        lps = torch.log_softmax(logits, -1)
    return [lps[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


@pytest.mark.timeout(900)
def test_vllm_run_every_engine_vllm(smollm2, tmp_path, monkeypatch):
    from tidal.models import load_model
    from tidal.models.loading import read_weights

    calls: list[dict] = []  # every closed execution's proxy records, as the bridge saw them
    real = bridge.record_from_proxy

    def spy(eid, gid, proxy_calls, reward, reason):
        calls.extend(proxy_calls)
        return real(eid, gid, proxy_calls, reward, reason)

    monkeypatch.setattr(bridge, "record_from_proxy", spy)
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["runtime"]["keep_weights"] = 3  # the check below reads the published files
    config = tmp_path / "vllm.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    assert main(["run", str(config), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    print(
        "summary:",
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "run_time_s",
                    "bursts_s",
                    "switches_to_training",
                    "switches_to_rollout",
                    "rerouted_requests",
                    "drained_requests",
                    "engine_handoffs",
                    "tokens_by_engine_version",
                    "engines",
                    "backend_by_engine",
                    "reprefill_tokens",
                    "kv_handoffs",
                    "kv_handoff_failures",
                    "switch_s",
                    "engine_memory",
                )
            }
        ),
    )

    c = cfg["control"]
    u, bursts = c["updates_per_burst"], c["bursts"]
    n = bursts * c["batch_groups"] * u * c["group_size"]
    labels = [f"v{b * u}" for b in range(bursts)]  # the version each burst is served with
    assert bursts >= 2, "the test needs a version published into the live vLLM server"
    assert summary["failed_requests"] == 0 and summary["timed_out_executions"] == 0
    assert summary["lost_executions"] == 0 and summary["record_errors"] == []
    assert summary["dispatched"] == summary["closed"] == summary["trained_executions"] == n
    # every call in flight on a cell when it drained continued elsewhere. Whether a drain finds a
    # call in flight is timing (waterlevel moves a cell once the rest covers the outstanding
    # work, which may all have finished by then); a drain with live vLLM calls is forced in
    # test_vllm_tier.py (vLLM <-> built-in) and test_vllm_multinode.py (a killed node's calls).
    assert summary["plans_aborted"] == 0
    assert summary["rerouted_requests"] >= summary["drained_requests"] >= 0, summary
    assert summary["version"] == bursts * u
    assert summary["backend_by_engine"] == {"s0": "vllm", "c0": "vllm", "c1": "vllm"}
    # a call drained mid-call keeps its KV at the next vLLM server (tidal's KV connector): no
    # handoff fails to land and no context is prefilled again (the destination's scheduler
    # acknowledges what it loaded); how many calls a drain finds in flight is timing
    assert summary["kv_handoff_failures"] == 0 and summary["reprefill_tokens"] == 0, summary
    assert summary["kv_handoffs"] <= summary["rerouted_requests"], summary
    for way in ("to_training", "to_rollout"):  # at least one move each way per burst
        row = summary["switch_s"][way]
        assert row["n"] >= bursts and 0 < row["p50_s"] <= row["max_s"], summary["switch_s"]
    for name, e in summary["engines"].items():  # one server per engine for the whole run
        assert e["restarted"] is False, (name, e)
    s0 = summary["engines"]["s0"]
    assert s0 == {**s0, "state": "awake", "version": f"v{bursts * u}"}, s0
    # every load read back the published version (a mismatch fails its step: none did)
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    loads = [st for st in steps if st["step"] == "load_weights"]
    assert loads and all(st["ok"] for st in steps), [st for st in steps if not st["ok"]]
    # every version reached every vLLM engine through shared memory, never the file, and the
    # decision log names each engine's carrier, bytes, seconds and pause
    published = [
        json.loads(x)
        for x in (out / "decisions.jsonl").read_text().splitlines()
        if '"weights_published"' in x
    ]
    assert len(published) == bursts, published
    for rec in published:
        assert rec["engines"] and set(rec["transports"].values()) == {"shm"}, rec
        assert all(
            e["carrier"] == "shm" and e["bytes"] > 0 and e["pause_s"] <= e["seconds"]
            for e in rec["engines"].values()
        ), rec
    pub = summary["publication"]
    assert set(pub["carriers"]) == {"shm"} and pub["fallbacks"] == 0, pub
    assert set(summary["switch_steps_s"]) == {"to_training", "to_rollout"}, summary
    # the cells' servers released memory while their cell trained (RSS measured). On the CPU
    # a woken server's KV cache is resident only once calls touch it: a cell that served
    # nothing between a wake and its next release frees no RSS there (CI 2026-12-04: c0's
    # second release, 2915.8 -> 2915.8 MB, after serving no token of v2). A cell serves v0
    # only before its first release (it wakes on a newer version), so each cell that served
    # v0 frees RSS at its first release; no release grows it beyond allocator noise.
    served = summary["tokens_by_engine_version"]
    memory = summary["engine_memory"]
    released = [m for e in memory.values() for m in e]
    assert released and all(m["rss_after_mb"] <= m["rss_before_mb"] + 32 for m in released), memory
    first = {c: e[0] for c, e in memory.items() if served.get(c, {}).get("v0", 0) > 0}
    assert first and all(m["rss_after_mb"] < m["rss_before_mb"] for m in first.values()), memory
    # the vLLM engine served tokens of each version it had loaded, and of no other label
    assert set(served["s0"]) == set(labels) and min(served["s0"].values()) > 0, served
    assert any(name.startswith("c") for name in served), served
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["max_staleness"] for m in metrics] == [s % u for s in range(bursts * u)], metrics
    # calls moved from the cells' vLLM servers to other engines (a cell's drain, a retry)
    moves = summary["engine_handoffs"]
    if summary["drained_requests"]:
        assert any(pair.startswith("c") for pair in moves), moves
    print("drained calls:", summary["drained_requests"], "handoffs:", moves)

    # vLLM's log-probabilities are those of the weights its label names, and not those of
    # other weights: of the other published version when training changed the weights, else
    # (SmolLM2's arithmetic rewards are usually all zero, so both versions are equal) of a
    # perturbed copy of v0, so the comparison is shown to tell weights apart in every run
    from safetensors.torch import save_file

    model, _ = load_model(smollm2)
    model.eval()
    weights = {"v0": None, labels[1]: out / "weights" / f"{labels[1]}.safetensors"}
    moved = any(m["grad_norm"] > 0 for m in metrics[:u])  # a non-zero GRPO gradient
    refs = dict(weights)
    if not moved:
        gen = torch.Generator().manual_seed(0)
        base = read_weights(smollm2)
        scale = {k: float(v.std()) if v.numel() > 1 else 0.0 for k, v in base.items()}
        save_file(
            {
                k: (v + 0.02 * scale[k] * torch.randn(v.shape, generator=gen)).contiguous()
                for k, v in base.items()
            },
            str(tmp_path / "perturbed.safetensors"),
        )
        refs["perturbed"] = tmp_path / "perturbed.safetensors"
    diffs: dict[str, dict[str, float]] = {}
    for label, path in refs.items():  # v0 first: the model as loaded
        if path is not None:
            model.load_weights(read_weights(path))
        for want in weights:
            err = []
            for call in calls:
                prompt = call["prompt_token_ids"]
                done: list[int] = []
                for seg in call["segments"]:
                    if (
                        seg["engine_id"] == "s0"
                        and seg["token_ids"]
                        and set(seg["versions"]) == {want}
                        and len(err) < 32
                    ):
                        ref = _logprobs(model, prompt + done, seg["token_ids"])
                        err += [abs(a - b) for a, b in zip(ref, seg["logprobs"], strict=True)]
                    done += seg["token_ids"]
            assert err, (want, "no vLLM tokens of that version")
            diffs.setdefault(want, {})[label] = sum(err) / len(err)
    print(
        "mean |logprob(vLLM) - logprob(tidal, weights)| by label, weights:",
        diffs,
        "(trained weights differ)" if moved else "(versions equal: a perturbed v0 instead)",
    )
    for want in weights:
        assert diffs[want][want] < 0.02, diffs
        others = [w for w in refs if w != want and (moved or w == "perturbed")]
        assert others and all(diffs[want][o] > 3 * diffs[want][want] for o in others), diffs
