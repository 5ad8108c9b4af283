"""The methods: the method interface (base), one file per method, and the registry."""
