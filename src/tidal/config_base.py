"""What every config model shares, below the configuration tree: the strict base model, the
validator error that names a sub-field, and turning a pydantic ``ValidationError`` into a
one-line ``ConfigError`` naming the dotted field (``validate_model``), with the YAML file it
came from (``validate_file_data``).

In: a model class and data (a mapping, a YAML file). Out: the validated model, or a
``ConfigError``. ``tidal.config`` re-exports each of these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from tidal.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FieldError(ValueError):
    """A validator error that names a sub-field of the model it was raised in (``field``,
    dotted): ``validate_model`` puts it after the model's own place in the message."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def _format(exc: ValidationError, prefix: str) -> ConfigError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    msg = err["msg"]
    ctx_err = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_err, FieldError):
        loc.append(ctx_err.field)
        msg = ctx_err.message
    elif msg.startswith("Value error, "):
        msg = msg.removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    field = ".".join(p for p in [prefix, *loc] if p)
    more = len(exc.errors()) - 1
    return ConfigError(field, msg + (f" (and {more} more error(s))" if more else ""))


def validate_model(model: type[M], data: object, prefix: str = "") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _format(exc, prefix) from None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file, or a one-line ``ConfigError``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("", f"{p}: no such config file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{p}: the top level must be a mapping")
    return data


def validate_file_data(model: type[M], data: dict[str, Any], path: str | Path) -> M:
    """``validate_model`` with the file named in the error message."""
    try:
        return validate_model(model, data)
    except ConfigError as exc:
        raise in_file(exc, path) from None


def in_file(exc: ConfigError, path: str | Path) -> ConfigError:
    """``exc`` with the file it was found in named at the end of its message."""
    return ConfigError(exc.field, f"{exc.message} (in {path})")


def dump_yaml(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
