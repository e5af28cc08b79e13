"""The CPU's float32 fused multiply-add peak: what no float32 matmul can beat.

``python -m benchmarks.fma_peak [--threads 2]``

Each thread runs a loop of independent fused multiply-adds on registers only (no memory
traffic, twelve accumulators to cover the latency), on 8 lanes (AVX2) and, where the CPU has
it, 16 lanes (AVX512F); the result is ``2 * lanes * FMAs / seconds`` over all threads, best of
three. The exact matmul path (bf16 weights, float32 activations and sums) is bounded by it; the
bf16 and int8 paths are not (their instructions do more per lane). Built with gcc at run time,
like the engine's kernels.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <time.h>

typedef struct { long rounds; int wide; float sink; } Work;

/* Twelve independent chains a = a * b + c of VEC registers, from distinct starting values
   (equal chains would be computed once); their sum is kept so that none is optimised away. */
#define DEFINE_LOOP(NAME, TARGET, VEC, SET1, FMA, ADD, FIRST)                           \
    TARGET static void *NAME(Work *w) {                                                 \
        VEC a[12];                                                                      \
        for (int j = 0; j < 12; j++) a[j] = SET1(w->sink + j);                           \
        const VEC b = SET1(0.999f), c = SET1(1e-3f);                                    \
        for (long i = 0; i < w->rounds; i++) {                                          \
            a[0] = FMA(a[0], b, c); a[1] = FMA(a[1], b, c); a[2] = FMA(a[2], b, c);      \
            a[3] = FMA(a[3], b, c); a[4] = FMA(a[4], b, c); a[5] = FMA(a[5], b, c);      \
            a[6] = FMA(a[6], b, c); a[7] = FMA(a[7], b, c); a[8] = FMA(a[8], b, c);      \
            a[9] = FMA(a[9], b, c); a[10] = FMA(a[10], b, c); a[11] = FMA(a[11], b, c);  \
        }                                                                               \
        for (int j = 1; j < 12; j++) a[0] = ADD(a[0], a[j]);                            \
        w->sink = FIRST(a[0]);                                                          \
        return 0;                                                                       \
    }
DEFINE_LOOP(avx2_loop, , __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps,
            _mm256_cvtss_f32)
DEFINE_LOOP(avx512_loop, __attribute__((target("avx512f"))), __m512, _mm512_set1_ps,
            _mm512_fmadd_ps, _mm512_add_ps, _mm512_reduce_add_ps)

static void *loop(void *arg) {
    Work *w = (Work *)arg;
    return w->wide ? avx512_loop(w) : avx2_loop(w);
}

int has_avx512(void) { return __builtin_cpu_supports("avx512f"); }

/* Seconds for `threads` threads to run `rounds` rounds of 12 FMAs each. */
double fma_seconds(int threads, long rounds, int wide) {
    pthread_t t[64];
    Work w[64];
    struct timespec a, b;
    if (threads > 64) threads = 64;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < threads; i++) {
        w[i].rounds = rounds; w[i].wide = wide; w[i].sink = (float)i;
        pthread_create(&t[i], 0, loop, &w[i]);
    }
    for (int i = 0; i < threads; i++) pthread_join(t[i], 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
}
"""

ROUNDS = 20_000_000
"""Rounds of 12 FMAs per thread and run (about a tenth of a second at 3 GHz)."""


def _library(folder: Path) -> ctypes.CDLL:
    source, lib = folder / "fma_peak.c", folder / "fma_peak.so"
    source.write_text(SOURCE)
    subprocess.run(["gcc", "-O3", "-mavx2", "-mfma", "-pthread", "-shared", "-fPIC",
                    str(source), "-o", str(lib)], check=True, capture_output=True, timeout=120)
    library = ctypes.CDLL(str(lib))
    library.fma_seconds.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    library.fma_seconds.restype = ctypes.c_double
    return library


def fma_peak(threads: int = 2, repeats: int = 3) -> dict[str, float]:
    """GFLOP/s of float32 FMAs on ``threads`` threads: ``{"avx2": ..., "avx512": ...}`` (the
    latter where the CPU has AVX512F), best of ``repeats``."""
    with tempfile.TemporaryDirectory() as tmp:
        library = _library(Path(tmp))
        widths = {"avx2": (0, 8)} | ({"avx512": (1, 16)} if library.has_avx512() else {})
        peak = {}
        for name, (wide, lanes) in widths.items():
            seconds = min(library.fma_seconds(threads, ROUNDS, wide) for _ in range(repeats))
            peak[name] = 2 * lanes * 12 * ROUNDS * threads / seconds / 1e9
        return peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fma_peak",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    peak = fma_peak(args.threads)
    print(f"float32 FMA peak, {args.threads} threads: " +
          ", ".join(f"{name} {g:.1f} GFLOP/s" for name, g in peak.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
