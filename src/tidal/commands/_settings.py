"""Command-line options generated from a launch contract (``tidal.contracts.launch``).

In: a settings model (``ProxySettings``, ``EngineSettings``). Out: a decorator adding one click
option per field (``--field-name``; a bool as ``--x/--no-x``; a list repeatable under its
singular flag; the curve as ``B:TOK_S,...``), each with the field's description and default,
plus ``--settings JSON`` (how ``serving.launch`` starts the command); ``settings_from``: the
options given, validated into the model (a bad value is a usage error naming the option); and
``to_args``: the options that give a settings value back (the round trip the tests check).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tidal.errors import ConfigError

M = TypeVar("M", bound=BaseModel)
CURVE = "engine_curve"


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag(name: str, field: FieldInfo) -> str:
    return str(_extra(field).get("flag") or f"--{name.replace('_', '-')}")


def _base(annotation: Any) -> Any:
    """``X`` of ``X | None``; else the annotation."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _option(name: str, field: FieldInfo) -> Callable:
    base, extra = _base(field.annotation), _extra(field)
    kw: dict[str, Any] = {"help": field.description}
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    if base is bool:
        off = extra.get("off") or f"--no-{flag(name, field)[2:]}"
        return click.option(
            f"{flag(name, field)}/{off}", name, default=default, show_default=True, **kw
        )
    if typing.get_origin(base) is list and name != CURVE:
        return click.option(flag(name, field), name, multiple=True, **kw)
    if name == CURVE:
        return click.option(
            flag(name, field), name, default=None, metavar=extra.get("metavar"), **kw
        )
    if typing.get_origin(base) is typing.Literal:
        kw["type"] = click.Choice(typing.get_args(base))
    elif base in (int, float):
        kw["type"] = base
    # a required field is not required here: ``--settings JSON`` gives it too (a missing one
    # is ``settings_from``'s usage error)
    return click.option(
        flag(name, field), name, default=default, show_default=default is not None, **kw
    )


def options(model: type[BaseModel]) -> Callable:
    """One option per field of ``model`` and ``--settings JSON`` (then no other option)."""

    def decorate(fn: Callable) -> Callable:
        for name, field in reversed(model.model_fields.items()):
            fn = _option(name, field)(fn)
        return click.option(
            "--settings",
            "settings_json",
            default=None,
            metavar="JSON",
            help=f"All settings as one JSON {model.__name__} (how tidal "
            "starts this command; then no other option counts).",
        )(fn)

    return decorate


def parse_curve(text: str | None) -> list[tuple[int, float]] | None:
    """``B:TOK_S,...`` into [(batch, tokens/s)]; a malformed one is a usage error."""
    if text is None:
        return None
    try:
        return [(int(b), float(t)) for b, t in (p.split(":") for p in text.split(","))]
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not B:TOK_S,... (e.g. 1:200,128:8800)", param_hint="--engine-curve"
        ) from None


def settings_from(model: type[M], params: dict[str, Any]) -> M:
    """The settings the command line gives: ``--settings JSON`` whole, else the options (each
    field's); a bad value is a usage error naming its option."""
    from tidal.config_base import validate_model

    raw = params.pop("settings_json", None)
    try:
        if raw is not None:
            return model.model_validate_json(raw)
    except ValueError as exc:
        raise click.BadParameter(str(exc).splitlines()[0], param_hint="--settings") from None
    data = {k: params.pop(k) for k in model.model_fields if k in params}
    if CURVE in data:
        data[CURVE] = parse_curve(data[CURVE])
    data = {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}
    data = {
        k: v for k, v in data.items() if v is not None or not model.model_fields[k].is_required()
    }
    try:
        return validate_model(model, data)
    except ConfigError as exc:
        name = exc.field.split(".")[0]
        hint = flag(name, model.model_fields[name]) if name in model.model_fields else None
        raise click.BadParameter(exc.message, param_hint=hint) from None


def to_args(settings: BaseModel) -> list[str]:
    """The options that give ``settings`` back (those at their default left out)."""
    args: list[str] = []
    for name, field in type(settings).model_fields.items():
        value = getattr(settings, name)
        if not field.is_required() and value == field.get_default(call_default_factory=True):
            continue
        opt = flag(name, field)
        if isinstance(value, bool):
            args.append(opt if value else _extra(field).get("off") or f"--no-{opt[2:]}")
        elif name == CURVE:
            args += [opt, ",".join(f"{b}:{t!r}" for b, t in value)]
        elif isinstance(value, list):
            for item in value:
                args += [opt, str(item)]
        else:
            args += [opt, str(value)]
    return args
