"""routeplay.bench: the reference paths that benchmarks and accounting tests compare."""
