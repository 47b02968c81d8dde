"""The per-execution identity a black-box harness carries: it cannot add an
``X-Tidal-Execution`` header, but it is given a base URL and an API key, and either names its
execution at the proxy.

- base URL: ``{proxy}/x/{execution_id}/v1`` (the proxy strips ``/x/{execution_id}`` and reads the
  execution from it);
- API key: ``tx-{execution_id}.{mac}``, ``mac`` = the first 16 hex digits of
  HMAC-SHA256(run token, execution id), so a key names one execution of one run and cannot be
  forged without the token; the proxy accepts it where the run's token is needed.
In: the run's token and execution ids. Out: the URL and key (``execution_url``,
``execution_key``) and their parsing (``parse_key``, ``split_path``), shared by the harness pool
and the proxy (``tidal.serving.execution_identity``; re-exported by ``tidal.agents.identity``).
"""

from __future__ import annotations

import hashlib
import hmac
import re

KEY_PREFIX = "tx-"
PATH_PREFIX = "/x/"
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def execution_key(token: str, execution_id: str) -> str:
    return f"{KEY_PREFIX}{execution_id}.{_mac(token, execution_id)}"


def execution_url(proxy_url: str, execution_id: str) -> str:
    return f"{proxy_url.rstrip('/')}{PATH_PREFIX}{execution_id}/v1"


def parse_key(token: str | None, key: str) -> str | None:
    """The execution a ``tx-`` key names, or None when it is not a valid key of this run."""
    if not key.startswith(KEY_PREFIX) or not token:
        return None
    eid, _, mac = key[len(KEY_PREFIX) :].rpartition(".")
    if not _ID.match(eid) or not hmac.compare_digest(mac, _mac(token, eid)):
        return None
    return eid


def split_path(path: str) -> tuple[str, str] | None:
    """``/x/<id>/rest`` -> (id, ``/rest``); None for any other path (or a malformed id)."""
    if not path.startswith(PATH_PREFIX):
        return None
    eid, sep, rest = path[len(PATH_PREFIX) :].partition("/")
    if not sep or not _ID.match(eid):
        return None
    return eid, "/" + rest


def _mac(token: str, execution_id: str) -> str:
    return hmac.new(token.encode(), execution_id.encode(), hashlib.sha256).hexdigest()[:16]
