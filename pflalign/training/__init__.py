"""Client-side training: the seeded loops, local runs, the executors, optimizers and GGA."""
