/* xxhash.h inlined, and on x86-64 with GCC or Clang its own way for a dispatcher (xxh_x86dispatch.c's):
 * its AVX2 and AVX-512 kernels (XXH3_accumulate_512_avx2, ..._avx512 and their scrambles) compiled for
 * their targets beside the SSE2 default, so that the code including it picks the one the CPU runs at
 * run time (as the python xxhash package does: the SSE2 kernel alone costs 15-30 % more CPU a byte
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

#endif
