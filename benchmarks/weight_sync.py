"""Weight publication and snapshot pull: times and GB/s beside a plain memory-copy baseline.

For each size (default 10M and 100M float32 parameters) this measures, in one run:
- memcpy: ``dst.copy_(src)`` of the flat vector in one process (the baseline);
- snapshot expose: the core copying its parameters into a flat snapshot (``params_to_flat``);
- shm publish: the core writing the vector into shared memory (seqlock-protected);
- shm pull: another process reading a stable copy of it;
- gloo publish / pull: the core -> satellite broadcast over their link group (2 processes);
- gloo prefix: the same broadcast to two satellites over a 3-member prefix group.

With ``--cluster ADDRESS`` (a Ray cluster, e.g. ``tidal cluster up``) it adds the transport a
run uses for an engine on another node than the driver (``Engines.transport``: the published
file through Ray's object store, written to the node's shared memory by the cell actor) and
the same pull by an actor on the driver's own node:
- object put (driver): the file's bytes into the driver node's object store;
- object pull + /dev/shm, same node / other node: an actor receiving them and writing the file;
- gloo link pull, other node: the core -> satellite broadcast (what a satellite on another node
  pulls a snapshot with), from the driver to an actor on another node.

Run: ``.venv/bin/python benchmarks/weight_sync.py [--sizes 10e6,100e6] [--repeats 3]
[--cluster 10.77.0.1:6390]``. Times are the best of ``--repeats``; GB/s counts the vector's
bytes once.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch

from tidal.training.flat import ParamLayout
from tidal.training.groups import GroupRegistry
from tidal.training.transport import BroadcastTransport, SharedMemoryTransport

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


class FlatModel(torch.nn.Module):
    """``n`` parameters in 8 tensors, like a small model's weight matrices."""

    def __init__(self, n: int) -> None:
        super().__init__()
        per = n // 8
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(per)) for _ in range(7))
        self.last = torch.nn.Parameter(torch.randn(n - 7 * per))


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _shm_reader(name: str, n: int, repeats: int, q) -> None:
    torch.set_num_threads(1)
    reader = SharedMemoryTransport(name, ParamLayout.of(FlatModel(n)), create=False)
    out = torch.empty(n)
    q.put(best(lambda: reader.pull(out, min_version=1), repeats))
    reader.close()


def _gloo_receiver(cell: int, port: int, n: int, repeats: int, with_prefix: bool, q) -> None:
    torch.set_num_threads(1)
    reg = GroupRegistry(cell, "127.0.0.1", port, f"s{cell}")
    out = torch.empty(n)
    link = BroadcastTransport(reg, reg.link(cell, f"s{cell}"))
    times = {"link": best(lambda: link.pull(out), repeats)}
    if with_prefix:
        pg = reg.prefix([(0, "core"), (1, "s1"), (2, "s2")])
        times["prefix"] = best(lambda: BroadcastTransport(reg, pg).pull(out), repeats)
    q.put((cell, times))


def run_size(n: int, repeats: int) -> list[tuple[str, float]]:
    ctx = mp.get_context("spawn")
    model = FlatModel(n)
    layout = ParamLayout.of(model)
    src, dst = torch.randn(n), torch.empty(n)
    rows = [("memcpy (baseline)", best(lambda: dst.copy_(src), repeats))]
    snap = torch.empty(n)
    rows.append(
        (
            "snapshot expose (params -> flat)",
            best(lambda: layout.params_to_flat(model, snap), repeats),
        )
    )

    name = f"tidal-bench-{os.getpid()}"
    shm = SharedMemoryTransport(name, layout, create=True)
    rows.append(("shm publish", best(lambda: shm.publish(1, snap), repeats)))
    q = ctx.Queue()
    proc = ctx.Process(target=_shm_reader, args=(name, n, repeats, q))
    proc.start()
    rows.append(("shm pull (other process)", q.get(timeout=600)))
    proc.join()
    shm.close()

    core = GroupRegistry(0, "127.0.0.1", 0, "core")
    procs = [
        ctx.Process(target=_gloo_receiver, args=(c, core.port, n, repeats, True, q)) for c in (1, 2)
    ]
    for p in procs:
        p.start()
    pub = {c: BroadcastTransport(core, core.link(c, f"s{c}")) for c in (1, 2)}
    rows.append(("gloo link publish (core)", best(lambda: pub[1].publish(1, snap), repeats)))
    best(lambda: pub[2].publish(1, snap), repeats)
    prefix = BroadcastTransport(core, core.prefix([(0, "core"), (1, "s1"), (2, "s2")]))
    rows.append(
        ("gloo prefix publish, 2 satellites", best(lambda: prefix.publish(1, snap), repeats))
    )
    received = dict(q.get(timeout=600) for _ in procs)
    rows.append(("gloo link pull (satellite)", received[1]["link"]))
    rows.append(
        (
            "gloo prefix pull (satellite)",
            statistics.mean([received[1]["prefix"], received[2]["prefix"]]),
        )
    )
    for p in procs:
        p.join()
    core.close()
    return rows


