"""A Flower app of your own that runs pFLAlign: see pyproject.toml and README.md."""
