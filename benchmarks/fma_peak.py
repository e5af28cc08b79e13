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

static void *avx2_loop(Work *w) {
    /* distinct starting values: equal chains would be computed once */
    __m256 a0 = _mm256_set1_ps(w->sink), a1 = _mm256_set1_ps(w->sink + 1);
    __m256 a2 = _mm256_set1_ps(w->sink + 2), a3 = _mm256_set1_ps(w->sink + 3);
    __m256 a4 = _mm256_set1_ps(w->sink + 4), a5 = _mm256_set1_ps(w->sink + 5);
    __m256 a6 = _mm256_set1_ps(w->sink + 6), a7 = _mm256_set1_ps(w->sink + 7);
    __m256 a8 = _mm256_set1_ps(w->sink + 8), a9 = _mm256_set1_ps(w->sink + 9);
    __m256 a10 = _mm256_set1_ps(w->sink + 10), a11 = _mm256_set1_ps(w->sink + 11);
    const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
    for (long i = 0; i < w->rounds; i++) {
        a0 = _mm256_fmadd_ps(a0, b, c); a1 = _mm256_fmadd_ps(a1, b, c);
        a2 = _mm256_fmadd_ps(a2, b, c); a3 = _mm256_fmadd_ps(a3, b, c);
        a4 = _mm256_fmadd_ps(a4, b, c); a5 = _mm256_fmadd_ps(a5, b, c);
        a6 = _mm256_fmadd_ps(a6, b, c); a7 = _mm256_fmadd_ps(a7, b, c);
        a8 = _mm256_fmadd_ps(a8, b, c); a9 = _mm256_fmadd_ps(a9, b, c);
        a10 = _mm256_fmadd_ps(a10, b, c); a11 = _mm256_fmadd_ps(a11, b, c);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    w->sink = _mm256_cvtss_f32(s);
    return 0;
}

__attribute__((target("avx512f"))) static void *avx512_loop(Work *w) {
    __m512 a0 = _mm512_set1_ps(w->sink), a1 = _mm512_set1_ps(w->sink + 1);
    __m512 a2 = _mm512_set1_ps(w->sink + 2), a3 = _mm512_set1_ps(w->sink + 3);
    __m512 a4 = _mm512_set1_ps(w->sink + 4), a5 = _mm512_set1_ps(w->sink + 5);
    __m512 a6 = _mm512_set1_ps(w->sink + 6), a7 = _mm512_set1_ps(w->sink + 7);
    __m512 a8 = _mm512_set1_ps(w->sink + 8), a9 = _mm512_set1_ps(w->sink + 9);
    __m512 a10 = _mm512_set1_ps(w->sink + 10), a11 = _mm512_set1_ps(w->sink + 11);
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
    for (long i = 0; i < w->rounds; i++) {
        a0 = _mm512_fmadd_ps(a0, b, c); a1 = _mm512_fmadd_ps(a1, b, c);
        a2 = _mm512_fmadd_ps(a2, b, c); a3 = _mm512_fmadd_ps(a3, b, c);
        a4 = _mm512_fmadd_ps(a4, b, c); a5 = _mm512_fmadd_ps(a5, b, c);
        a6 = _mm512_fmadd_ps(a6, b, c); a7 = _mm512_fmadd_ps(a7, b, c);
        a8 = _mm512_fmadd_ps(a8, b, c); a9 = _mm512_fmadd_ps(a9, b, c);
        a10 = _mm512_fmadd_ps(a10, b, c); a11 = _mm512_fmadd_ps(a11, b, c);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    w->sink = _mm512_reduce_add_ps(s);
    return 0;
}

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
