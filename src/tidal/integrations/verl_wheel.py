"""verl's released code, fetched with pip and loaded without verl's dependencies.

In: a verl version (``VERL_VERSION``) and a cache directory (``$TIDAL_CACHE_DIR/verl``, else
``~/.cache/tidal/verl``). Out: the unpacked wheel and module objects built from its own files:
``load_dynamic_schedule`` (the policy files of ``fully_async_policy/dynamic_schedule``: base,
default, fixed_ratio, static_fully_async, executed as they are) and ``load_switch`` (the hybrid
switch methods of the V1 separate-async trainer, compiled from that file's source).

Nothing is stubbed: the files run as released. Only the package skeleton above them is made up
(``verl``, ``verl.experimental``, ... are empty packages whose ``__path__`` points into the
wheel, so ``verl/__init__.py`` and its imports of torch, transformers... never run). Two files
import something heavy at module level, and only the code that is needed is taken from them:
``default_policy.py`` and ``fixed_ratio_policy.py`` import ``ray`` for ``request_rebalance``'s
RPC to the rollouter (without a rollouter attached the method returns before touching it): the
file runs as is when ray is installed, else with that one import statement left out;
``trainer_separate_async.py`` imports Ray, omegaconf, transfer_queue and the trainer base, so
its ``HybridEngineMode`` enum and the switch methods of ``PPOTrainerSeparateAsync`` are
compiled from the file's own source text into a class the caller gives the environment
(clock, replay buffer, switches) that the trainer would.

The modules are registered under their real names only while they load (their imports need
it) and removed from ``sys.modules`` afterwards, so nothing else in the process sees a
``verl`` package. Errors: ``RegistryUnreachable`` (pip could not reach any package index: the
caller may skip), ``WheelError`` (anything else: a download that failed while an index
answered, a bad checksum, a file missing from the wheel).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import os
import subprocess
import sys
import types
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tidal.errors import TidalError

VERL_VERSION = "0.9.1"
WHEEL_NAME = f"verl-{VERL_VERSION}-py3-none-any.whl"
# sha256 of the wheel PyPI serves for verl 0.9.1 (pip checks the index's hash too).
WHEEL_SHA256 = "db6e6f2a8d9d5808d9ec32d357a42319fdc6967df688ff9d9810050f49bfdd14"
DYNAMIC_SCHEDULE = "verl/experimental/fully_async_policy/dynamic_schedule"
SEPARATE_ASYNC = "verl/trainer/ppo/v1/trainer_separate_async.py"
SWITCH_METHODS = (
    "_init_hybrid_rollout_state",
    "on_step_begin",
    "_timed_switch_to_trainer",
    "on_sample_begin",
    "on_sample_end",
    "_wait_for_sampleable_and_switch",
    "_switch_threshold",
    "_step_had_idle",
    "_adapt_switch_threshold",
    "_effective_switch_cost",
    "on_step_end",
)


class WheelError(TidalError):
    """verl's wheel could not be fetched or loaded (and a package index did answer)."""


class RegistryUnreachable(WheelError):
    """pip could not reach any package index: there is no way to fetch the wheel here."""


