"""A real HTTP server shaped like SGLang's, for tests: SGLang is CUDA-only and cannot run on a
machine without a GPU, so ``test_sglang_cell`` starts this instead, by SGLang's own command line
(``python -m sglang.launch_server ...`` through a two-line ``sglang`` package on the test's
PYTHONPATH). It is not a mock object: a process on loopback that holds real memory for its
"weights" and "KV cache" (released memory leaves its resident set, as SGLang's memory saver
releases GPU memory), really reads the safetensors files of a model directory on
``/update_weights_from_disk``, and keeps SGLang's state: paused, released tags, weight version.

Routes and shapes follow ``python/sglang/srt/entrypoints/http_server.py`` (sgl-project/sglang):
``/health``, ``/get_model_info``, ``/get_weight_version`` (``{"weight_version"}``),
``/pause_generation`` and ``/continue_generation`` (``{"message", "status": "ok"}``),
``/release_memory_occupation`` and ``/resume_memory_occupation`` (``{"tags": [...] | null}``,
empty answer), ``/update_weights_from_disk`` (``{"success", "message", "num_paused_requests"}``,
400 unless success; ``weight_version`` set on success), ``/flush_cache`` (plain text); with
``--api-key`` every route but ``/health*`` and ``/metrics`` needs ``Authorization: Bearer
<key>`` (SGLang's ``add_api_key_middleware``, python/sglang/srt/utils).
``/get_server_info`` answers the state the test inspects (SGLang's carries its server args).

Faults, for the refusal tests (``TIDAL_SGLANG_SHAPED_FAULT``): ``no_release`` (release answers
200 and frees nothing: a server started without ``--enable-memory-saver``), ``drops_version``
(loads but ignores ``weight_version``, as SGLang releases before the field did).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

TAGS = ("weights", "kv_cache")
MB = {"weights": 64, "kv_cache": 64}  # resident while held


def build(args: argparse.Namespace) -> FastAPI:
    app = FastAPI()
    fault = os.environ.get("TIDAL_SGLANG_SHAPED_FAULT", "")
    held: dict[str, bytearray] = {t: bytearray(b"\x07") * (MB[t] << 20) for t in TAGS}
    state = {
        "weight_version": args.weight_version,
        "paused": False,
        "released": [],
        "model_path": args.model_path,
        "loaded_tensors": 0,
        "pause_modes": [],
    }

    @app.middleware("http")
    async def api_key(request: Request, call_next):
        if (
            args.api_key
            and not request.url.path.startswith(("/health", "/metrics"))
            and request.headers.get("authorization") != f"Bearer {args.api_key}"
        ):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": state["model_path"],
            "tokenizer_path": args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state["weight_version"],
        }

    @app.get("/get_weight_version")
    async def weight_version():
        return {"weight_version": state["weight_version"]}

    @app.get("/get_server_info")
    async def server_info():
        return {**state, "enable_memory_saver": args.enable_memory_saver}

    @app.post("/pause_generation")
    async def pause(request: Request):
        body = await request.json() if await request.body() else {}
        state["paused"] = True
        state["pause_modes"].append(body.get("mode", "abort"))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def cont():
        state["paused"] = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release(request: Request):
        tags = (await request.json()).get("tags") or list(TAGS)
        for t in tags:
            if t not in state["released"]:
                state["released"].append(t)
                if fault != "no_release" and args.enable_memory_saver:
                    held.pop(t, None)  # freed: leaves the resident set
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume(request: Request):
        tags = (await request.json()).get("tags") or list(TAGS)
        for t in tags:
            if t in state["released"]:
                state["released"].remove(t)
                held.setdefault(t, bytearray(b"\x07") * (MB[t] << 20))
        return None

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush():
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        body = await request.json()
        d = Path(body["model_path"])
        fail = None
        if "weights" in state["released"]:
            fail = "weights are released: resume memory occupation first"
        elif not (d / "config.json").is_file():
            fail = f"{d}: no config.json"
        elif not list(d.glob("*.safetensors")):
            fail = f"{d}: no safetensors files"
        if fail:
            return JSONResponse(
                {
                    "success": False,
                    "message": f"Failed to update weights: {fail}",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        from safetensors import safe_open

        n = 0
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - not a dict
                    st.get_tensor(name)
                    n += 1
        state["model_path"], state["loaded_tensors"] = str(d), n
        msg = "Succeeded to update model weights."
        if body.get("weight_version") is not None and fault != "drops_version":
            state["weight_version"] = body["weight_version"]
            msg += f" Weight version updated to {body['weight_version']}."
        return {"success": True, "message": msg, "num_paused_requests": 0}

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--api-key")
    args, _rest = p.parse_known_args()  # --device, --dtype, ...: shapes of no consequence
    if not (Path(args.model_path) / "config.json").is_file():
        print(f"ValueError: {args.model_path} is not a model directory", file=sys.stderr)
        sys.exit(1)
    uvicorn.run(build(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
