"""Divergences between tidal's verl policies and verl 0.9.1's released code.

Fetches verl's wheel with pip (cached in ``~/.cache/tidal/verl``), runs its policy code without
verl's dependencies, and prints, per policy, how many random hook sequences (in
``FullyAsyncTrainer``'s order; the V1 trainer's step order for the switch) answered differently.

    .venv/bin/python benchmarks/verl_conformance.py [--sequences N] [--seed S]
"""

from __future__ import annotations

import argparse

from tidal.control.verl_hooks import HOOKS
from tidal.integrations import verl_conformance as vc
from tidal.integrations import verl_wheel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    ns = verl_wheel.load_dynamic_schedule()
    print(f"verl {verl_wheel.VERL_VERSION} ({ns.root}), {a.sequences} sequences per policy")
    for name in vc.VERL_NAMES:
        print(vc.compare(ns, name, lambda n, r, oh: HOOKS[n](r, oh), a.sequences, a.seed).line())
    clock = vc._Clock()
    switch_cls, mode = verl_wheel.load_switch(vc.switch_env(clock))
    print(
        vc.compare_switch(
            switch_cls, mode, verl_wheel.load_switch_config(), clock, a.sequences, a.seed
        ).line()
    )


if __name__ == "__main__":
    main()
