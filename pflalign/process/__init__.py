"""Process-wide facilities: caches with one reset, the stop flag, and the process's identity
and peak memory."""
