"""Every ``tidal ...`` command line in the docs works when pasted.

In: the fenced code blocks of README.md, docs/*.md and benchmarks/README.md (the Benchmarks
page). A command line starts with ``tidal``, ``.venv/bin/tidal`` or ``$ tidal`` (after optional
``VAR=value`` assignments); a trailing ``\\`` continues it on the next line, and it ends at a
shell operator (``|``, ``&&``, ``&``, ``;``) or a comment. Each one is
- parsed by the CLI's own click parser: an unknown subcommand or option, or a bad value, fails;
- checked for its inputs: every file it names exists (except under ``runs/``: the output of an
  earlier documented command) and every config validates with tidal's loaders (``tidal run``:
  with the command's ``--policy``, ``--bursts``, ``--address`` and ``--set`` overrides applied),
  every policy spec built against the scenario (``tidal simulate``), every published-results
  file loaded (``tidal validate``, ``tidal calibrate --published``);
- run, when it is fast: ``--help``, ``tidal policies``, ``tidal backends``, ``tidal simulate``
  of at most 4 bursts, ``tidal calibrate --verl-log`` (outputs under ``runs/`` go to a
  temporary directory instead).
``make TARGET`` lines name targets of the Makefile, and README.md's links reach existing files
and headings.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from tidal.cli import cli, main

ROOT = Path(__file__).resolve().parents[2]
# benchmarks/README.md is the docs' Benchmarks page (docs/benchmarks.md includes it)
DOC_FILES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
]
PRODUCED = "runs/"  # what an earlier command in the docs writes: not there before it runs
_ASSIGN = r"[A-Za-z_][A-Za-z0-9_]*=\S*"
_TIDAL = re.compile(rf"^(?:\$ )?(?:{_ASSIGN} )*(?:\S*/)?tidal(?: |$)")
_MAKE = re.compile(r"^(?:\$ )?make(?: |$)")
_SHELL_OPS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "(", ")", ">&"}
_SIM_FAST_BURSTS = 4  # `tidal simulate --bursts N` with N <= this runs in about a second


@dataclass(frozen=True)
class DocLine:
    where: str  # "docs/runtime.md:42"
    text: str  # the logical line, continuations joined


def _fenced_lines(path: Path) -> list[DocLine]:
    """The logical lines inside fenced code blocks (``\\``-continued lines joined)."""
    lines, fence, buf, start = [], False, None, 0
    for no, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.strip()
        if text.startswith("```"):
            fence, buf = not fence, None
            continue
        if not fence:
            continue
        buf, start = (f"{buf} {text}", start) if buf is not None else (text, no)
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        lines.append(DocLine(f"{path.relative_to(ROOT)}:{start}", buf))
        buf = None
    return lines


def _words(text: str) -> list[str]:
    """Shell words of ``text`` up to the first operator or comment (redirections dropped)."""
    text = re.sub(r"(?<!\S)\d?>&\d", " ", text)  # 2>&1
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words = []
    for word in lex:
        if word in _SHELL_OPS:
            break
        words.append(word)
    return words


def tidal_argv(text: str) -> list[str]:
    """The arguments after the ``tidal`` program of a documented command line."""
    words = _words(text.removeprefix("$ "))
    while re.fullmatch(_ASSIGN, words[0]):
        words.pop(0)
    assert words[0].rsplit("/", 1)[-1] == "tidal", words
    return words[1:]


ALL_LINES = [line for path in DOC_FILES for line in _fenced_lines(path)]
COMMANDS = [line for line in ALL_LINES if _TIDAL.match(line.text)]
MAKE_LINES = [line for line in ALL_LINES if _MAKE.match(line.text)]


def test_the_docs_hold_the_commands_this_test_checks():
    """Guards the finder: a change that hid the commands would make every check below pass."""
    assert len(COMMANDS) >= 50, [c.where for c in COMMANDS]
    assert len(MAKE_LINES) >= 5, [c.where for c in MAKE_LINES]
    readme = (ROOT / "README.md").read_text()
    assert "```\nmake demo\nmake test\n```" in readme  # the two commands, unchanged


def _parse(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[click.Context] | None:
    """The contexts from the group down to the subcommand, as ``tidal`` parses ``argv``; None
    for a ``--help`` line (click printed the help). Paths under ``runs/`` are not required to
    exist yet."""
    convert = click.Path.convert

    def relaxed(self: click.Path, value: object, param: object, ctx: object) -> object:
        if isinstance(value, str) and value.startswith(PRODUCED):
            return value
        return convert(self, value, param, ctx)

    contexts: list[click.Context] = []
    cmd, name, args = cli, "tidal", list(argv)
    with monkeypatch.context() as m:
        m.setattr(click.Path, "convert", relaxed)
        while True:
            try:
                ctx = cmd.make_context(name, args, parent=contexts[-1] if contexts else None)
            except click.exceptions.Exit as exc:
                assert exc.exit_code == 0
                return None
            contexts.append(ctx)
            if not isinstance(cmd, click.Group):
                return contexts
            protected = ctx.__dict__.get("_protected_args")
            rest = [*(ctx.protected_args if protected is None else protected), *ctx.args]
            if not rest:
                return contexts
            name, cmd, args = cmd.resolve_command(ctx, rest)


def _run_config(p: dict) -> None:
    """What ``tidal run CONFIG`` builds before it starts Ray (no Ray, no model)."""
    from tidal.commands.run import apply_set
    from tidal.config import PolicyConfig, RunConfig, load_yaml, validate_model
    from tidal.control.factory import check_known, check_policy

    data = check_known(load_yaml(p["config"]), source=p["config"]).model_dump(mode="json")
    if p["policy"] is not None:
        data["policy"] = PolicyConfig.from_spec(p["policy"]).model_dump(mode="json")
    if p["address"] is not None:
        data["runtime"]["ray_address"] = p["address"]
    if p["bursts"] is not None:
        data["control"]["bursts"] = p["bursts"]
    for item in p["sets"]:
        apply_set(data, item)
    check_policy(validate_model(RunConfig, data))


def _validate(names: tuple[str, ...], p: dict) -> None:
    """Loads and validates the configs, scenarios and published files the command names."""
    if names == ("run",) and p["config"] is not None:
        _run_config(p)
    elif names == ("run",) and p.get("emulate"):  # the config --emulate builds, validated
        from tidal.config import RunConfig, validate_model
        from tidal.control.factory import check_policy
        from tidal.runtime.emulated_run import emulated_config

        check_policy(validate_model(RunConfig, emulated_config(p["emulate"], p["k"], p["policy"])))
    elif names == ("check",):
        from tidal.config import RunConfig, load_yaml
        from tidal.control.factory import check_policy

        check_policy(load_yaml(p["config"], RunConfig), source=p["config"])
    elif names == ("simulate",) and not p["scenario"].startswith(PRODUCED):
        from tidal.sim import scenario as scenarios

        sc = scenarios.load(p["scenario"])
        for spec in p["policies"] or sc.policies:
            sc.run_config(spec)
    elif names in (("validate",), ("calibrate",)):
        from tidal.sim import published

        given = p["published"]  # validate: names (none: every shipped file); calibrate: one
        for name in (given if isinstance(given, tuple) else (given,)) or published.shipped():
            if name is not None:
                published.load(name)


def _runs_fast(names: tuple[str, ...], p: dict) -> bool:
    if names in (("policies",), ("backends",)):
        return True
    if names == ("simulate",):
        return (
            p["bursts"] is not None
            and p["bursts"] <= _SIM_FAST_BURSTS
            and p["sweep"] is None
            and not p["check"]
            and not p["scenario"].startswith(PRODUCED)
        )
    return names == ("calibrate",) and p["verl_log"] is not None


def _named_files(argv: list[str]) -> list[str]:
    """Arguments that name an input file by its suffix (outputs live under runs/)."""
    values = [a.split("=", 1)[1] if "=" in a else a for a in argv]  # --set key=FILE too
    return [
        a
        for a in values
        if re.search(r"\.(ya?ml|jsonl|json|py)$", a) and not a.startswith(PRODUCED)
    ]


# CLI bugs these commands show (the doc is right); strict: the test fails once one is fixed, so
# the entry goes with the fix.
KNOWN_CLI_BUGS: dict[str, str] = {}


def _case(line: DocLine) -> object:
    bugs = [
        why
        for key, why in KNOWN_CLI_BUGS.items()
        if key in line.text and f"--out {PRODUCED}" in line.text
    ]
    marks = [pytest.mark.xfail(strict=True, reason=bugs[0])] if bugs else []
    return pytest.param(line, id=line.where, marks=marks)


@pytest.mark.parametrize("line", [_case(c) for c in COMMANDS])
def test_documented_command(
    line: DocLine,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    isolated_backends: None,  # what a documented --module registers is gone after it
) -> None:
    monkeypatch.chdir(ROOT)  # as pasted: from the repository root
    argv = tidal_argv(line.text)
    missing = [f for f in _named_files(argv) if not (ROOT / f).exists()]
    assert not missing, f"{line.where}: no such file {missing}"
    contexts = _parse(argv, monkeypatch)
    if contexts is None or len(contexts) == 1:  # --help, or the bare group
        assert main(argv) == 0
        return
    names = tuple(ctx.info_name for ctx in contexts[1:])
    params = contexts[-1].params
    _validate(names, params)
    if not _runs_fast(names, params):
        return
    out = [str(tmp_path / a) if a.startswith(PRODUCED) else a for a in argv]
    code = main(out)
    captured = capsys.readouterr()
    assert code == 0, f"{line.where}: exit {code}\n{captured.err[-2000:]}"


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


@pytest.mark.parametrize("line", MAKE_LINES, ids=[c.where for c in MAKE_LINES])
def test_documented_make_target_exists(line: DocLine) -> None:
    words = [w for w in _words(line.text)[1:] if "=" not in w and not w.startswith("-")]
    assert words, f"{line.where}: `make` without a target"
    unknown = [w for w in words if w not in _make_targets()]
    assert not unknown, f"{line.where}: no Makefile target {unknown}"


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc (and GitHub) gives a heading: markup dropped, lower case,
    punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(file: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}


def test_readme_links_reach_files_and_headings() -> None:
    readme = (ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists() or (anchor and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, broken
