/* A team of worker threads for the kernels' parallel loops.

   Between jobs the workers spin for a short while (AGENTRT_SPIN_US microseconds, default 1000)
   before they sleep, so the many small jobs of one forward start without a wake-up each, and
   team_barrier spins too. OpenMP's runtime would put its threads to sleep at once whenever
   the process holds more OpenMP threads than cores, which it does as soon as two Python
   threads have run parallel code (torch's and the engine's): every barrier of a step then
   costs a futex wake-up, about 4 ms per forward of a 135M model on two cores.

   One job runs at a time (callers from other threads wait); jobs must not start jobs. Thread 0
   of every job is the caller; a job gets at most as many threads as the process has CPUs. A job's threads t = 0 .. T - 1 split its work by t alone, so the
   results never depend on which thread ran what. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "team.h"

#define TEAM_MAX 64

static struct {
    pthread_mutex_t run_lock;       /* held by the thread whose job runs */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    int workers;                    /* started so far; worker i is thread i + 1 of a job */
    atomic_ulong generation;        /* one more per job */
    atomic_int pending;             /* workers that have not yet finished the current job */
    team_job job;
    void *ctx;
    int threads;
    int cores;                      /* CPUs this process may run on: the most threads a job gets */
    long spin_ns;
} team = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Spin (pausing, and yielding the core now and then to a thread that needs it) until *word
   differs from old. */
static inline void spin_while_equal_int(atomic_int *word, int old) {
    for (unsigned spins = 1; atomic_load_explicit(word, memory_order_acquire) == old; spins++) {
        _mm_pause();
        if ((spins & 255) == 0) sched_yield();
    }
}

static unsigned long start_generation[TEAM_MAX];

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    unsigned long seen = start_generation[index];  /* the job being set up is its first */
    for (;;) {
        unsigned long g;
        long deadline = 0;
        unsigned spins = 0;
        while ((g = atomic_load_explicit(&team.generation, memory_order_acquire)) == seen) {
            _mm_pause();
            if ((++spins & 255) != 0) continue;
            const long t = now_ns();
            if (deadline == 0) {
                deadline = t + team.spin_ns;
            } else if (t > deadline) {
                pthread_mutex_lock(&team.sleep_lock);
                while (atomic_load(&team.generation) == seen)
                    pthread_cond_wait(&team.wake, &team.sleep_lock);
                pthread_mutex_unlock(&team.sleep_lock);
            } else {
                sched_yield();
            }
        }
        seen = g;
        if (index + 1 < team.threads)
            team.job(team.ctx, index + 1, team.threads);
        atomic_fetch_sub_explicit(&team.pending, 1, memory_order_release);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* the workers do not exist in a forked child: start afresh */
    pthread_mutex_init(&team.run_lock, NULL);
    pthread_mutex_init(&team.sleep_lock, NULL);
    pthread_cond_init(&team.wake, NULL);
    team.workers = 0;
}

/* Once per process: the settings, and the fork handler. */
static void setup(void) {
    static int done = 0;
    if (done) return;
    const char *env = getenv("AGENTRT_SPIN_US");
    team.spin_ns = (env ? atol(env) : 1000) * 1000L;
    cpu_set_t allowed;
    team.cores = sched_getaffinity(0, sizeof(allowed), &allowed) == 0 ? CPU_COUNT(&allowed) : 1;
    pthread_atfork(NULL, NULL, after_fork_in_child);
    done = 1;
}

/* Start workers until the team has threads - 1 of them (the caller is thread 0). */
static void grow(int threads) {
    while (team.workers < threads - 1 && team.workers < TEAM_MAX - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_generation[team.workers] = atomic_load(&team.generation);
        if (pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)team.workers) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        team.workers++;
    }
}

/* job(ctx, t, T) on T = min(threads, the CPUs this process may use, team size) threads, t = 0
   on the caller (spinning threads beyond the cores would only wait for each other); returns
   when every thread has finished. */
void team_run(team_job job, void *ctx, int threads) {
    if (threads <= 1) {
        job(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&team.run_lock);
    setup();
    if (threads > team.cores) threads = team.cores > 1 ? team.cores : 1;
    grow(threads);
    const int T = threads < team.workers + 1 ? threads : team.workers + 1;
    team.job = job;
    team.ctx = ctx;
    team.threads = T;
    atomic_store_explicit(&team.pending, team.workers, memory_order_relaxed);
    atomic_fetch_add_explicit(&team.generation, 1, memory_order_release);
    pthread_mutex_lock(&team.sleep_lock);
    pthread_cond_broadcast(&team.wake);
    pthread_mutex_unlock(&team.sleep_lock);
    job(ctx, 0, T);
    for (unsigned spins = 1; atomic_load_explicit(&team.pending, memory_order_acquire) > 0; spins++) {
        _mm_pause();
        if ((spins & 255) == 0) sched_yield();
    }
    pthread_mutex_unlock(&team.run_lock);
}

/* Wait until all T threads of the running job have arrived (reusable right away). */
void team_barrier(TeamBarrier *b, int T) {
    if (T <= 1) return;
    const int phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == T - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
    } else {
        spin_while_equal_int(&b->phase, phase);
    }
}

/* units * t / T .. units * (t + 1) / T: thread t's even share of `units`, the split every
   job uses. */
void team_share(int64_t units, int t, int T, int64_t *a, int64_t *b) {
    *a = units * t / T;
    *b = units * (t + 1) / T;
}
