"""FedPer (Arivazhagan et al., Federated Learning with Personalization Layers, arXiv 1912.00818).

Base layers are shared and averaged by FedAvg; the personalization layers (the head: the last
``head-layers`` parameterised layers) stay on the client. Each round the client loads the global
body onto its own head, trains all layers jointly for ``local-epochs``, keeps the head and
uploads the body. See :mod:`pflalign.methods.partial` for state and the new-client procedure.
"""

from __future__ import annotations

from torch import nn

from pflalign.methods.partial import HeadParams, PartialModel
from pflalign.models.registry import head_keys


class FedPer(PartialModel):
    needs_head = True
    name = "fedper"
    summary = ("Shared body averaged by FedAvg; the head (last head-layers layers) stays on each "
               "client; body and head trained jointly.")
    paper = ("Arivazhagan et al., Federated Learning with Personalization Layers, "
             "arXiv 1912.00818")
    Params = HeadParams

    def personal_entries(self, model: nn.Module) -> tuple[str, ...]:
        return head_keys(model, self.params.head_layers)
