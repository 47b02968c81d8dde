import asyncio

from tidal.serving.adapters import HTTPEngineBase


class _Canned(HTTPEngineBase):
    text = (
        "# HELP vllm:num_requests_running running\n"
        'vllm:num_requests_running{model_name="a"} 3\n'
        'vllm:num_requests_running{model_name="b"} 2\n'
        "vllm:num_requests_waiting 1.0\n"
        "sglang:num_running_reqs 7\n"
    )

    async def _call(self, method, path, **kw):
        assert (method, path) == ("GET", "/metrics")
        return type("R", (), {"text": self.text})()


def test_prometheus_sums_labels_and_filters_prefix():
    eng = _Canned("http://127.0.0.1:1")
    got = asyncio.run(eng._prometheus("vllm:"))
    assert got == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 1.0}
    assert asyncio.run(eng._prometheus("sglang:")) == {"sglang:num_running_reqs": 7.0}
