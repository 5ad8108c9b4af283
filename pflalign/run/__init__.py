"""The top: the config parser, the experiment driver, the round loop, audits, checkpoints, studies
and the generated docs."""
