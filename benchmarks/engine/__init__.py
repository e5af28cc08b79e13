"""The engine benchmark (``python -m benchmarks.run engine``; `cli` describes the command).

Modules, each importing only those listed before it:

- `common`: prompt sets, result files, a child process's environment;
- `catalogue`: the systems by name, default sets, descriptions and roles;
- `plan`: the command line's checks resolved into a `Plan`;
- `systems`: one runner per system, and the `Row` of one prompt;
- `ceilings`: the lookup ceiling's inputs and walks;
- `runs`: every system alone in a process of its own;
- `anchor`: the llama.cpp anchor's steadiness and bounds;
- `summary`: rows summed up per set and system;
- `report`: the markdown tables;
- `synthetic`: forward speed on random weights;
- `concurrency`: many requests at once on one engine (``--concurrency``);
- `cli`: the command line and the run.
"""
