/* The one pass: each 64-byte stripe loaded once, stored with non-temporal stores where the destination
 * is 32-byte aligned, and fed from the same registers into XXH3-64's accumulator. held_read.c copies a
 * shard copy this process addresses itself (inherited from the standby that holds it) with it; the
 * limit scripts of bench/limits measure it (copy_hash.c's rows, one_pass_bar.py, inherited_bar.py).
 * x86-64 only; needs AVX2 at run time (the caller checks). */
#ifndef OMNI_ONE_PASS_H
#define OMNI_ONE_PASS_H

#include "xxh3_x86.h"

#include <stdint.h>
#include <string.h>

/* XXH3-64's long form (more than 240 bytes) taken while the bytes are copied, in one pass: the stripes
 * XXH3 accumulates in order are the (len - 1) / 64 at offsets 0, 64, ..., each with the secret at
 * 8 x (its index mod 16), the accumulators scrambled after every 16th; then the last 64 bytes with the
 * secret's own offset, and the merge (xxhash.h: XXH3_hashLong_internal_loop, XXH3_mergeAccs). */
struct fused {
    uint64_t acc[XXH_ACC_NB] __attribute__((aligned(64)));
    size_t len, stripes_done, stripes;
};

static void fused_reset(struct fused *f, size_t len)
{
    static const uint64_t init[XXH_ACC_NB] = XXH3_INIT_ACC;
    memcpy(f->acc, init, sizeof init);
    f->len = len;
    f->stripes_done = 0;
    f->stripes = (len - 1) / XXH_STRIPE_LEN;
}

#define STRIPES_PER_BLOCK ((XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE)

/* The piece's next n bytes (a multiple of 64 unless they end it) from src to dst, non-temporal where
 * dst is 32-byte aligned, their stripes accumulated from the same registers. */
XXH_TARGET_AVX2 static void fused_update(struct fused *f, unsigned char *dst, const unsigned char *src, size_t n)
{
    __m256i *acc = (__m256i *)f->acc;
    __m256i a0 = _mm256_load_si256(acc), a1 = _mm256_load_si256(acc + 1);
    const __m256i *p = (const __m256i *)src;
    __m256i *q = (__m256i *)dst;
    size_t s = f->stripes_done, count = n / XXH_STRIPE_LEN, i;
    int stream = ((uintptr_t)dst & 31) == 0;

    if (count > f->stripes - s)
        count = f->stripes - s;
    for (i = 0; i < count; i++, s++, p += 2, q += 2) {
        __m256i d0 = _mm256_loadu_si256(p), d1 = _mm256_loadu_si256(p + 1);
        const __m256i *k = (const __m256i *)(XXH3_kSecret + XXH_SECRET_CONSUME_RATE * (s % STRIPES_PER_BLOCK));
        __m256i x0 = _mm256_xor_si256(d0, _mm256_loadu_si256(k)), x1 = _mm256_xor_si256(d1, _mm256_loadu_si256(k + 1));

        if (stream) {
            _mm256_stream_si256(q, d0);
            _mm256_stream_si256(q + 1, d1);
        } else {
            _mm256_storeu_si256(q, d0);
            _mm256_storeu_si256(q + 1, d1);
        }
        a0 = _mm256_add_epi64(_mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32)),
                              _mm256_add_epi64(a0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
        a1 = _mm256_add_epi64(_mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32)),
                              _mm256_add_epi64(a1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
        if (s % STRIPES_PER_BLOCK == STRIPES_PER_BLOCK - 1) {
            _mm256_store_si256(acc, a0);
            _mm256_store_si256(acc + 1, a1);
            XXH3_scrambleAcc_avx2(f->acc, XXH3_kSecret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN);
            a0 = _mm256_load_si256(acc);
            a1 = _mm256_load_si256(acc + 1);
        }
    }
    _mm256_store_si256(acc, a0);
    _mm256_store_si256(acc + 1, a1);
    f->stripes_done = s;
    if (n > i * XXH_STRIPE_LEN)
        memcpy(dst + i * XXH_STRIPE_LEN, src + i * XXH_STRIPE_LEN, n - i * XXH_STRIPE_LEN);
    if (stream)
        _mm_sfence();
}

/* The digest once every byte landed: the last stripe read back from the destination's end. */
XXH_TARGET_AVX2 static uint64_t fused_digest(struct fused *f, const unsigned char *end)
{
    XXH3_accumulate_512_avx2(f->acc, end - XXH_STRIPE_LEN,
                             XXH3_kSecret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    return XXH3_mergeAccs(f->acc, XXH3_kSecret + XXH_SECRET_MERGEACCS_START, (xxh_u64)f->len * XXH_PRIME64_1);
}

#endif
