"""The verifiers agent kind checks its settings before a run starts: one line naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tidal.agents.verifiers_kind import VerifiersKind
from tidal.errors import ConfigError

pytest.importorskip("renderers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tidal.models import create_tiny

    return create_tiny(tmp_path_factory.mktemp("tiny") / "m", seed=1, n_layers=1, d_model=32,
                       n_heads=2, max_seq_len=128)


def test_settings_are_checked_by_name(tiny_dir):
    with pytest.raises(ConfigError, match=r"task.agent.args.tokenizer"):
        VerifiersKind(SimpleNamespace(args={}))
    with pytest.raises(ConfigError, match=r"task.agent.args.temperature"):
        VerifiersKind(SimpleNamespace(args={"tokenizer": str(tiny_dir), "temperature": 1}))
    with pytest.raises(ConfigError, match=r"task.agent.args"):
        VerifiersKind(SimpleNamespace(args={"tokenizer": str(tiny_dir), "renderer": "qwen3"}))
    kind = VerifiersKind(SimpleNamespace(args={"tokenizer": str(tiny_dir)}))
    assert kind.renderer.render([{"role": "user", "content": "hi"}],
                                add_generation_prompt=True).token_ids
