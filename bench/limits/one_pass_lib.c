/* The one pass (one_pass.h) as a shared library for bench/limits/one_pass_bar.py, which builds it. */
#define _GNU_SOURCE
#include "one_pass.h"

/* n bytes (more than 240: XXH3's long form) from src to dst; their XXH3-64. */
__attribute__((visibility("default"))) uint64_t omni_one_pass(unsigned char *dst, const unsigned char *src, size_t n)
{
    struct fused f;

    fused_reset(&f, n);
    fused_update(&f, dst, src, n);
    return fused_digest(&f, dst + n);
}

/* 1 where the CPU has AVX2 (the pass's), else 0. */
__attribute__((visibility("default"))) int omni_one_pass_ok(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}
