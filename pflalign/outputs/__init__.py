"""What a run writes: results.json, the terminal report, study reports, plots, statistics."""
