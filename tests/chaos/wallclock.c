/* Preload shim for the chaos suite's clock skew (tests/chaos/_faults.py: skewed_env).
 *
 * Shifts the wall clock -- clock_gettime(CLOCK_REALTIME*, CLOCK_TAI), gettimeofday(),
 * time() -- by FY_WALLCLOCK_OFFSET_S seconds (an integer, may be negative) and touches
 * nothing else: monotonic clocks, sleeps and timed waits stay the kernel's.
 *
 * Why not libfaketime: Debian's 0.9.10 also rewrites sleeps and waits, and in CPython
 * 3.11 that breaks them (measured on Debian 12, CPython 3.11.7): with
 * FAKETIME_DONT_FAKE_MONOTONIC=1 every time.sleep() and Popen.wait(timeout) fails with
 * EINVAL; without it threading.Event.wait(0.3) never returns.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long offset_s;
static int (*real_clock_gettime)(clockid_t, struct timespec *);

__attribute__((constructor)) static void init(void) {
    const char *v = getenv("FY_WALLCLOCK_OFFSET_S");
    offset_s = v ? strtol(v, NULL, 10) : 0;
    real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
}

static int is_wall(clockid_t id) {
    return id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE || id == CLOCK_TAI;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!real_clock_gettime)
        init();
    int rc = real_clock_gettime(id, ts);
    if (rc == 0 && is_wall(id))
        ts->tv_sec += offset_s;
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return -1;
    {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
