from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tidal.models import create_tiny

    return create_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=1, max_seq_len=512)


@pytest.fixture(scope="session")
def serve_asgi():
    """``async with serve_asgi(app, **limits) as url``: the app on a real uvicorn server on
    loopback (the bounded protocol of ``tidal.serving.guard``), in the running loop."""
    import asyncio
    import contextlib

    import uvicorn

    from tidal.serving.guard import bounded_protocol
    from tidal.serving.launch import free_port

    @contextlib.asynccontextmanager
    async def serve(app, port: int | None = None, **limits):
        port = port or free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=port,
                log_level="warning",
                loop="asyncio",
                http=bounded_protocol(**limits),
                timeout_keep_alive=120,
            )
        )
        server.install_signal_handlers = lambda: None  # older uvicorn
        task = asyncio.create_task(server.serve())
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started, "uvicorn did not start"
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)

    return serve
