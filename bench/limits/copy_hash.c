/* What a checked copy of a memory-tier step can cost at best on this machine (issue 22's local bar:
 * restore >= 0.9 x a raw memcpy). Not part of the product: a measurement of the limits, in C so that
 * no interpreter or thread hand-off is in the figures.
 *
 *   cc -O3 -I slurm_omni/checkpoint/csrc -o /tmp/copy_hash bench/limits/copy_hash.c && /tmp/copy_hash [GiB]
 *   (xxhash.h: the product's vendored copy; xxh3 through AVX-512 or AVX2, as held_read.c chooses)
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
 * the kernel's copy (process_vm_readv, the only way into a keeper's private memory) plus xxh3 is under.
 *
 * Three rows more (2026-12-04; the figures above: 2026-12-02, AMD EPYC, process_vm_readv of this
 * process itself, xxh3 as -march=native compiled it): one pass, each 64-byte stripe loaded once, stored
 * with non-temporal stores (no read of the destination first, as glibc's memcpy for large copies) and
 * fed from the same registers into XXH3-64's accumulator (fused_update: the digest checked against
 * XXH3_64bits before the rounds), AVX2:
 *   one pass           from a buffer this process maps (or inherits): what a mapped keeper buffer, or
 *                      a rank forked by its keeper, could cost
 *   vm_readv>L2+1pass  process_vm_readv into a 512 KiB buffer (it stays in L2), then the one pass from
 *                      it into the destination: what a restore from a keeper's private memory could
 *                      cost with the hash folded into a copy it must make anyway
 *   map+1pass          the memfd mapped (MAP_POPULATE) as above, then the one pass from it
 * The process_vm_readv rows read a child process (as the keeper is one) from this change on, and xxh3
 * is taken with AVX-512 or AVX2 as held_read.c takes it. Intel Xeon (AVX-512, 2 MiB L2 a core, kernel
 * 6.18), 1 GiB, medians of 5, three runs 2026-12-04 16:32-16:33 with the default suite's CI beside them
 * (load 4-5), as memcpy / this: one pass 0.85, 0.78, 0.82; map+1pass from a 4 KiB-page memfd 0.60,
 * 0.50, 0.65 (its MAP_POPULATE alone 0.25-0.48 of the memcpy on this kernel); 32 KiB steps of memcpy
 * then xxh3 0.50-0.74; vm_readv+xxh3 at 1 MiB (the restore's loop today) 0.31, 0.37, 0.43;
 * vm_readv>L2+1pass 0.39, 0.48, 0.63. So the one pass is the cheapest checked copy measured here, 2 to
 * 2.5 x the restore's loop, where the rank can address the bytes itself (a mapped or an inherited
 * keeper buffer); behind process_vm_readv it adds little: held_read.c with the L2 buffer and the one
 * pass cost the same CPU in the bench's restore (bench/ckpt_bench.py --memory: 0.242 against 0.240 s
 * per GiB, two threads) and in a paired harness (0.343 against 0.342 s; quiet, the source on huge
 * pages: 0.300 against 0.279 s, dearer): not adopted there. Against the bar's own memcpy (torch's
 * copy_ on two threads), the one pass on two threads: bench/limits/one_pass_bar.py. */
#define _GNU_SOURCE
#if !defined(__x86_64__) || !defined(__GNUC__)
#error "copy_hash: the one-pass rows are written for x86-64 (AVX2)"
#endif
#include "xxh3_x86.h"   /* xxhash.h with its AVX2 and AVX-512 kernels beside SSE2 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "one_pass.h"      /* fused_reset, fused_update, fused_digest: the one pass */

static omni_xxh3_update_fn update;   /* xxh3 as the product's loop takes it (omni_xxh3_pick) */

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
        update(state, dst + at, step);
    }
    (void)XXH3_64bits_digest(state);
    XXH3_freeState(state);
    munmap(mapped, n);
    snprintf(line, sizeof line, "map+copy+xxh3 %s", what);
    report(line, 0, t);
    t = start();
    mapped = mmap(NULL, n, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (mapped == MAP_FAILED) {
        perror("copy_hash: mmap keeper buffer");
        exit(1);
    }
    struct fused f;
    fused_reset(&f, n);
    fused_update(&f, dst, mapped, n);
    (void)fused_digest(&f, dst + n);
    munmap(mapped, n);
    snprintf(line, sizeof line, "map+1pass %s", what);
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
    __builtin_cpu_init();
    update = omni_xxh3_pick();
    if (!__builtin_cpu_supports("avx2")) {
        fprintf(stderr, "copy_hash: this CPU has no AVX2 (the one-pass rows need it)\n");
        return 2;
    }
    /* the one pass is XXH3-64: checked against xxhash's own on lengths around its edges first */
    for (size_t len = 241; len < (8u << 20); len = len * 5 / 3 + 1) {
        struct fused f;
        fused_reset(&f, len);
        for (size_t at = 0; at < len; at += 4096)
            fused_update(&f, dst + 1 + at, src + 3 + at, len - at < 4096 ? len - at : 4096);
        if (fused_digest(&f, dst + 1 + len) != XXH3_64bits(src + 3, len) || memcmp(dst + 1, src + 3, len)) {
            fprintf(stderr, "copy_hash: the one pass differs from XXH3_64bits at %zu bytes\n", len);
            return 1;
        }
    }
    /* the keeper: a child holding the same bytes (inherited), read with process_vm_readv */
    int hold[2];
    if (pipe(hold) != 0) {
        perror("copy_hash: pipe");
        return 1;
    }
    pid_t keeper = fork();
    if (keeper < 0) {
        perror("copy_hash: fork");
        return 1;
    }
    if (keeper == 0) {
        char end;
        close(hold[1]);
        while (read(hold[0], &end, 1) < 0)
            ;
        _exit(0);
    }
    close(hold[0]);
    unsigned char *bounce = touched(512 << 10);
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
                update(state, dst + at, step);
            }
            (void)XXH3_64bits_digest(state);
            report("mapped+xxh3", step, t);
            XXH3_64bits_reset(state);
            t = start();
            for (size_t at = 0; at < n; at += step) {
                struct iovec here = {dst + at, step}, there = {src + at, step};
                if (process_vm_readv(keeper, &here, 1, &there, 1, 0) != (ssize_t)step) {
                    perror("copy_hash: process_vm_readv");
                    return 1;
                }
                update(state, dst + at, step);
            }
            (void)XXH3_64bits_digest(state);
            report("vm_readv+xxh3", step, t);
            XXH3_freeState(state);
        }
        struct fused f;
        fused_reset(&f, n);
        t = start();
        fused_update(&f, dst, src, n);
        (void)fused_digest(&f, dst + n);
        report("one pass", 0, t);
        fused_reset(&f, n);
        t = start();
        for (size_t at = 0; at < n; at += 512 << 10) {
            struct iovec here = {bounce, 512 << 10}, there = {src + at, 512 << 10};
            if (process_vm_readv(keeper, &here, 1, &there, 1, 0) != 512 << 10) {
                perror("copy_hash: process_vm_readv");
                return 1;
            }
            fused_update(&f, dst + at, bounce, 512 << 10);
        }
        (void)fused_digest(&f, dst + n);
        report("vm_readv>L2+1pass", 512 << 10, t);
        mapped_and_checked("memfd (4 KiB)", plain, dst, n);
        if (huge >= 0)
            mapped_and_checked("memfd (hugetlb)", huge, dst, n);
    }
    close(hold[1]);
    waitpid(keeper, NULL, 0);
    return 0;
}
