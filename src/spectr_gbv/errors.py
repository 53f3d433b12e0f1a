"""The one error type for a user's bad input, raised by every layer (a verifier's draft count, the sampling
settings, the engine's knobs, the run's config) and shown by run.py as one line: `error: key=value: what is allowed`."""
from typing import Any


class ConfigError(ValueError):
    def __init__(self, key: str, value: Any, allowed: str):
        super().__init__(f"{key}={value}: {allowed}")
        self.key, self.value, self.allowed = key, value, allowed


class ModelUnavailable(OSError):
    """A hub id that cannot be loaded here (no network, or no such model): the user's input, not a bug."""
