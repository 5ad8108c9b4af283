"""FedPer client half (Arivazhagan et al., Federated Learning with Personalization Layers, 2019).

Base layers are shared and averaged; the personalization layers (the head: the last
``head-layers`` parameterised layers) stay on the client. Each round the client loads the global
body onto its own head, trains all layers jointly for ``local-epochs``, keeps the head and
uploads the body. See :mod:`clients.partial` for state and the new-client procedure.
"""

from __future__ import annotations

from clients.partial import HeadClient


class FedPerClient(HeadClient):
    """Joint training of body and head (the :class:`HeadClient` default)."""
