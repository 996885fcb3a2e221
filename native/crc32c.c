/* crc32c.c: CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the extent checksum.
 *
 * Four implementations with one result:
 *   crc32c_bitwise   the readable reference (one bit at a time), used to build the tables;
 *   crc32c_table     slicing-by-8, any CPU;
 *   crc32c_sse42     the SSE4.2 crc32 instruction on three interleaved streams;
 *   crc32c_fold      carry-less multiplication (AVX-512 VPCLMULQDQ) folding 256 bytes a step,
 *                    several times fewer cycles per byte than crc32c_sse42 (it runs on the I/O
 *                    workers, on the cores the training computes on: its cycles are the cost).
 * offload_crc32c() picks the fastest path the CPU has at run time.
 *
 * The hardware path: the crc32 instruction has a latency of 3 cycles and a throughput of 1,
 * so one stream runs at a third of the possible rate. A block of 3*LANE bytes is split into
 * three lanes A|B|C that are crc'd independently (crc0 continues the running crc over A,
 * crc1 and crc2 start at 0 over B and C), then joined with the linearity of the CRC:
 *   crc(A|B|C) = shift(crc0, 2*LANE) ^ shift(crc1, LANE) ^ crc2
 * where shift(c, n) = c * x^(8n) mod P, a linear map of c done with four 256-entry tables.
 */
#include "offload_native.h"

#include <pthread.h>
#include <string.h>

#define POLY 0x82F63B78u
#define LANE 8192

static uint32_t table[8][256];              /* slicing-by-8 */
static uint32_t shift_lane[4][256];         /* c -> c * x^(8*LANE) mod P, byte by byte */
static uint32_t shift_2lane[4][256];        /* c -> c * x^(16*LANE) mod P */
/* Fold constants of crc32c_fold for a distance of d bits: {x^(d+31) mod P, x^(d-33) mod P}. */
static uint64_t fold_128[2], fold_512[2], fold_2048[2];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static uint32_t crc32c_bitwise(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (POLY & (0u - (crc & 1)));
    }
    return ~crc;
}

/* a * b mod P over GF(2), both in reflected bit order (bit 31 is x^0). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(8n) mod P, reflected. */
static uint32_t xpow8n(uint64_t n) {
    uint32_t result = 1u << 31, sq = 1u << 30; /* x^0, x^1 */
    n *= 8;
    while (n) {
        if (n & 1) result = multmodp(sq, result);
        sq = multmodp(sq, sq);
        n >>= 1;
    }
    return result;
}

/* x^n mod P, reflected (n in bits). */
static uint32_t xpown(uint64_t n) {
    uint32_t result = 1u << 31, sq = 1u << 30;
    while (n) {
        if (n & 1) result = multmodp(sq, result);
        sq = multmodp(sq, sq);
        n >>= 1;
    }
    return result;
}

static void build_shift(uint32_t t[4][256], uint64_t nbytes) {
    uint32_t k = xpow8n(nbytes);
    for (int j = 0; j < 4; j++)
        for (uint32_t b = 0; b < 256; b++) t[j][b] = multmodp(k, b << (8 * j));
}

static void build_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        unsigned char byte = (unsigned char)b;
        table[0][b] = ~crc32c_bitwise(~0u, &byte, 1);  /* raw update of a zero crc by one byte */
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int j = 1; j < 8; j++) table[j][b] = (table[j - 1][b] >> 8) ^ table[0][table[j - 1][b] & 0xff];
    build_shift(shift_lane, LANE);
    build_shift(shift_2lane, 2 * LANE);
    uint64_t *folds[3] = {fold_128, fold_512, fold_2048};
    uint64_t dist[3] = {128, 512, 2048};
    for (int i = 0; i < 3; i++) {
        folds[i][0] = xpown(dist[i] + 31);
        folds[i][1] = xpown(dist[i] - 33);
    }
}

