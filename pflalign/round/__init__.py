"""The round: the loop over a method entry's rounds, its two schedulers (synchronous rounds and
FedBuff), the round features (:mod:`pflalign.round.feature`, one module each in
:mod:`pflalign.round.features`) and checkpoints. Nothing here knows how a client is reached (the
engines) or what a run is made of (:mod:`pflalign.run`: the CLI, the driver, studies)."""
