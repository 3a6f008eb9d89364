/* What a checked copy of a memory-tier step can cost at best on this machine (issue 22's local bar:
 * restore >= 0.9 x a raw memcpy). Not part of the product: a measurement of the limits, in C so that
 * no interpreter or thread hand-off is in the figures.
 *
 *   sudo apt-get install libxxhash-dev     # xxhash.h (the same XXH3-64 as the python xxhash package)
 *   cc -O3 -march=native -o /tmp/copy_hash bench/limits/copy_hash.c && /tmp/copy_hash [GiB]
 *
 * Per round, on one thread, wall and CPU seconds of:
 *   memcpy             glibc's memcpy of the whole buffer (large copies use non-temporal stores)
 *   mapped+xxh3 K      memcpy in K-byte steps, each step hashed right after it lands (in L1 at 32 KiB):
 *                      what a restore could cost if it could map the keeper's memory
 *   vm_readv+xxh3 K    process_vm_readv in K-byte steps, each hashed after it lands: what a restore
 *                      from a keeper's private (anonymous, huge-page) memory costs at least; a step
 *                      under 1 MiB pays a system call per step
 *   map memfd          mmap(MAP_POPULATE) of a memfd of the same size (4 KiB shmem pages unless the
 *                      site enables shmem huge pages): what mapping a shared keeper buffer costs
 * Medians of 5 rounds, 2026-12-02 16:57 (2 cores, load 4, another session's tests running), as
 * memcpy / this (1.00 = as fast as the memcpy), wall and CPU: mapped+xxh3 0.95 / 0.93 at 32 and 256 KiB,
 * 0.85 / 0.84 at 1 MiB; vm_readv+xxh3 0.50 / 0.55 at 32 KiB, 0.69 / 0.73 at 256 KiB, 0.82 / 0.81 at
 * 1 MiB (the restore's step); mapping the 1 GiB memfd 0.52 / 0.52, i.e. the mapping alone costs about
 * twice the copy. The python restore of the same bytes reached 0.64 wall / 0.77 CPU of torch's copy_
 * (bench/ckpt_bench.py --memory). So a checked copy at 0.9 x memcpy exists here only from a buffer the
 * restore can map: a keeper buffer mapped
 * without 4 KiB faults (hugetlbfs or shmem_enabled=advise, a site setting) and a fused copy+hash loop. */
#define _GNU_SOURCE
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double clock_s(clockid_t id)
{
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

struct timer { double wall, cpu; };

static struct timer start(void)
{
    return (struct timer){clock_s(CLOCK_MONOTONIC), clock_s(CLOCK_PROCESS_CPUTIME_ID)};
}

static void report(const char *what, size_t step, struct timer t)
{
    double wall = clock_s(CLOCK_MONOTONIC) - t.wall, cpu = clock_s(CLOCK_PROCESS_CPUTIME_ID) - t.cpu;
    if (step)
        printf("  %-16s %5zu KiB  wall %.3f s  cpu %.3f s\n", what, step >> 10, wall, cpu);
    else
        printf("  %-26s wall %.3f s  cpu %.3f s\n", what, wall, cpu);
}

static unsigned char *touched(size_t n)
{
    unsigned char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("copy_hash: mmap");
        exit(1);
    }
    madvise(p, n, MADV_HUGEPAGE);   /* as the keeper's buffers (AnonHugePages) */
    for (size_t i = 0; i < n; i += sizeof(unsigned long))
        *(unsigned long *)(p + i) = i * 2654435761UL;
    return p;
}

int main(int argc, char **argv)
{
    size_t gib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1;
    if (gib < 1 || gib > 16) {
        fprintf(stderr, "copy_hash: GiB %s: expected 1-16\n", argv[1]);
        return 2;
    }
    size_t n = gib << 30;
    unsigned char *src = touched(n), *dst = touched(n);
    static const size_t steps[] = {32 << 10, 256 << 10, 1 << 20};
    int memfd = memfd_create("copy_hash", 0);
    if (memfd < 0 || ftruncate(memfd, (off_t)n) != 0) {
        perror("copy_hash: memfd");
        return 1;
    }
    unsigned char *keeper = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (keeper == MAP_FAILED) {
        perror("copy_hash: mmap memfd");
        return 1;
    }
    memcpy(keeper, src, n);   /* the keeper's bytes in shmem pages, as a shared keeper buffer would hold */
    munmap(keeper, n);
    printf("%zu GiB, one thread\n", gib);
    for (int round = 0; round < 5; round++) {
        printf("round %d\n", round + 1);
        struct timer t = start();
        memcpy(dst, src, n);
        report("memcpy", 0, t);
        for (size_t k = 0; k < sizeof steps / sizeof *steps; k++) {
            size_t step = steps[k];
            XXH3_state_t *state = XXH3_createState();
            XXH3_64bits_reset(state);
            t = start();
            for (size_t at = 0; at < n; at += step) {
                memcpy(dst + at, src + at, step);
                XXH3_64bits_update(state, dst + at, step);
            }
            (void)XXH3_64bits_digest(state);
            report("mapped+xxh3", step, t);
            XXH3_64bits_reset(state);
            t = start();
            for (size_t at = 0; at < n; at += step) {
                struct iovec here = {dst + at, step}, there = {src + at, step};
                if (process_vm_readv(getpid(), &here, 1, &there, 1, 0) != (ssize_t)step) {
                    perror("copy_hash: process_vm_readv");
                    return 1;
                }
                XXH3_64bits_update(state, dst + at, step);
            }
            (void)XXH3_64bits_digest(state);
            report("vm_readv+xxh3", step, t);
            XXH3_freeState(state);
        }
        t = start();
        void *mapped = mmap(NULL, n, PROT_READ, MAP_SHARED | MAP_POPULATE, memfd, 0);
        if (mapped == MAP_FAILED) {
            perror("copy_hash: mmap memfd");
            return 1;
        }
        report("map memfd (MAP_POPULATE)", 0, t);
        munmap(mapped, n);
    }
    return 0;
}
