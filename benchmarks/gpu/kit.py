"""Shared pieces of the GPU check (``check.py``): sizes, the models it builds on the device,
memory readings, the simulator's predictions, and the figures a step hands back.

In: a size name (``full`` on a GPU, ``tiny`` for the CPU dry run) and a torch device. Out: model
shapes taken from the simulator's shipped ``config.json`` (``tidal/sim/data/models``: the
Qwen2.5-7B shape; the SmolLM2-135M shape for the precision check), models with random weights
drawn on the device itself (no download, no file), GPU memory as torch and ``nvidia-smi`` see
it, and ``Figures``: the rows one step contributes to the check's JSON and table.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BIG_MODEL = "qwen2.5-7b"
BIG_CONFIG = ROOT / "src" / "tidal" / "sim" / "data" / "models" / f"{BIG_MODEL}.json"
MiB, GiB = 2**20, 2**30
# structural fields both the built-in engine and transformers read from a config.json
FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
    "rms_norm_eps",
    "max_position_embeddings",
)
TINY = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# tidal's plain (unsharded) trainer in bf16 with AdamW, bytes per parameter: weights and
# gradients (2 + 2), the worker's pending and summed float32 gradient vectors (4 + 4), the
# aggregated vector (4) and AdamW's two moments in the weights' dtype (2 + 2)
TRAINER_BYTES_PER_PARAM = 20


class Skip(Exception):
    """The step cannot run here; the message says why (recorded, not a failure)."""


@dataclass(frozen=True)
class Sizes:
    name: str
    overrides: dict  # applied to the big and the mid shape (tiny: a few-layer model)
    decode_batches: tuple[int, ...] = (1, 8, 32, 128)
    prompt_tokens: int = 16
    new_tokens: int = 32
    compare_prompts: int = 4
    compare_tokens: int = 12
    train_groups: int = 2  # of 4 executions each
    train_output_tokens: int = 256
    trainer_memory_share: float = 0.6  # of the GPU's memory the offload step's trainer may use


SIZES = {
    "full": Sizes("full", {}),
    "tiny": Sizes("tiny", TINY, new_tokens=4, compare_tokens=6, train_output_tokens=24),
}


def big_shape(sizes: Sizes) -> dict:
    """The Qwen2.5-7B ``config.json`` the simulator ships (tiny: its type, fewer dimensions)."""
    raw = json.loads(BIG_CONFIG.read_text())
    shape = {k: raw[k] for k in FIELDS if k in raw}
    shape.update({"rms_norm_eps": 1e-6, "max_position_embeddings": 4096, **sizes.overrides})
    return shape


def mid_shape(sizes: Sizes) -> dict:
    """SmolLM2-135M's shape (tiny: the tiny dimensions with its model type)."""
    from tidal.models.llama import SMOLLM2_135M

    shape = {"model_type": "llama", **{k: v for k, v in SMOLLM2_135M.items() if k in FIELDS}}
    return {**shape, **sizes.overrides}


def with_layers(shape: dict, layers: int) -> dict:
    return {**shape, "num_hidden_layers": layers}


def params_of(shape: dict) -> int:
    """Parameter count of a llama / qwen2 shape (q/k/v biases for qwen2)."""
    h, v, i, n = (
        shape[k] for k in ("hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers")
    )
    kv = (
        h
        // shape["num_attention_heads"]
        * shape.get("num_key_value_heads", shape["num_attention_heads"])
    )
    bias = h + 2 * kv if shape["model_type"] == "qwen2" else 0
    layer = 2 * h * h + 2 * h * kv + bias + 3 * h * i + 2 * h
    return v * h * (1 if shape.get("tie_word_embeddings") else 2) + n * layer + h


def engine_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """The built-in engine's model of ``shape``, made on ``device`` (no CPU copy, no file)."""
    from tidal.models.llama import LlamaConfig, LlamaForCausalLM, fill_random_

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.model_validate(shape)).to(dtype=dtype)
    model.materialize(device)
    fill_random_(model, seed)
    return model.eval()


def trainer_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """The transformers model of ``shape`` (what tidal's trainer trains), made on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tidal.models.llama import fill_random_

    cfg = AutoConfig.for_model(**shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    fill_random_(model, seed)
    return model


class _Ids:
    """The tokenizer surface the engine uses (no text is needed here)."""

    eos_id = 0

    def decode(self, ids: list[int]) -> str:
        return ""


TOKENIZER = _Ids()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def smi_used_mib() -> float | None:
    """GPU 0's used memory by ``nvidia-smi`` (every process), None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    return float(out.stdout.strip()) if out.returncode == 0 else None


def memory(device: torch.device) -> dict[str, float | None]:
    """Allocated and reserved MiB by torch's allocator, used MiB by ``nvidia-smi``."""
    if device.type != "cuda":
        return {"allocated_mib": None, "reserved_mib": None, "smi_mib": None}
    torch.cuda.synchronize(device)
    return {
        "allocated_mib": torch.cuda.memory_allocated(device) / MiB,
        "reserved_mib": torch.cuda.memory_reserved(device) / MiB,
        "smi_mib": smi_used_mib(),
    }


def gpu_profile(device: torch.device) -> str:
    """The ``hardware.yaml`` GPU the simulator predicts for (H200 for the CPU dry run)."""
    from tidal.sim.profiles import _hardware

    if device.type != "cuda":
        return "H200"
    name = torch.cuda.get_device_name(device)
    found = [k for k in _hardware() if k in name.replace(" ", "")]
    if not found:
        raise Skip(f"{name} is not a GPU of tidal/sim/data/hardware.yaml")
    return max(found, key=len)


def sim_engine(shape: dict, gpu: str, tmp: Path):
    """``tidal.sim.perf``'s engine model (one GPU, bf16) of ``shape`` with the efficiencies the
    shipped scenarios are calibrated to (``dapo-math-32gpu``)."""
    from tidal.sim import scenario
    from tidal.sim.perf import build_engine
    from tidal.sim.profiles import load_gpu, model_from_config

    cm = scenario.load("dapo-math-32gpu").costmodel
    assert cm is not None
    model = model_from_config({**shape, "torch_dtype": "bfloat16"}, "check")
    return build_engine(
        load_gpu(gpu),
        model,
        1,
        cm.mem_fraction,
        cm.efficiency.decode,
        cm.efficiency.mfu,
        cm.step_overhead_s,
    ), cm


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


class Figures:
    """What one step measured: rows of (figure, value, unit, the simulator's value, note), and
    the checks it failed (the step is then ``failed`` but keeps its figures)."""

    def __init__(self, sink: Path | None = None) -> None:
        self.rows: list[dict] = []
        self.failures: list[str] = []
        self.sink = sink  # rewritten after every row: a step killed later keeps what it had

    def _flush(self) -> None:
        if self.sink is not None:
            self.sink.write_text(json.dumps({"figures": self.rows, "failures": self.failures}))

    def add(
        self,
        figure: str,
        value: float | int | str | None,
        unit: str = "",
        sim: float | None = None,
        note: str = "",
    ) -> None:
        if isinstance(value, float):
            value = round(value, 6)
        self.rows.append(
            {
                "figure": figure,
                "value": value,
                "unit": unit,
                "sim": None if sim is None else round(sim, 6),
                "note": note,
            }
        )
        self._flush()
        shown = value if not isinstance(value, float) else f"{value:.4g}"
        print(
            f"    {figure}: {shown} {unit}" + (f" (sim {sim:.4g})" if sim is not None else ""),
            flush=True,
        )

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)
            self._flush()
            print(f"    FAILED: {what}", flush=True)
