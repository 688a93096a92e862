/* Pin each thread of the OpenMP pool (torch's intra-op threads: this library is loaded after
 * torch's libgomp, so it shares that runtime) to a core of its own: thread i runs on cores[i].
 * Run from the thread that runs torch's ops, whose pool it is. Returns how many threads were
 * pinned (n when all were).
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>

int bind_omp_threads(const int *cores, int n) {
    int bound = 0;
    #pragma omp parallel num_threads(n) reduction(+ : bound)
    {
        const int i = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cores[i], &set);
        bound += sched_setaffinity(0, sizeof set, &set) == 0;
    }
    return bound;
}
