"""The int8 matmul kernels side by side: AVX2 against AVX512-VNNI, on the model's own weights.

``python -m benchmarks.int8_kernels [--model smollm2-135m] [--threads 2] [--repeats 5]``

Both kernel sets (`CpuOps.use_vnni`) run in one process, calls interleaved, on every int8
matrix of every layer of the pulled model (what one forward multiplies, the head left out) for
several activation row counts: one row is a decode step, a few are a verify step, hundreds a
prefill chunk. Each line gives the best time of each set, their ratio and whether the outputs
are the same bits (they must be). Then whole forwards: a prefill of ``--prefill`` tokens and a
one-token step after it, both ways. On a CPU without AVX512-VNNI it says so and stops.
"""

from __future__ import annotations

import argparse
import sys

import torch

from agentrt.engine.drafters.base import best_time

ROWS = (1, 2, 4, 8, 13, 64, 512)


def layer_matrices(model) -> list[tuple[object, int]]:
    """Every layer's int8 matrices with their input width."""
    return [(m, m.in_features) for layer in model.layers for m in layer.int8.values()]


def matmul_times(ops, matrices, rows: int, repeats: int) -> tuple[dict[bool, float], bool]:
    """Seconds for one pass over ``matrices`` with ``rows`` activation rows, per kernel set
    (False: AVX2, True: VNNI), best of ``repeats`` with the sets alternating; and whether
    both gave the same bits."""
    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in matrices}}
    times = {False: float("inf"), True: float("inf")}
    outputs = {}
    passes = max(1, 64 // rows)
    for _ in range(repeats):
        for vnni in (False, True):
            ops.use_vnni(vnni)
            run = lambda: [ops.int8_linear(inputs[k], m) for m, k in matrices]  # noqa: E731
            times[vnni] = min(times[vnni], best_time(lambda: [run() for _ in range(passes)], 1) / passes)
            outputs[vnni] = run()
    same = all(torch.equal(a, b) for a, b in zip(outputs[False], outputs[True]))
    return times, same


def forward_times(ops, model, prefill: int, repeats: int) -> dict[str, dict[bool, float]]:
    """A prefill of ``prefill`` tokens and a one-token step after it, per kernel set."""
    from agentrt.engine.llama import SeqRows

    pool = model.new_pool(-(-(prefill + 1) // 64), 64)
    table = torch.arange(pool.num_blocks, dtype=torch.int32)
    ids = torch.randint(100, 20000, (prefill + 1,), generator=torch.Generator().manual_seed(0))
    out = {"prefill": {}, "step": {}}
    with torch.inference_mode():
        for _ in range(repeats):
            for vnni in (False, True):
                ops.use_vnni(vnni)
                t = best_time(lambda: model(ids[:prefill], [SeqRows(0, prefill, table)], pool), 1)
                out["prefill"][vnni] = min(out["prefill"].get(vnni, t), t)
                t = best_time(lambda: model(ids[prefill:], [SeqRows(prefill, 1, table)], pool), 3)
                out["step"][vnni] = min(out["step"].get(vnni, t), t)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.int8_kernels",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timings: best of this many")
    parser.add_argument("--prefill", type=int, default=512, help="tokens of the prefill timed")
    args = parser.parse_args(argv)

    from agentrt.engine.native import NativeEngine

    torch.set_num_threads(args.threads)
    engine = NativeEngine(args.model, prefix_cache=False, precision="int8", threads=args.threads)
    engine.close()
    model, ops = engine.model, engine.model.ops
    if ops is None or not ops.use_vnni(True):
        print("this CPU has no AVX512-VNNI (or the CPU kernels are off): nothing to compare")
        return 0
    before = ops.use_vnni()
    try:
        matrices = layer_matrices(model)
        print(f"int8 matmuls of {len(model.layers)} layers ({len(matrices)} matrices), "
              f"{args.threads} threads, best of {args.repeats}, AVX2 and VNNI interleaved\n")
        print("rows   AVX2 ms   VNNI ms   AVX2/VNNI   same bits")
        all_same = True
        for rows in ROWS:
            times, same = matmul_times(ops, matrices, rows, args.repeats)
            all_same &= same
            print(f"{rows:4d} {times[False] * 1e3:9.2f} {times[True] * 1e3:9.2f} "
                  f"{times[False] / times[True]:10.2f}x   {'yes' if same else 'NO'}")
        forwards = forward_times(ops, model, args.prefill, args.repeats)
        for name, label in (("prefill", f"prefill of {args.prefill} tokens"),
                            ("step", "one-token step after it")):
            t = forwards[name]
            print(f"\n{label}: AVX2 {t[False] * 1e3:.1f} ms, VNNI {t[True] * 1e3:.1f} ms, "
                  f"{t[False] / t[True]:.2f}x", end="")
        print()
    finally:
        ops.use_vnni(before)
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
