"""The server's runtime and its math: aggregation, validation, sampling, metrics."""
