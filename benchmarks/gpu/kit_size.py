"""What goes to a lent GPU machine, and whether it fits: the files the device tool sends (git's
tracked and untracked-but-not-ignored files) plus the carried wheel folder, against a limit.

In: ``--wheels DIR`` (``gpu-kit/wheels``), ``--limit-mib`` (60: the machine takes 64 MiB in all).
Out: one line per part and the total in MiB; exit 1 when the total is over the limit.
Run: ``python benchmarks/gpu/kit_size.py`` (``make gpu-kit`` does, after downloading).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def tree_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes) of what the device tool copies: tracked plus untracked, not ignored."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    paths = {p for p in out.decode().split("\0") if p}
    sizes = [(root / p).stat().st_size for p in paths if (root / p).is_file()]
    return len(sizes), sum(sizes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=ROOT / "gpu-kit" / "wheels")
    ap.add_argument("--limit-mib", type=float, default=60.0)
    args = ap.parse_args(argv)
    files, tree = tree_bytes(ROOT)
    wheels = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    kit = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.name}: {w.stat().st_size / MiB:.2f} MiB")
    total = tree + kit
    print(
        f"source tree {tree / MiB:.1f} MiB ({files} files) + {len(wheels)} wheels "
        f"{kit / MiB:.1f} MiB = {total / MiB:.1f} MiB (limit {args.limit_mib:.0f} MiB)"
    )
    if total > args.limit_mib * MiB:
        print(
            f"kit_size: {total / MiB:.1f} MiB is over the {args.limit_mib:.0f} MiB limit",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
