"""The built-in engine's control routes under bad input: every bad weights path or KV body is a
4xx naming it, never a 500; weights are checked whole (names, shapes, finite values) before a
version is served, and a refused version leaves the old one answering. A real engine on a real
uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import struct

import httpx
import torch
from safetensors.torch import save_file

from tidal.models import load_model
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.engine_server import build_engine_app

TOKEN = "engine-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CALL = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0, "logprobs": 0}


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _bad_weights(model, tmp_path) -> dict[str, str]:
    """name -> a .safetensors path that is wrong in one way each."""
    good = _params(model)
    first = next(iter(good))
    cases = {
        "nan": {k: torch.full_like(v, float("nan")) for k, v in good.items()},
        "inf": {**good, first: torch.full_like(good[first], float("inf"))},
        "shape": {**good, first: torch.zeros(3, 3)},
        "missing": {k: v for k, v in good.items() if k != first},
        "unknown": {**good, "extra.weight": torch.zeros(2)},
    }
    out = {}
    for name, sd in cases.items():
        out[name] = str(tmp_path / f"{name}.safetensors")
        save_file(sd, out[name])
    return out


def test_bad_weights_are_refused_and_the_old_version_keeps_serving(tiny_dir, serve_asgi, tmp_path):
    model, tok = load_model(tiny_dir)
    eng = Engine(model, tok, tiny_dir, EngineConfig())
    bad = _bad_weights(model, tmp_path)
    (tmp_path / "text.safetensors").write_text("not weights")
    (tmp_path / "empty").mkdir()
    paths = {
        "/etc/passwd": "/etc/passwd",
        "config.json": str(tiny_dir / "config.json"),
        "relative ..": os.path.relpath("/etc", os.getcwd()) + "/../etc",
        "traversal": f"{tiny_dir}/../../../etc/passwd",
        "not safetensors inside": str(tmp_path / "text.safetensors"),
        "dir without weights": str(tmp_path / "empty"),
        "absent": str(tmp_path / "absent.safetensors"),
        **bad,
    }

    async def main():
        async with (
            serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as url,
            httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as c,
        ):
            before = (await c.post("/v1/completions", json=CALL)).json()["choices"][0]
            answers = {
                name: await c.post(
                    "/update_weights", json={"path": path, "weight_version": f"bad-{name}"}
                )
                for name, path in paths.items()
            }
            after = (await c.post("/v1/completions", json=CALL)).json()["choices"][0]
            version = (await c.get("/weight_info")).json()["weight_version"]
            good = await c.post("/update_weights", json={"path": good_path, "weight_version": "v1"})
            return before, answers, after, version, good

    good_path = str(tmp_path / "good.safetensors")
    save_file(_params(model), good_path)
    before, answers, after, version, good = asyncio.run(main())
    assert good.status_code == 200 and good.json()["weight_version"] == "v1", good.text
    for name, resp in answers.items():
        msg = resp.json()["error"]["message"]
        assert resp.status_code == 400 and msg.startswith("path:"), (name, resp.text)
        assert paths[name] in msg, (name, msg)
    assert "NaN or infinite" in answers["nan"].json()["error"]["message"]
    assert "shape" in answers["shape"].json()["error"]["message"]
    assert "missing" in answers["missing"].json()["error"]["message"]
    # nothing changed: same version, same greedy tokens, finite log-probs
    assert version == "v0" and after["finish_reason"] == "length"
    assert after["token_ids"] == before["token_ids"]
    assert all(lp == lp for lp in after["logprobs"]["token_logprobs"])


def _header_blob(header) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def test_garbage_kv_bodies_are_4xx_naming_the_body(tiny_dir, serve_asgi):
    model, tok = load_model(tiny_dir)
    eng = Engine(model, tok, tiny_dir, EngineConfig())
    fp = eng.kv.fingerprint()
    bodies = {
        "short": b"\x01\x02",
        "garbage": os.urandom(64),
        "huge header length": struct.pack("<Q", 2**60) + b"{}",
        "header a list": _header_blob([1, 2]),
        "metadata a list": _header_blob({"__metadata__": [1]}),
        "no tokens": _header_blob({"__metadata__": {"fingerprint": fp}}),
        "tokens not json": _header_blob({"__metadata__": {"fingerprint": fp, "tokens": "[1,"}}),
        "tokens not ints": _header_blob({"__metadata__": {"fingerprint": fp, "tokens": '["a"]'}}),
        "no tensors": _header_blob({"__metadata__": {"fingerprint": fp, "tokens": "[1, 2]"}}),
    }
    wrong_shape = {"k.0": torch.zeros(1, 2), "v.0": torch.zeros(1, 2)}
    from safetensors.torch import save

    bodies["wrong tensors"] = save(wrong_shape, metadata={"fingerprint": fp, "tokens": "[1]"})

    async def main():
        async with (
            serve_asgi(build_engine_app(eng, "tiny", TOKEN)) as url,
            httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as c,
        ):
            out = {n: await c.post("/tidal/kv", content=b) for n, b in bodies.items()}
            ok = await c.post("/v1/completions", json=CALL)
            return out, ok

    out, ok = asyncio.run(main())
    for name, resp in out.items():
        assert resp.status_code == 400, (name, resp.status_code, resp.text)
        assert resp.json()["error"]["message"].startswith("body:"), (name, resp.text)
    assert ok.status_code == 200 and len(eng.kv) == 0
