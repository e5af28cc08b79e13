"""What admission at every door costs cell code: the same programs in two in-process sandboxes,
one compiled with the door rewrite (the sandbox as it runs) and one without it (RestrictedPython
and the guards alone), interleaved, median of ``--repeats`` runs each.

    python -m benchmarks.sandbox_doors [--repeats 7]

The programs are loop-heavy on purpose (agent code spends its time in tool calls, not here):
string and list work, a dict of lists, a class with methods, a generator pipeline.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import time

from RestrictedPython import compile_restricted_exec

from agentrt.interpreter.sandbox import Sandbox, SandboxPolicy
from agentrt.interpreter.sandbox.policy import SandboxSyntaxError

PROGRAMS = {
    "strings and lists": """
data = [str(i) for i in range(100000)]
out = []
for s in data:
    out.append(s.upper() + "-" + str(len(s)))
print(len(out))
""",
    "dict of lists": """
groups = {}
for i in range(100000):
    groups.setdefault(i % 7, []).append(i * 2)
print(sorted((k, len(v)) for k, v in groups.items()))
""",
    "class with methods": """
class Acc:
    def __init__(self):
        self.total = 0
    def add(self, x):
        self.total = self.total + x
        return self
acc = Acc()
for i in range(60000):
    acc.add(i % 5)
print(acc.total)
""",
    "generator pipeline": """
def numbers(n):
    for i in range(n):
        yield i
def squares(xs):
    for x in xs:
        yield x * x
print(sum(v for v in squares(numbers(100000)) if v % 3 == 0))
""",
}


class _WithoutDoors(SandboxPolicy):
    """RestrictedPython's rewrite and the sandbox's own checks, without the door rewrite."""

    def visit_Module(self, node: ast.Module) -> ast.AST:
        return super(SandboxPolicy, self).visit_Module(node)


def _compile_without_doors(source: str, filename: str):
    result = compile_restricted_exec(source, filename, policy=_WithoutDoors)
    if result.errors:
        raise SandboxSyntaxError("; ".join(result.errors), None)
    return result.code


def _time(sandbox: Sandbox, source: str) -> float:
    start = time.perf_counter()
    outcome = sandbox.execute(source)
    elapsed = time.perf_counter() - start
    if outcome.error:
        raise RuntimeError(outcome.error)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"{'program':<22} {'without doors s':>16} {'with doors s':>13} {'ratio':>6}")
    ratios = []
    for name, source in PROGRAMS.items():
        with_doors, without = Sandbox(), Sandbox()
        without.compiler = _compile_without_doors
        times: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(args.repeats):
            times["without"].append(_time(without, source))
            times["with"].append(_time(with_doors, source))
        base, doors = statistics.median(times["without"]), statistics.median(times["with"])
        ratios.append(doors / base)
        print(f"{name:<22} {base:>16.3f} {doors:>13.3f} {doors / base:>5.2f}x")
    print(f"geometric mean {statistics.geometric_mean(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
