"""agentrt benchmarks: run them with ``python -m benchmarks.run <suite>`` from the repository."""
