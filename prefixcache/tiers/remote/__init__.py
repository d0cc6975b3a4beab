"""The remote tier: blocks shared by several hosts through a Redis / Valkey server."""

from .client import RemoteClient, RemoteUnavailable
from .tier import RemoteTier

__all__ = ["RemoteClient", "RemoteTier", "RemoteUnavailable"]
