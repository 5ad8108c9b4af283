"""The round features, one module each (:mod:`pflalign.round.feature`). Importing this package
registers them; the order of these imports is the order their hooks run in."""

from pflalign.round.features.gga import AnnealedWarmStart  # noqa: I001  (the order matters)
from pflalign.round.features.uploads import RecordUploads
from pflalign.round.features.clock import SimulatedClock
from pflalign.round.features.telemetry import Telemetry
from pflalign.round.features.audit import Audits
from pflalign.round.features.robustness import UpdateBounds
from pflalign.round.features.defences import RobustAggregation
from pflalign.round.features.secure import SecureAggregation
from pflalign.round.features.privacy import CentralDP, LocalDPAccounting
from pflalign.round.features.models import SavedModels

__all__ = ["AnnealedWarmStart", "Audits", "CentralDP", "LocalDPAccounting", "RecordUploads",
           "RobustAggregation", "SavedModels",
           "SecureAggregation", "SimulatedClock", "Telemetry", "UpdateBounds"]
