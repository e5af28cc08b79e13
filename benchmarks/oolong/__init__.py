"""OOLONG-style end-to-end benchmark: task generation, scoring, a simulated sub-model, the runner."""
