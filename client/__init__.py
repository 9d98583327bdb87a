"""Client side of the native API: request models (`client.request`) and a sync/async client."""

from client.native import AsyncClient, Client, ServerError

__all__ = ["AsyncClient", "Client", "ServerError"]
