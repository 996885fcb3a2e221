"""Models the package ships for its own command line, tests and benchmarks."""
