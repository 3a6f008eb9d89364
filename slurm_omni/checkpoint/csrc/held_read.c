/* The memory tier's restore loop (held.py: Plan, read_hashed): a restore's pieces of shard copies from
 * the node keeper's memory into the tensors' own memory with process_vm_readv, a step at a time, each
 * step hashed into the piece's XXH3-64 right after it lands, while the core's cache still holds it,
 * and the digest compared with the manifest's here.
 *
 * Why C: the Python loop hands the GIL over twice a step (after the copy, after the hash); with the
 * I/O threads of a restore that is thousands of hand-overs a GiB. Here each I/O thread runs the whole
 * restore's plan in one ctypes call, which releases the GIL for all of it, claiming piece after piece
 * and waiting on a futex for pieces the restoring thread has not planned yet.
 *
 * xxhash.h is xxHash 0.8.1's single header (BSD 2-Clause, its licence at its top), vendored as Debian
 * 12's libxxhash-dev ships it: the same XXH3-64 as the python xxhash package, with no -dev package
 * needed where the product is built. */
#define _GNU_SOURCE
#include "xxh3_x86.h"	/* xxhash.h with its AVX2 and AVX-512 kernels beside SSE2 */
#if defined(__x86_64__) && defined(__GNUC__)
#include "one_pass.h"	/* fused_reset, fused_update, fused_digest: copy and XXH3-64 in one pass */
#define OMNI_ONE_PASS 1
#else
#define OMNI_ONE_PASS 0
#endif

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define OMNI_EXPORT __attribute__((visibility("default")))

static omni_xxh3_update_fn update;
static int one_pass;	/* the CPU runs the one pass (AVX2) */

__attribute__((constructor)) static void choose(void)
{
	update = omni_xxh3_pick();
#if OMNI_ONE_PASS
	__builtin_cpu_init();
	one_pass = __builtin_cpu_supports("avx2");
#endif
}

/* 1 where a copy this process addresses itself is read with the one pass (AVX2), else 0. */
OMNI_EXPORT int omni_held_read_one_pass(void)
{
	return one_pass;
}

/* n bytes at `src` in this very process (a copy the standby holds, inherited at the fork) to `dst`,
 * and their XXH3-64: in one pass where the CPU runs it and the bytes take XXH3's long form (more than
 * 240), else copied and hashed a step at a time. */
static int copy_hashed(const unsigned char *src, unsigned char *dst, size_t n, size_t step, uint64_t *digest)
{
	XXH3_state_t state;
	size_t at;

#if OMNI_ONE_PASS
	if (one_pass && n > XXH3_MIDSIZE_MAX) {
		struct fused f;

		fused_reset(&f, n);
		fused_update(&f, dst, src, n);
		*digest = fused_digest(&f, dst + n);
		return 0;
	}
#endif
	if (XXH3_64bits_reset(&state) == XXH_ERROR)
		return EINVAL;
	for (at = 0; at < n; at += step) {
		size_t len = n - at < step ? n - at : step;

		memcpy(dst + at, src + at, len);
		if (update(&state, dst + at, len) == XXH_ERROR)
			return EINVAL;
	}
	*digest = XXH3_64bits_digest(&state);
	return 0;
}

/* The kernel the CPU runs (for the bench's line): 2 AVX-512, 1 AVX2, 0 the default. */
OMNI_EXPORT int omni_held_read_kernel(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
	return update == omni_xxh3_update_avx512 ? 2 : update == omni_xxh3_update_avx2 ? 1 : 0;
#else
	return 0;
#endif
}

/* The ABI the Python side checks before it calls anything else. */
OMNI_EXPORT int omni_held_read_abi(void)
{
	return 4;
}

/* n bytes at `remote` in process `pid` to `local`, in steps of `step` bytes, each hashed as it lands.
 * Returns 0 with the XXH3-64 of the n bytes in *digest, else an errno (ESRCH: the keeper is gone;
 * EPERM: no ptrace access; EFAULT: a range it no longer maps) with the bytes read before in *done.
 * `pid` 0: the bytes are this process's own memory (a copy inherited from the standby that holds it,
 * its range checked by the caller), copied here. */
