"""Issue 38 item (20) without Ray: a run's Ray folder is its user's alone, its logs end in the
run directory, and the folder a killed run left is swept by ``--resume``."""

from __future__ import annotations

import os

from tidal.runtime import ray_temp


def test_a_private_folder_its_logs_kept_and_a_killed_runs_folder_swept(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    private = ray_temp.make(run)
    assert private.stat().st_mode & 0o777 == 0o700 and len(str(ray_temp.for_ray(private))) < 44
    session = ray_temp.for_ray(private) / "session_1"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("x")
    os.chmod(ray_temp.for_ray(private), 0o777)  # as Ray leaves it
    # a SIGKILLed run: nothing ran finish; the resume sweeps it
    ray_temp.sweep(run)
    assert not private.exists() and not (run / "logs" / ray_temp.MARK).exists()
    assert (run / "logs" / "ray" / "session_1" / "raylet.out").read_text() == "x"
    ray_temp.sweep(run)  # nothing noted: nothing to do