def cache_dir() -> Path:
    root = os.environ.get("TIDAL_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "tidal"
    return base / "verl"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _index_urls() -> list[str]:
    """The http(s) package indexes pip would use (its config, else PyPI)."""
    urls: list[str] = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        for line in out.splitlines():
            key, _, val = line.partition("=")
            if key.endswith(("index-url", "extra-index-url")):
                urls += val.strip().strip("'\"").split()
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        urls += os.environ.get(var, "").split()
    urls = list(dict.fromkeys(u for u in urls if u.startswith(("http://", "https://"))))
    return urls or ["https://pypi.org/simple/"]


def _reachable(url: str, timeout_s: float = 10.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/verl/", timeout=timeout_s):
            return True
    except Exception:  # any failure to get an answer counts as unreachable here
        return False


def fetch_wheel(cache: Path | None = None, timeout_s: float = 300.0) -> Path:
    """The verl wheel in the cache, downloaded with ``pip download`` the first time."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / WHEEL_NAME
    if not wheel.exists():
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"verl=={VERL_VERSION}",
            "--no-deps",
            "--only-binary=:all:",
            "--retries",
            "1",
            "--timeout",
            "30",
            "-d",
            str(cache),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc = None
        if proc is None or proc.returncode != 0 or not wheel.exists():
            why = "timed out" if proc is None else (proc.stderr.strip().splitlines() or ["?"])[-1]
            indexes = _index_urls()
            if not any(_reachable(u) for u in indexes):
                raise RegistryUnreachable(
                    f"pip download verl=={VERL_VERSION}: no package "
                    f"registry reachable ({', '.join(indexes)}): {why}"
                )
            raise WheelError(f"pip download verl=={VERL_VERSION} failed: {why}")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise WheelError(
            f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256} (delete it to fetch it again)"
        )
    return wheel


def unpack(wheel: Path | None = None) -> Path:
    """The wheel's files under ``<cache>/verl-<version>/`` (extracted once)."""
    wheel = wheel or fetch_wheel()
    root = wheel.parent / f"verl-{VERL_VERSION}"
    done = root / ".unpacked"
    if not done.exists():
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(root)
        done.write_text(WHEEL_SHA256)
    return root


# --------------------------------------------------------------------------- loading
@contextlib.contextmanager
def _skeleton(root: Path, packages: list[str]) -> Iterator[None]:
    """Empty packages named as verl's, each ``__path__`` into the wheel; removed on exit with
    every ``verl.*`` module loaded meanwhile."""
    saved = {k: v for k, v in sys.modules.items() if k == "verl" or k.startswith("verl.")}
    for k in saved:
        del sys.modules[k]
    try:
        for name in packages:
            mod = types.ModuleType(name)
            mod.__path__ = [str(root / name.replace(".", "/"))]
            mod.__package__ = name
            sys.modules[name] = mod
        yield
    finally:
        for k in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _ray_importable() -> bool:
    return importlib.util.find_spec("ray") is not None


def _load_file(name: str, path: Path, drop_imports: tuple[str, ...] = ()) -> types.ModuleType:
    """Executes one wheel file as module ``name`` (registered in ``sys.modules``)."""
    if not path.exists():
        raise WheelError(f"{path} is not in the wheel")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    if not drop_imports:
        spec.loader.exec_module(mod)
        return mod
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [
        n
        for n in tree.body
        if not (isinstance(n, ast.Import) and all(a.name in drop_imports for a in n.names))
    ]
    exec(compile(tree, str(path), "exec"), mod.__dict__)
    return mod


def load_dynamic_schedule(root: Path | None = None) -> types.SimpleNamespace:
    """verl's ``dynamic_schedule`` policy files, executed from the wheel.

    Returns a namespace with the modules ``base``, ``default``, ``fixed_ratio``, ``static``
    and their public objects ``DynamicScheduleContext``, ``DynamicSchedulePolicyBase``,
    ``register_policy``, ``build_policy``, ``registry`` (the dict behind them).
    """
    root = root or unpack()
    pkg = DYNAMIC_SCHEDULE.replace("/", ".")
    drop = () if _ray_importable() else ("ray",)
    d = root / DYNAMIC_SCHEDULE
    with _skeleton(
        root, ["verl", "verl.experimental", "verl.experimental.fully_async_policy", pkg]
    ):
        base = _load_file(f"{pkg}.base", d / "base.py")
        default = _load_file(f"{pkg}.default_policy", d / "default_policy.py", drop)
        fixed = _load_file(f"{pkg}.fixed_ratio_policy", d / "fixed_ratio_policy.py", drop)
        static = _load_file(f"{pkg}.static_fully_async_policy", d / "static_fully_async_policy.py")
    return types.SimpleNamespace(
        root=root,
        base=base,
        default=default,
        fixed_ratio=fixed,
        static=static,
        DynamicScheduleContext=base.DynamicScheduleContext,
        DynamicSchedulePolicyBase=base.DynamicSchedulePolicyBase,
        register_policy=base.register_policy,
        build_policy=base.build_policy,
        registry=base._policy_registry,
    )


@contextlib.contextmanager
def importable(ns: types.SimpleNamespace) -> Iterator[None]:
    """While open, ``import verl.experimental.fully_async_policy.dynamic_schedule[.base]``
    finds the modules of ``ns`` (what a process with verl installed would see)."""
    pkg = DYNAMIC_SCHEDULE.replace("/", ".")
    with _skeleton(
        ns.root, ["verl", "verl.experimental", "verl.experimental.fully_async_policy", pkg]
    ):
        parent = sys.modules[pkg]
        for attr in (
            "DynamicScheduleContext",
            "DynamicSchedulePolicyBase",
            "register_policy",
            "build_policy",
        ):
            setattr(parent, attr, getattr(ns, attr))
        sys.modules[f"{pkg}.base"] = ns.base
        sys.modules[f"{pkg}.default_policy"] = ns.default
        sys.modules[f"{pkg}.fixed_ratio_policy"] = ns.fixed_ratio
        sys.modules[f"{pkg}.static_fully_async_policy"] = ns.static
        yield


def load_switch_config(root: Path | None = None) -> type:
    """verl's ``HybridRolloutSwitchConfig`` (``verl/trainer/config/config.py`` and its only
    import, ``verl/base_config.py``, executed from the wheel)."""
    root = root or unpack()
    with _skeleton(root, ["verl", "verl.trainer", "verl.trainer.config"]):
        _load_file("verl.base_config", root / "verl/base_config.py")
        cfg = _load_file("verl.trainer.config.config", root / "verl/trainer/config/config.py")
    return cfg.HybridRolloutSwitchConfig


def load_switch(
    env: dict[str, Any], root: Path | None = None, methods: tuple[str, ...] = SWITCH_METHODS
) -> tuple[type, type]:
    """The switch methods of verl's ``PPOTrainerSeparateAsync`` and its ``HybridEngineMode``.

    ``env`` gives the module globals those methods read besides the ones of the file's own
    imports that they need: ``time`` (an object with ``perf_counter()``), ``marked_timer``
    (verl's context manager: adds the elapsed time to ``timing_raw[name]``) and ``logger``.
    Returns ``(SwitchMethods, HybridEngineMode)``: a class whose methods are verl's, compiled
    from the file's source, to be mixed into an object that provides the trainer's state.
    """
    root = root or unpack()
    path = root / SEPARATE_ASYNC
    if not path.exists():
        raise WheelError(f"{path} is not in the wheel")
    source = path.read_text()
    tree = ast.parse(source, str(path))
    by_name = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    trainer, mode = by_name.get("PPOTrainerSeparateAsync"), by_name.get("HybridEngineMode")
    if trainer is None or mode is None:
        raise WheelError(f"{path}: PPOTrainerSeparateAsync or HybridEngineMode is missing")
    funcs = {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    missing = [m for m in methods if m not in funcs]
    if missing:
        raise WheelError(f"{path}: PPOTrainerSeparateAsync has no {', '.join(missing)}")
    switch = ast.ClassDef(
        name="SwitchMethods",
        bases=[],
        keywords=[],
        decorator_list=[],
        body=[funcs[m] for m in methods],
    )
    if "type_params" in ast.ClassDef._fields:  # Python >= 3.12
        switch.type_params = []
    imports = [
        n
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module in ("collections", "dataclasses", "enum")
    ]
    module = ast.Module(body=[*imports, mode, switch], type_ignores=[])
    ast.fix_missing_locations(module)
    glb: dict[str, Any] = {"__name__": "verl_switch_from_wheel", **env}
    exec(compile(module, str(path), "exec"), glb)
    return glb["SwitchMethods"], glb["HybridEngineMode"]


def load_class(
    rel_path: str,
    class_name: str,
    env: dict[str, Any],
    methods: tuple[str, ...] | None = None,
    root: Path | None = None,
) -> type:
    """One class (or some of its methods) of a wheel file, compiled from the file's source
    with the module globals ``env`` (for files whose module-level imports are heavy)."""
    root = root or unpack()
    path = root / rel_path
    if not path.exists():
        raise WheelError(f"{path} is not in the wheel")
    tree = ast.parse(path.read_text(), str(path))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise WheelError(f"{path}: no class {class_name}")
    if methods is not None:
        funcs = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        missing = [m for m in methods if m not in funcs]
        if missing:
            raise WheelError(f"{path}: {class_name} has no {', '.join(missing)}")
        cls = ast.ClassDef(
            name=class_name,
            bases=[],
            keywords=[],
            decorator_list=[],
            body=[funcs[m] for m in methods],
        )
        if "type_params" in ast.ClassDef._fields:  # Python >= 3.12
            cls.type_params = []
    module = ast.Module(body=[cls], type_ignores=[])
    ast.fix_missing_locations(module)
    glb: dict[str, Any] = {"__name__": f"verl_wheel_{class_name}", **env}
    exec(compile(module, str(path), "exec"), glb)
    return glb[class_name]


def ensure_loaded(on_skip: Callable[[str], Any]) -> types.SimpleNamespace:
    """``load_dynamic_schedule()``, or ``on_skip(reason)`` when no registry is reachable."""
    try:
        return load_dynamic_schedule()
    except RegistryUnreachable as exc:
        return on_skip(f"verl {VERL_VERSION}'s wheel is needed and {exc}")