OMNI_EXPORT int omni_read_hashed(int pid, uint64_t remote, void *local, size_t n, size_t step,
				 uint64_t *digest, size_t *done)
{
	XXH3_state_t state;
	char *out = local;
	size_t at = 0;

	*done = 0;
	if (step == 0)
		return EINVAL;
	if (pid == 0) {
		int code = copy_hashed((const unsigned char *)(uintptr_t)remote, local, n, step, digest);

		*done = code ? 0 : n;
		return code;
	}
	if (XXH3_64bits_reset(&state) == XXH_ERROR)
		return EINVAL;
	while (at < n) {
		size_t len = n - at < step ? n - at : step;
		size_t got = 0;

		while (got < len) {	/* a short read: the rest of the step again */
			struct iovec mine = { .iov_base = out + at + got, .iov_len = len - got };
			struct iovec theirs = { .iov_base = (void *)(uintptr_t)(remote + at + got),
						.iov_len = len - got };
			ssize_t r = process_vm_readv(pid, &mine, 1, &theirs, 1, 0);

			if (r < 0 && errno == EINTR)
				continue;
			if (r <= 0) {
				*done = at + got;
				return r < 0 ? errno : EFAULT;
			}
			got += (size_t)r;
		}
		if (update(&state, out + at, len) == XXH_ERROR)
			return EINVAL;
		at += len;
	}
	*digest = XXH3_64bits_digest(&state);
	*done = n;
	return 0;
}

/* One piece of a restore's plan (held.py's BatchPiece mirrors it). */
struct omni_piece {
	uint64_t remote;	/* its first byte in the keeper's copy */
	uint64_t local;		/* where it goes here: the tensor's own memory */
	uint64_t len;
	uint64_t want;		/* the manifest's XXH3-64 of it */
	int64_t pid;		/* the keeper holding the copy */
};

/* What the threads reading one plan share (held.py's PlanState mirrors it). */
struct omni_plan {
	uint32_t ready;		/* pieces planned so far (a futex word); PLAN_FINAL once no more come */
	int32_t stop;		/* a piece failed: claim nothing more */
	uint64_t next;		/* the next piece to claim */
};

#define PLAN_FINAL 0x80000000u

/* The pieces of a plan, read and checked by the threads that call this together, while the planner
 * (the restoring thread, in Python) still adds pieces: a thread waits on the futex for the piece it
 * claimed to be planned, so the copying starts with the first unit planned and no thread needs the
 * GIL between two pieces. Each thread claims the next piece until none is left, so a thread a busy
 * core slows leaves the rest to the others (no share fixed ahead). status[i]: 0 read and its XXH3-64 is
 * the manifest's; -1 it is not; else the errno of the read. Any failure sets plan->stop: the copy is
 * bad, the restore reads the files instead, so the other threads claim nothing more. Returns how many
 * pieces this call read. */
OMNI_EXPORT size_t omni_read_plan(const struct omni_piece *pieces, struct omni_plan *plan, size_t step,
				  int32_t *status)
{
	size_t mine = 0;

	for (;;) {
		size_t i = __atomic_fetch_add(&plan->next, 1, __ATOMIC_RELAXED);
		uint64_t digest = 0;
		size_t done = 0;
		int code;

		for (;;) {
			uint32_t ready = __atomic_load_n(&plan->ready, __ATOMIC_ACQUIRE);

			if (i < (ready & ~PLAN_FINAL))
				break;
			if (ready & PLAN_FINAL)
				return mine;
			syscall(SYS_futex, &plan->ready, FUTEX_WAIT_PRIVATE, ready, NULL, NULL, 0);
		}
		if (__atomic_load_n(&plan->stop, __ATOMIC_RELAXED))
			return mine;
		code = omni_read_hashed((int)pieces[i].pid, pieces[i].remote, (void *)(uintptr_t)pieces[i].local,
					pieces[i].len, step, &digest, &done);
		if (code == 0 && digest != pieces[i].want)
			code = -1;
		status[i] = code;
		if (code != 0)
			__atomic_store_n(&plan->stop, 1, __ATOMIC_RELAXED);
		mine++;
	}
}

/* The first `ready` pieces are planned (their fields written before this call); `final`: no more
 * come (nor do any, with `stop`: the planner gave up). Wakes the threads waiting for them. */
OMNI_EXPORT void omni_plan_publish(struct omni_plan *plan, uint32_t ready, int final, int stop)
{
	if (stop)
		__atomic_store_n(&plan->stop, 1, __ATOMIC_RELAXED);
	__atomic_store_n(&plan->ready, ready | (final ? PLAN_FINAL : 0), __ATOMIC_RELEASE);
	syscall(SYS_futex, &plan->ready, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
