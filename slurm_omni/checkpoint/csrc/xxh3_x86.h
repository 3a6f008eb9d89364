/* xxhash.h inlined, and on x86-64 with GCC or Clang its own way for a dispatcher (xxh_x86dispatch.c's):
 * its AVX2 and AVX-512 kernels (XXH3_accumulate_512_avx2, ..._avx512 and their scrambles) compiled for
 * their targets beside the SSE2 default, and omni_xxh3_pick() choosing the one the CPU runs at run
 * time (as the python xxhash package does: the SSE2 kernel alone costs 15-30 % more CPU a byte
 * here). Included by the memory tier's restore loop (held_read.c) and the limits it is measured
 * against (bench/limits/copy_hash.c); define _GNU_SOURCE before it where wanted. */
#ifndef OMNI_XXH3_X86_H
#define OMNI_XXH3_X86_H

#define XXH_INLINE_ALL
#if defined(__x86_64__) && defined(__GNUC__)
#define XXH_X86DISPATCH
#define XXH_DISPATCH_AVX2 1
#define XXH_DISPATCH_AVX512 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#define XXH_TARGET_AVX512 __attribute__((__target__("avx512f")))
#include <immintrin.h>
#endif
#include "xxhash.h"

/* XXH3-64's streaming update through the kernel the CPU runs, chosen once by omni_xxh3_pick() (AVX-512,
 * else AVX2, else xxhash.h's compile-time default). */
typedef XXH_errorcode (*omni_xxh3_update_fn)(XXH3_state_t *, const void *, size_t);

#if defined(__x86_64__) && defined(__GNUC__)
XXH_TARGET_AVX2 static inline XXH_errorcode omni_xxh3_update_avx2(XXH3_state_t *state, const void *in, size_t len)
{
	return XXH3_update(state, (const xxh_u8 *)in, len, XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2);
}

XXH_TARGET_AVX512 static inline XXH_errorcode omni_xxh3_update_avx512(XXH3_state_t *state, const void *in,
								       size_t len)
{
	return XXH3_update(state, (const xxh_u8 *)in, len, XXH3_accumulate_512_avx512,
			   XXH3_scrambleAcc_avx512);
}

static inline omni_xxh3_update_fn omni_xxh3_pick(void)
{
	__builtin_cpu_init();
	if (__builtin_cpu_supports("avx512f"))
		return omni_xxh3_update_avx512;
	if (__builtin_cpu_supports("avx2"))
		return omni_xxh3_update_avx2;
	return XXH3_64bits_update;
}
#else
static inline omni_xxh3_update_fn omni_xxh3_pick(void)
{
	return XXH3_64bits_update;
}
#endif

#endif