class _Sink:
    """A Ray actor that takes a published file's bytes as a cell actor does
    (``EngineHost.load_weights_blob``: written to this node's /dev/shm)."""

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def take(self, blob: bytes) -> int:
        path = f"/dev/shm/tidal-bench-{os.getpid()}.safetensors"
        with open(path, "wb") as f:
            f.write(blob)
        os.remove(path)
        return len(blob)


class _GlooSink:
    """A Ray actor on another node: a satellite's end of the core's gloo link, over the
    interface that holds its node's address (as a cell actor's satellite uses)."""

    def pull(self, host: str, port: int, n: int, repeats: int) -> float:
        from tidal.runtime.nodes import here

        os.environ["GLOO_SOCKET_IFNAME"] = here().gloo_iface()
        torch.set_num_threads(1)
        reg = GroupRegistry(1, host, port, "s1")
        out = torch.empty(n)
        link = BroadcastTransport(reg, reg.link(1, "s1"))
        t = best(lambda: link.pull(out), repeats)
        reg.close()
        return t


def _gloo_cross_node(ray, node: str, n: int, repeats: int) -> float:
    """The core -> satellite link broadcast from the driver to an actor on ``node``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from tidal.runtime.nodes import here

    me = here()
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = me.gloo_iface()  # the driver node's address
    try:
        core = GroupRegistry(0, me.ip, 0, "core")
        sink = (
            ray.remote(num_cpus=0)(_GlooSink)
            .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote()
        )
        ref = sink.pull.remote(me.ip, core.port, n, repeats)
        pub = BroadcastTransport(core, core.link(1, "s1"))
        snap = torch.randn(n)
        best(lambda: pub.publish(1, snap), repeats)
        t = ray.get(ref, timeout=600)
        core.close()
        ray.kill(sink)
        return t
    finally:
        os.environ["GLOO_SOCKET_IFNAME"] = before or "lo"


def cross_node_rows(address: str, n: int, repeats: int) -> list[tuple[str, float]]:
    """The object-store transport from the driver to an actor on its node and on another."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    here = ray.get_runtime_context().get_node_id()
    others = [x["NodeID"] for x in ray.nodes() if x["Alive"] and x["NodeID"] != here]
    if not others:
        raise SystemExit(f"--cluster {address}: one node only; start more (tidal cluster up)")
    sink = ray.remote(num_cpus=0)(_Sink)
    actors = {
        where: sink.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for where, node in (("same node", here), ("other node", others[0]))
    }
    assert ray.get(actors["other node"].node.remote(), timeout=120) != here
    blob = torch.randn(n).numpy().tobytes()
    put_t, rows = [], []
    pulls: dict[str, list[float]] = {k: [] for k in actors}
    for _ in range(repeats):
        for where, actor in actors.items():
            t0 = time.perf_counter()
            ref = ray.put(blob)  # a fresh object: a repeat must cross again
            put_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert ray.get(actor.take.remote(ref), timeout=600) == len(blob)
            pulls[where].append(time.perf_counter() - t0)
            del ref
    rows.append(("object put (driver)", min(put_t)))
    for where, ts in pulls.items():
        rows.append((f"object pull + /dev/shm, {where}", min(ts)))
    for a in actors.values():
        ray.kill(a)
    rows.append(("gloo link pull, other node", _gloo_cross_node(ray, others[0], n, repeats)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10e6,100e6", help="parameter counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument(
        "--cluster",
        default=None,
        help="a Ray cluster's address: add the cross-node transport (tidal cluster up)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"weight sync on {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"float32, best of {args.repeats}"
    )
    for n in (int(float(s)) for s in args.sizes.split(",")):
        nbytes = 4 * n
        rows = run_size(n, args.repeats)
        if args.cluster:
            rows += cross_node_rows(args.cluster, n, args.repeats)
        base = rows[0][1]
        print(f"\n{n / 1e6:.0f}M parameters ({nbytes / 1e9:.2f} GB)")
        print(f"  {'path':36s} {'time':>9s} {'GB/s':>7s} {'vs memcpy':>9s}")
        for label, t in rows:
            gbs = nbytes / t / 1e9
            print(f"  {label:36s} {t * 1e3:7.1f}ms {gbs:7.2f} {base / t:8.2f}x")


if __name__ == "__main__":
    main()
