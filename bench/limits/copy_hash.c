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
 *   map memfd (...)    mmap(MAP_POPULATE) of a memfd of the same bytes (4 KiB shmem pages, or hugetlb
 *                      pages when vm.nr_hugepages reserves them): what mapping a shared keeper buffer
 *                      costs; map+copy+xxh3: that mapping, then the copy in 32 KiB steps, each hashed
 * Medians of 5 rounds, as memcpy / this (1.00 = as fast as the memcpy), wall and CPU, 2 cores, another
 * session's tests running: 16:57 (load 4) and 16:59 (load 5, 520 huge pages reserved for the run and
 * given back): copy from a mapped buffer hashed per 32-256 KiB step 0.84-0.95; process_vm_readv + xxh3
 * 0.50-0.55 at 32 KiB, 0.69-0.73 at 256 KiB, 0.76-0.82 at 1 MiB (the restore's step); mapping a 1 GiB
 * memfd of 4 KiB shmem pages 0.52-0.57 by itself (map, copy and hash 0.25); a hugetlb memfd maps in
 * 1 ms, map, copy and hash 0.65 (0.87 in a trial of the same loop at 64 KiB steps, 16:58, load 9).
 * The python restore of the same bytes: 0.64 wall / 0.77 CPU of torch's copy_ (bench/ckpt_bench.py
 * --memory). So on this machine even the best checked copy is at the 0.9 bar, not clearly over it;
 * the kernel's copy (process_vm_readv, the only way into a keeper's private memory) plus xxh3 is under. */
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

/* A shared buffer holding the source's bytes, as a keeper could hand its restoring rank (SCM_RIGHTS):
 * a memfd of shmem pages, or of huge pages with MFD_HUGETLB (-1 when none are reserved). */
static int keeper_buffer(const unsigned char *src, size_t n, unsigned int flags)
{
    int fd = memfd_create("copy_hash", flags);
    if (fd < 0 || ftruncate(fd, (off_t)n) != 0) {
        if (!flags)
            perror("copy_hash: memfd");
        if (fd >= 0)
            close(fd);
        return -1;
    }
    unsigned char *keeper = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (keeper == MAP_FAILED) {
        if (!flags)
            perror("copy_hash: mmap memfd");
        close(fd);
        return -1;
    }
    memcpy(keeper, src, n);
    munmap(keeper, n);
    return fd;
}

/* The restoring rank's side: map the keeper's buffer (MAP_POPULATE), then copy it in 32 KiB steps,
 * each hashed while it is in the core's cache; the mapping's own cost printed apart. */
static void mapped_and_checked(const char *what, int fd, unsigned char *dst, size_t n)
{
    const size_t step = 32 << 10;
    struct timer t = start();
    unsigned char *mapped = mmap(NULL, n, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (mapped == MAP_FAILED) {
        perror("copy_hash: mmap keeper buffer");
        exit(1);
    }
    char line[64];
    snprintf(line, sizeof line, "map %s", what);
    report(line, 0, t);
    XXH3_state_t *state = XXH3_createState();
    XXH3_64bits_reset(state);
    for (size_t at = 0; at < n; at += step) {
        memcpy(dst + at, mapped + at, step);
        XXH3_64bits_update(state, dst + at, step);
    }
    (void)XXH3_64bits_digest(state);
    XXH3_freeState(state);
    munmap(mapped, n);
    snprintf(line, sizeof line, "map+copy+xxh3 %s", what);
    report(line, 0, t);
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
    int plain = keeper_buffer(src, n, 0), huge = keeper_buffer(src, n, MFD_HUGETLB);
    if (plain < 0)
        return 1;
    if (huge < 0)
        printf("hugetlb memfd: n/a (%zu huge pages of 2 MiB needed: vm.nr_hugepages, a site setting)\n", n >> 21);
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
        mapped_and_checked("memfd (4 KiB)", plain, dst, n);
        if (huge >= 0)
            mapped_and_checked("memfd (hugetlb)", huge, dst, n);
    }
    return 0;
}
