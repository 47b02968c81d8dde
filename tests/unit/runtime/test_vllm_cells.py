"""vLLM cells without a server: what ``runtime.cell_backend`` refuses (one ``ConfigError``
naming the field), which backend serves which engine, the memory measure of a server's process
group, the summary's switch times, and the vLLM adapter's refusal of tokens without log-probs
(a filled-in 0.0 would corrupt the policy-gradient ratio). The server path is in
tests/integration/runtime/test_vllm_cell.py and test_vllm_run.py (vLLM tier).
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidal.config import RunConfig, load_yaml, validate_model
from tidal.errors import ConfigError
from tidal.runtime.engines import cell_backend
from tidal.runtime.outputs import switch_times
from tidal.runtime.server_process import group_rss_bytes
from tidal.runtime.wiring import check_config
from tidal.serving.protocol import EngineError
from tidal.serving.vllm_adapter import chunk_tokens
from tidal.types import Direction


def _cfg(cells=None, **runtime) -> RunConfig:
    base = load_yaml("configs/vllm.yaml").model_dump(mode="json")
    for key, value in runtime.items():  # a backend's section (vllm, sglang) is merged
        if isinstance(value, dict) and isinstance(base["runtime"].get(key), dict):
            base["runtime"][key] = {**base["runtime"][key], **value}
        else:
            base["runtime"][key] = value
    if cells is not None:
        base["cluster"]["cells"] = cells
    return validate_model(RunConfig, base)


@pytest.fixture
def vllm_python(monkeypatch):
    monkeypatch.setenv("TIDAL_VLLM_PYTHON", os.path.realpath(sys.executable))


def test_vllm_yaml_serves_every_engine_with_vllm(vllm_python):
    cfg = _cfg()
    check_config(cfg)
    assert cfg.runtime.standalone_backend == cfg.runtime.cell_backend == "vllm"
    assert cfg.policy.name == "waterlevel" and not cfg.runtime.satellites


def test_vllm_args_reach_each_servers_settings(vllm_python):
    from tidal.runtime.vllm_host import vllm_settings

    cfg = _cfg(vllm={"args": "--enable-prefix-caching --max-num-batched-tokens 4096"})
    check_config(cfg)
    assert vllm_settings(cfg.runtime)["args"] == [
        "--enable-prefix-caching",
        "--max-num-batched-tokens",
        "4096",
    ]


def test_a_cell_may_name_its_own_backend(vllm_python):
    cfg = _cfg(cells=[{"gpus": 1, "slots": 4}, {"gpus": 1, "slots": 4, "backend": "builtin"}])
    assert [cell_backend(cfg, i) for i in range(2)] == ["vllm", "builtin"]


@pytest.mark.parametrize(
    "runtime, cells, field, words",
    [
        ({"cell_backend": "sglang"}, None, "runtime.cell_backend", "CUDA-only"),
        (
            {"cell_backend": "builtin"},
            [{"gpus": 1, "backend": "sglang"}],
            "runtime.cell_backend",
            "sglang",
        ),
        ({"model": "tiny", "standalone_backend": "builtin"}, None, "runtime.cell_backend", "tiny"),
        ({"cell_cpus": 1.0, "standalone_backend": "builtin"}, None, "runtime.cell_cpus", "vLLM"),
        (
            {"vllm": {"args": "--enable-prefix-caching --max-num-seqs 8"}},
            None,
            "runtime.vllm.args",
            "--max-num-seqs: tidal sets --max-num-seqs of each vLLM server itself "
            "(runtime.engine_max_batch)",
        ),
        (
            {"vllm": {"args": ["--max_model_len=1024"]}},
            None,
            "runtime.vllm.args",
            "(runtime.vllm.max_model_len)",
        ),  # vLLM's underscore spelling, with its value attached
        (
            {"vllm": {"args": ["-tp", "2"]}, "standalone_backend": "builtin"},
            None,
            "runtime.vllm.args",
            "(runtime.vllm.tensor_parallel)",
        ),
    ],
)
def test_what_vllm_cells_cannot_do_is_refused(vllm_python, runtime, cells, field, words):
    with pytest.raises(ConfigError) as info:
        check_config(_cfg(cells=cells, **runtime))
    assert info.value.field == field and words in info.value.message


def test_an_unknown_cell_backend_names_its_field():
    with pytest.raises(ConfigError) as info:
        _cfg(cell_backend="trt")
    assert info.value.field == "runtime.cell_backend"
    with pytest.raises(ConfigError) as info:
        _cfg(cells=[{"gpus": 1, "backend": "trt"}])
    assert info.value.field == "cluster.cells.0.backend"


def test_rss_of_a_process_group_counts_its_processes():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; b = bytearray(64 << 20); "
            "b[::4096] = b'x' * len(b[::4096]); time.sleep(30)",
        ],
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    try:
        deadline = 0
        while group_rss_bytes(child.pid) < 64 << 20 and deadline < 200:
            deadline += 1
            subprocess.run(["sleep", "0.05"], check=True)
        assert group_rss_bytes(child.pid) >= 64 << 20  # its 64 MiB, touched
    finally:
        child.kill()
        child.wait(10)
    assert group_rss_bytes(child.pid) == 0  # no process left in the group


@given(
    st.lists(
        st.tuples(st.sampled_from(list(Direction)), st.floats(0.0, 100.0, allow_nan=False)),
        max_size=20,
    )
)
def test_switch_times_per_direction(plans):
    done = [(SimpleNamespace(direction=d), s) for d, s in plans]
    out = switch_times(done)
    for d in Direction:
        ds = sorted(s for x, s in plans if x is d)
        if not ds:
            assert d.value not in out
            continue
        row = out[d.value]
        assert row["n"] == len(ds) and row["max_s"] == round(max(ds), 3)
        assert round(min(ds), 3) <= row["p50_s"] <= row["max_s"]


def test_tokens_come_with_their_logprobs():
    ids, lps = chunk_tokens({"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -2]}}, "u")
    assert ids == [5, 6] and lps == [-0.5, -2.0]
    assert chunk_tokens({"token_ids": [], "text": "", "finish_reason": "stop"}, "u") == ([], [])
    assert chunk_tokens({"text": "", "finish_reason": "abort"}, "u") == ([], [])


@pytest.mark.parametrize(
    "choice, words",
    [
        ({"token_ids": [5], "logprobs": None}, "1 token ids with no log-probs"),
        ({"token_ids": [5, 6], "logprobs": {"token_logprobs": [-1.0]}}, "2 token ids with 1"),
        ({"token_ids": [5], "logprobs": {"token_logprobs": [None]}}, "not a number"),
        ({"token_ids": [5], "logprobs": {"token_logprobs": [0.5]}}, "outside"),
        ({"token_ids": [5], "logprobs": {"token_logprobs": [float("nan")]}}, "outside"),
        ({"text": "hi"}, "text without token_ids"),
    ],
)
def test_missing_or_wrong_logprobs_are_errors_never_zeros(choice, words):
    with pytest.raises(EngineError, match=words):
        chunk_tokens(choice, "http://x")


class _Cell:
    """A cell actor's ``load_weights`` as the actuator calls it (``.remote`` -> awaitable):
    it answers the label its engine reports after the load."""

    def __init__(self, serves: str) -> None:
        self.serves = serves
        self.load_weights = SimpleNamespace(remote=self._load)

    async def _load(self, path: str, label: str) -> str:
        return self.serves


def _actuator(cells: dict[int, _Cell], kv_handoff: bool = True):
    from tidal.clock import ManualClock
    from tidal.runtime.actuator import CoreLink, RayActuator, Weights
    from tidal.runtime.tasks import Parts

    # the driver's node holds every cell: each load is a file load (``Engines.load``)
    engines = SimpleNamespace(
        cell=lambda i: cells[i],
        transport=lambda eid: "file",
        load=lambda eid, actor, path, label: actor.load_weights.remote(path, label),
    )
    weights = Weights(version=2, path="/w/v2.safetensors")
    return RayActuator(ManualClock(), None, engines, weights, kv_handoff, Parts(), CoreLink())


def test_a_cell_that_serves_another_version_after_its_load_fails_the_step():
    import asyncio

    from tidal.runtime.cell import RuntimeFailure

    act = _actuator({0: _Cell("v2"), 1: _Cell("v1")})
    asyncio.run(act._load(0))  # read back v2: it may rejoin
    with pytest.raises(RuntimeFailure, match="cell 1 serves 'v1' after loading 'v2'"):
        asyncio.run(act._load(1))


def test_the_kv_handoff_step_accepts_a_reprefill_only_where_the_engine_cannot_hand_over():
    import asyncio

    from tidal.control.plans import StepKind
    from tidal.runtime.cell import RuntimeFailure

    act = _actuator({})
    act.drains = [
        {"cell": 0, "kv_handoff": False, "kv_capable": False, "moved": 2, "reprefill_tokens": 70},
        {"cell": 1, "kv_handoff": False, "kv_capable": True, "moved": 1},
    ]
    out = asyncio.run(act._check_handoff(0, StepKind.KV_HANDOFF))  # vLLM: re-prefilled
    assert out["choice"] == "reprefill" and out["reprefill_tokens"] == 70 and out["why"]
    with pytest.raises(RuntimeFailure, match="did not use the KV handoff"):
        asyncio.run(act._check_handoff(1, StepKind.KV_HANDOFF))  # built-in: it should have


@pytest.mark.parametrize(
    "settings, device, gpus, expected",
    [
        # the CPU: float32 (log-probs comparable to the trainer's), one worker, eager
        ({}, "cpu", [], ["--dtype", "float32", "--tensor-parallel-size", "1", "--enforce-eager"]),
        (
            {"dtype": "auto", "tensor_parallel": None},
            "cpu",
            ["0", "1"],
            ["--dtype", "float32", "--tensor-parallel-size", "1", "--enforce-eager"],
        ),
        (
            {"tensor_parallel": 2},
            "cpu",
            [],
            ["--dtype", "float32", "--tensor-parallel-size", "2", "--enforce-eager"],
        ),
        # CUDA: bfloat16, every GPU of the engine, CUDA graphs
        ({}, "cuda", ["4", "5", "6", "7"], ["--dtype", "bfloat16", "--tensor-parallel-size", "4"]),
        (
            {"tensor_parallel": 2, "dtype": "float16", "cuda_graphs": False},
            "cuda",
            ["0", "1"],
            ["--dtype", "float16", "--tensor-parallel-size", "2", "--enforce-eager"],
        ),
        # outside Ray (no GPU ids): the GPUs CUDA_VISIBLE_DEVICES shows, one unless told
        ({}, "cuda", [], ["--dtype", "bfloat16", "--tensor-parallel-size", "1"]),
    ],
)
def test_vllm_serves_with_the_engines_hardware(settings, device, gpus, expected):
    from tidal.runtime.vllm_host import serve_args

    assert serve_args(settings, device, gpus) == expected


def test_a_parallel_size_beyond_the_engines_gpus_is_one_line():
    from tidal.runtime.cell import RuntimeFailure
    from tidal.runtime.vllm_host import serve_args

    with pytest.raises(
        RuntimeFailure,
        match=r"runtime.vllm.tensor_parallel: 4 GPUs per vLLM "
        r"engine, but Ray gave this engine 2",
    ):
        serve_args({"tensor_parallel": 4}, "cuda", ["0", "1"])


def test_the_vllm_settings_come_from_the_config(vllm_python):
    from tidal.runtime.vllm_host import vllm_settings

    cfg = _cfg(vllm={"tensor_parallel": 2, "dtype": "bfloat16", "cuda_graphs": False})
    got = vllm_settings(cfg.runtime)
    assert (got["tensor_parallel"], got["dtype"], got["cuda_graphs"], got["device"]) == (
        2,
        "bfloat16",
        False,
        "cpu",
    )
    for field, value in [("tensor_parallel", 0), ("dtype", "fp8")]:
        with pytest.raises(ConfigError, match=f"runtime.vllm.{field}"):
            _cfg(vllm={field: value})
    with pytest.raises(ConfigError, match=r"^runtime.vllm_args: moved to runtime.vllm.args$"):
        _cfg(vllm_args=["--enable-prefix-caching"])


@pytest.mark.parametrize(
    "tp, cpus, expected",
    [
        (2, [0, 1], "0|1"),
        (2, [3, 0, 1, 2], "0,1|2,3"),
        (3, [0, 1, 2, 3, 4, 5, 6], "0,1|2,3|4,5"),
        (1, [5, 7], "5,7"),
    ],
)
def test_cpu_workers_get_equal_shares_of_the_engines_cpus(tp, cpus, expected):
    from tidal.runtime.vllm_host import cpu_thread_bind

    assert cpu_thread_bind(tp, cpus) == expected


def test_more_cpu_workers_than_cpus_is_one_line():
    from tidal.runtime.cell import RuntimeFailure
    from tidal.runtime.vllm_host import cpu_thread_bind

    with pytest.raises(RuntimeFailure, match=r"3 CPU workers, but this engine may use 2 CPUs"):
        cpu_thread_bind(3, [0, 1])
