"""pflalign: a federated personalization simulator (the core library; never imports flwr)."""

__version__ = "0.1.0"
