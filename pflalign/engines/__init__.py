"""Engines: how a run reaches its clients (the client-side handler, the sequential and batched
engines,
Ray workers, client state stores, fault injection around the handler)."""
