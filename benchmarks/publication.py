"""A weight version from the trainer into a built-in engine, by carrier, beside memcpy.

One process, a randomly initialised Llama of SmolLM2-135M's shape (0.54 GB float32; no weights
on disk needed) serving in the built-in ``Engine``. Per carrier, best of ``--repeats``:
- write: the core's write of the version (``SegmentRing`` into /dev/shm: one pass, each piece
  copied into the writer's kept mapping of a reused segment and checked finite in the cache;
  ``FilePublisher`` into the run directory's disk);
- load: ``Engine.update_weights`` from that path until it returns, i.e. until the engine serves
  the version (a segment: mapped, checked whole, its pages adopted as the weights, no copy; the
  file: checked whole, then read into the weights);
- GB/s: the version's bytes over write + load;
beside memcpy: ``dst.copy_(src)`` of the same bytes between two buffers already in memory (best
of 3, as ``tidal run`` measures it at start). ``tidal run`` adds a Ray call and an HTTP request
per engine: the summary's ``publication`` has the span from the first byte written to the last
engine's reply, per run.

``--busy F``: a Python thread of the same process busy a fraction F of every millisecond
meanwhile (as a driver's event loop beside the trainer): each numpy call of the write gives
the GIL back and waits to take it again (2026-12-06: F=1 made the 0.54 GB write 8.8 s with
256 KiB pieces, 4.0 s with 1 MiB ones; docs/weights.md).

Run: ``.venv/bin/python benchmarks/publication.py [--repeats 3] [--dir /tmp] [--busy 0.3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path

import torch

from tidal.models.llama import SMOLLM2_135M, LlamaConfig, LlamaForCausalLM
from tidal.runtime.publisher import memcpy_gbps
from tidal.serving.engine import Engine, EngineConfig
from tidal.training.carriers import SegmentRing, segment_root
from tidal.training.flat import ParamLayout
from tidal.training.transport import FilePublisher


class _Ids:
    eos_id = 0

    def decode(self, ids: list[int]) -> str:
        return ""


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.model_validate(SMOLLM2_135M))


def _busy(fraction: float, stop: threading.Event) -> None:
    """Pure Python work ``fraction`` of each millisecond (it holds the GIL), asleep the rest."""
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < fraction * 1e-3:
            pass
        if fraction < 1:
            time.sleep((1 - fraction) * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the file goes (disk)")
    ap.add_argument(
        "--busy", type=float, default=0.0, help="a Python thread busy this fraction of each ms"
    )
    args = ap.parse_args()
    if not 0.0 <= args.busy <= 1.0:
        ap.error("--busy: a fraction from 0 to 1")
    trainer = model()
    layout = ParamLayout.of(trainer)
    nbytes = layout.numel * 4
    print(f"version: {layout.numel / 1e6:.1f}M parameters, {nbytes / 1e9:.3f} GB float32")
    print(f"memcpy: {memcpy_gbps(nbytes):.2f} GB/s (best of 3, {nbytes / 1e9:.2f} GB)")
    engine = Engine(model(), _Ids(), "/nonexistent", EngineConfig(name="bench"))
    params = dict(trainer.named_parameters())
    root = Path(args.dir) / "tidal-publication-bench"
    carriers = {
        "shm": SegmentRing(segment_root("bench"), layout),
        "file": FilePublisher(root, layout),
    }

    async def load(path: str, label: str) -> float:
        t0 = time.perf_counter()
        await engine.update_weights(path, label)
        return time.perf_counter() - t0

    stop = threading.Event()
    if args.busy > 0:
        threading.Thread(target=_busy, args=(args.busy, stop), daemon=True).start()
        print(f"a Python thread busy {args.busy:.0%} of each millisecond meanwhile")
    for name, writer in carriers.items():
        best = None
        for r in range(args.repeats + 2):  # the first two fill the ring (new pages)
            version = 10 * (r + 1)
            t0 = time.perf_counter()
            writer.publish_stream(version, iter(params.items()))
            write_s = time.perf_counter() - t0
            load_s = asyncio.run(load(writer.path(version), f"v{version}"))
            if r >= 2 and (best is None or write_s + load_s < sum(best)):
                best = (write_s, load_s)
        assert best is not None
        total = sum(best)
        print(
            f"{name:5s} write {best[0]:.3f} s, load {best[1]:.3f} s (pause "
            f"{engine.last_pause_s:.3f} s): {nbytes / total / 1e9:.2f} GB/s"
        )
    stop.set()
    carriers["shm"].close()
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
