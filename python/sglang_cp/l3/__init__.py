"""L3: the crash-consistent, content-addressed NVMe page store (engine-independent; imports no sglang).

Design: docs_internal/l3_store.md.
"""

from .acks import Ack, AckKind
from .config import L3Config, load_l3_config, parse_l3_config
from .contract import PageStore
from .errors import L3ConfigError, L3InvariantError, L3StartupError
from .store import L3Store

__all__ = ["Ack", "AckKind", "L3Config", "L3ConfigError", "L3InvariantError", "L3StartupError", "L3Store", "PageStore",
           "load_l3_config", "parse_l3_config"]