static inline uint32_t shift(uint32_t t[4][256], uint32_t c) {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

OFFLOAD_API uint32_t offload_crc32c_table(uint32_t crc, const void *buf, size_t n) {
    pthread_once(&tables_once, build_tables);
    const unsigned char *p = buf;
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) { crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff]; n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);  /* little-endian load */
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
              table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
              table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
    return ~crc;
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const void *buf, size_t n) {
    const unsigned char *p = buf;
    uint64_t c0 = ~crc;
    while (n && ((uintptr_t)p & 7)) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    while (n >= 3 * LANE) {
        uint64_t c1 = 0, c2 = 0;
        const uint64_t *a = (const uint64_t *)p, *b = (const uint64_t *)(p + LANE),
                       *c = (const uint64_t *)(p + 2 * LANE);
        for (size_t i = 0; i < LANE / 8; i++) {
            c0 = _mm_crc32_u64(c0, a[i]);
            c1 = _mm_crc32_u64(c1, b[i]);
            c2 = _mm_crc32_u64(c2, c[i]);
        }
        c0 = shift(shift_2lane, (uint32_t)c0) ^ shift(shift_lane, (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    while (n >= 8) { c0 = _mm_crc32_u64(c0, *(const uint64_t *)p); p += 8; n -= 8; }
    while (n--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return ~(uint32_t)c0;
}

/* Folding (the method of Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ",
 * in the reflected bit order, constants from xpown() above).
 *
 * A 128-bit lane holds a polynomial A of degree < 128 in reflected order: its low 64 bits
 * (the first 8 bytes of the stream) are the high half A_hi, bit i of a half the coefficient
 * of x^(63-i). A carry-less product of a half with a 32-bit constant k (bit j: x^(31-j))
 * lands in the lane as a * k * x^33. To move A forward by d bits (A * x^d, congruent mod P)
 * it is replaced by  clmul(A_hi, x^(d+31) mod P) ^ clmul(A_lo, x^(d-33) mod P),  a
 * polynomial of degree < 96, and XORed into the data d bits further on. Four 512-bit
 * accumulators fold over 2048 bits; at the end they fold into one 128-bit lane C, whose crc
 * (the crc32 instruction over its 16 bytes from 0) is C * x^32 mod P: the crc of everything
 * folded, after which the remaining bytes continue with the crc32 instruction. The running
 * crc enters by XOR into the first 4 bytes (crc32 from state s over D equals crc32 from 0
 * over D with s XORed into its first 4 bytes). */
__attribute__((target("sse4.2,pclmul"))) static inline __m128i fold16(__m128i a, const uint64_t k[2]) {
    __m128i kk = _mm_set_epi64x((long long)k[1], (long long)k[0]);
    return _mm_xor_si128(_mm_clmulepi64_si128(a, kk, 0x00), _mm_clmulepi64_si128(a, kk, 0x11));
}

__attribute__((target("avx512f,vpclmulqdq"))) static inline __m512i fold64(__m512i a, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11),
                                     next, 0x96);
}

__attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq"))) static uint32_t crc32c_fold(uint32_t crc, const void *buf,
                                                                                         size_t n) {
    const unsigned char *p = buf;
    uint64_t c0 = ~crc;
    if (n < 256) return crc32c_sse42(crc, buf, n);
    __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128),
            x3 = _mm512_loadu_si512(p + 192);
    x0 = _mm512_xor_si512(x0, _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)(uint32_t)c0), 0));
    p += 256;
    n -= 256;
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_2048[1], (long long)fold_2048[0]));
    while (n >= 256) {
        x0 = fold64(x0, k2048, _mm512_loadu_si512(p));
        x1 = fold64(x1, k2048, _mm512_loadu_si512(p + 64));
        x2 = fold64(x2, k2048, _mm512_loadu_si512(p + 128));
        x3 = fold64(x3, k2048, _mm512_loadu_si512(p + 192));
        p += 256;
        n -= 256;
    }
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_512[1], (long long)fold_512[0]));
    x1 = fold64(x0, k512, x1);
    x2 = fold64(x1, k512, x2);
    x3 = fold64(x2, k512, x3);
    __m128i a = _mm512_extracti32x4_epi32(x3, 0);
    a = _mm_xor_si128(fold16(a, fold_128), _mm512_extracti32x4_epi32(x3, 1));
    a = _mm_xor_si128(fold16(a, fold_128), _mm512_extracti32x4_epi32(x3, 2));
    a = _mm_xor_si128(fold16(a, fold_128), _mm512_extracti32x4_epi32(x3, 3));
    while (n >= 16) {
        a = _mm_xor_si128(fold16(a, fold_128), _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    c0 = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    c0 = _mm_crc32_u64(c0, (uint64_t)_mm_extract_epi64(a, 1));
    return crc32c_sse42(~(uint32_t)c0, p, n);
}

static int have_fold(void) {
    static int cached = -1;
    if (cached < 0)
        cached = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") &&
                 __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
    return cached;
}

static int have_sse42(void) {
    static int cached = -1;
    if (cached < 0) cached = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    return cached;
}
#endif

OFFLOAD_API int offload_crc32c_hw(void) {
#if defined(__x86_64__)
    return have_fold() ? 2 : have_sse42();
#else
    return 0;
#endif
}

OFFLOAD_API uint32_t offload_crc32c(uint32_t crc, const void *buf, size_t n) {
    pthread_once(&tables_once, build_tables);
#if defined(__x86_64__)
    if (have_fold()) return crc32c_fold(crc, buf, n);
    if (have_sse42()) return crc32c_sse42(crc, buf, n);
#endif
    return offload_crc32c_table(crc, buf, n);
}

/* The SSE4.2 path alone (0 when the CPU lacks it), for parity tests of the paths. */
OFFLOAD_API uint32_t offload_crc32c_sse42(uint32_t crc, const void *buf, size_t n) {
    pthread_once(&tables_once, build_tables);
#if defined(__x86_64__)
    if (have_sse42()) return crc32c_sse42(crc, buf, n);
#endif
    return offload_crc32c_table(crc, buf, n);
}
