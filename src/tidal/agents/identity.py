"""The per-execution identity a black-box harness carries (base URL and API key): made and
parsed in ``tidal.serving.execution_keys`` (the proxy reads them); re-exported here for the
harness side under the names it has always used."""

from tidal.serving.execution_keys import (
    KEY_PREFIX,
    PATH_PREFIX,
    execution_key,
    execution_url,
    parse_key,
    split_path,
)

__all__ = ["KEY_PREFIX", "PATH_PREFIX", "execution_key", "execution_url", "parse_key", "split_path"]
