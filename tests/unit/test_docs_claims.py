"""The docs claim only what runs: how README.md, docs/*.md and benchmarks/README.md are kept
honest, beside ``test_docs_commands.py`` (which runs their commands).

In: the prose of those files (fenced code blocks left out), read as paragraphs and sentences.
Three rules, each a test:
- every test a doc cites (``tests/....py``, optionally ``::test_name``) exists, so a claim's
  evidence cannot silently disappear;
- a sentence that says something was *tested* or *verified* names the test (a ``tests/`` path) or
  the benchmark (a ``benchmarks/`` path) that shows it, unless it says it was not;
- a paragraph naming a capability whose scope is narrower than its name states that scope
  (``SCOPED``: e.g. KV handoff is the built-in engine's; a cluster has run on one host's network
  namespaces only). A claim found overstated gets a row here when it is corrected, so it cannot
  come back unqualified.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
]
_TEST_REF = re.compile(r"\btests/[\w/.-]+\.py(?:::\w+)?")
_EVIDENCE = re.compile(r"\b(?:tests|benchmarks)/[\w/.-]+")
_TESTED = re.compile(r"\b(?:tested|verified)\b", re.IGNORECASE)
_NEGATED = re.compile(
    r"\b(?:not|never|un)\b[^.]*\b(?:tested|verified|run)\b|\buntested\b", re.IGNORECASE
)

# capability (regex on a paragraph) -> what the paragraph must also say (regex), and why
SCOPED = [
    (
        r"KV (?:cache )?handoff|handing its KV|KV cache over",
        r"built-in|re-?prefill|vLLM|kv_handoff|KV connector|cost model|simulator's mechanics|"
        r"the mechanics",
        "a rerouted call keeps its KV on the built-in engine, and on vLLM within one node (tidal's "
        "KV connector); other moves re-prefill",
    ),
    (
        r"SGLang[^.]*\b(?:GPU|tested)\b[^.]*\b(?:tested|GPU)\b|\btested\b[^.]*\bGPU\b[^.]*SGLang",
        r"skipped|not run|has not run|not yet",
        "the SGLang GPU test has been skipped on every GPU machine so far (docs/gpu.md)",
    ),
    (
        r"cluster of (?:separate )?machines|several machines|multiple machines",
        r"one host|one machine|namespaces|not been run|would have to",
        "clusters were tested on one host's network namespaces only",
    ),
    (
        r"receive weights by (?:shared memory|CUDA IPC)"
        r"|published to engines \((?:shared memory|CUDA)",
        r"does not use|not wired|node|fallback",
        "tidal run publishes by shared memory on the driver's node and a broadcast to other nodes; "
        "CUDA IPC is written but not used by tidal run",
    ),
]


def _prose(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def _paragraphs(path: Path) -> list[str]:
    """Its paragraphs, one line each (headings left out: a title names, it claims nothing)."""
    return [
        " ".join(p.split())
        for p in re.split(r"\n\s*\n", _prose(path))
        if p.strip() and not p.lstrip().startswith("#")
    ]


def _sentences(paragraph: str) -> list[str]:
    return re.split(r"(?<=[.;])\s+(?=[A-Z(`])", paragraph)


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_test_a_doc_cites_exists():
    missing = []
    for path in DOC_FILES:
        for ref in sorted(set(_TEST_REF.findall(_prose(path)))):
            file, _, name = ref.partition("::")
            target = ROOT / file
            if not target.is_file():
                missing.append(f"{_where(path)}: {ref} (no such file)")
            elif name and not re.search(rf"^\s*(?:async )?def {name}\(", target.read_text(), re.M):
                missing.append(f"{_where(path)}: {ref} (no such test)")
    assert not missing, missing


def test_a_sentence_saying_tested_names_its_test():
    bare = [
        f"{_where(path)}: {s[:160]}"
        for path in DOC_FILES
        for p in _paragraphs(path)
        for s in _sentences(p)
        if _TESTED.search(s) and not _EVIDENCE.search(s) and not _NEGATED.search(s)
    ]
    assert not bare, bare


@pytest.mark.parametrize(("claim", "scope", "why"), SCOPED, ids=[s[2][:40] for s in SCOPED])
def test_a_capability_states_its_scope(claim, scope, why):
    over = [
        f"{_where(path)}: {p[:200]}"
        for path in DOC_FILES
        for p in _paragraphs(path)
        if re.search(claim, p) and not re.search(scope, p)
    ]
    assert not over, (why, over)


def test_the_rules_catch_what_they_are_for():
    """Each rule fails on a planted overstatement (the rules can fail)."""
    assert _TESTED.search("Tested on a GPU.") and not _EVIDENCE.search("Tested on a GPU.")
    assert _NEGATED.search("It has not been tested on a GPU.")
    planted = {
        "KV handoff": "tidal reroutes live requests with KV handoff.",
        "SGLang": "SGLang is tested on a GPU.",
        "machines": "It runs on a cluster of machines.",
        "shared memory": "engines receive weights by CUDA IPC.",
    }
    for (claim, scope, _), text in zip(SCOPED, planted.values(), strict=True):
        assert re.search(claim, text) and not re.search(scope, text), text
