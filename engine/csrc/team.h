/* The kernels' worker team (team.c): one parallel job at a time over threads t = 0 .. T - 1. */
#ifndef AGENTRT_TEAM_H
#define AGENTRT_TEAM_H

#include <stdatomic.h>
#include <stdint.h>

/* A job: thread t of T does its share of the work behind ctx. */
typedef void (*team_job)(void *ctx, int t, int T);

/* A barrier for the threads of one job; zero-initialised, reusable right away. */
typedef struct {
    atomic_int arrived;
    atomic_int phase;
} TeamBarrier;

void team_run(team_job job, void *ctx, int threads);
void team_barrier(TeamBarrier *b, int T);
void team_share(int64_t units, int t, int T, int64_t *a, int64_t *b);

#endif
