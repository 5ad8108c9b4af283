"""Process-wide facilities: caches with one reset, and the stop flag."""
