/* Key digests of the L3 hit query, many keys per call: blake2b-128 of (prefix || key), personalized,
 * exactly what hashlib.blake2b(prefix + key, digest_size=16, person=person).digest() gives (RFC 7693).
 * Part of the store's native library (built by the package build, setup.py), used when
 * index.digest_threads > 0 (sglang_cp/l3/native/digests.py) and called through ctypes, which releases
 * the GIL: the caller splits a big query over threads. Plain C, no Python headers. */
#include <stdint.h>
#include <string.h>
#include <stddef.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

typedef struct { uint64_t h[8]; uint64_t t; size_t n; uint8_t buf[128]; } state;

static inline uint64_t rotr(uint64_t x, int r) { return (x >> r) | (x << (64 - r)); }
static inline uint64_t le64(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
}

#define G(a, b, c, d, x, y)                         \
    do {                                            \
        v[a] += v[b] + (x); v[d] = rotr(v[d] ^ v[a], 32); \
        v[c] += v[d];       v[b] = rotr(v[b] ^ v[c], 24); \
        v[a] += v[b] + (y); v[d] = rotr(v[d] ^ v[a], 16); \
        v[c] += v[d];       v[b] = rotr(v[b] ^ v[c], 63); \
    } while (0)

static void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = le64(block + 8 * i);
    for (int i = 0; i < 8; i++) { v[i] = h[i]; v[i + 8] = IV[i]; }
    v[12] ^= t;  /* the counter's high word (v[13]) stays as is: a key is far below 2^64 bytes */
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

static void update(state *S, const uint8_t *in, size_t len) {
    while (len > 0) {
        if (S->n == 128) {  /* a full block is compressed only once more input follows it */
            S->t += 128;
            compress(S->h, S->buf, S->t, 0);
            S->n = 0;
        }
        size_t take = 128 - S->n < len ? 128 - S->n : len;
        memcpy(S->buf + S->n, in, take);
        S->n += take; in += take; len -= take;
    }
}

static void final16(state *S, uint8_t out[16]) {
    S->t += S->n;
    memset(S->buf + S->n, 0, 128 - S->n);
    compress(S->h, S->buf, S->t, 1);
    for (int i = 0; i < 16; i++) out[i] = (uint8_t)(S->h[i / 8] >> (8 * (i % 8)));
}

static void seed_state(state *S, const uint8_t person[16], const uint8_t *prefix, size_t prefix_len) {
    for (int i = 0; i < 8; i++) S->h[i] = IV[i];
    S->h[0] ^= 0x01010000ULL ^ 16;  /* digest length 16, no key, fanout 1, depth 1 */
    S->h[6] ^= le64(person);
    S->h[7] ^= le64(person + 8);
    S->t = 0;
    S->n = 0;
    update(S, prefix, prefix_len);
}

/* Keys given by their end offsets in data (ends[i-1] .. ends[i], ends[-1] = 0): out[16 i ..] is the
 * digest of key i. Returns 0, or -1 for offsets that go backwards or past data_len. */
int cpl3_digests_ends(const uint8_t person[16], const uint8_t *prefix, size_t prefix_len,
                      const uint8_t *data, size_t data_len, const int64_t *ends, size_t n, uint8_t *out) {
    state seed;
    seed_state(&seed, person, prefix, prefix_len);
    int64_t start = 0;
    for (size_t i = 0; i < n; i++) {
        if (ends[i] < start || (uint64_t)ends[i] > data_len) return -1;
        state S = seed;
        update(&S, data + start, (size_t)(ends[i] - start));
        final16(&S, out + 16 * i);
        start = ends[i];
    }
    return 0;
}

/* Keys joined by one NUL byte each (n keys, n - 1 separators): no offsets to build. Returns 0, or -1
 * when data does not split into exactly n keys (a key holding a NUL: use cpl3_digests_ends). */
int cpl3_digests_sep(const uint8_t person[16], const uint8_t *prefix, size_t prefix_len,
                     const uint8_t *data, size_t data_len, size_t n, uint8_t *out) {
    state seed;
    seed_state(&seed, person, prefix, prefix_len);
    const uint8_t *p = data, *end = data + data_len;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *q = memchr(p, 0, (size_t)(end - p));
        if (q == NULL) {
            if (i != n - 1) return -1;
            q = end;
        } else if (i == n - 1) {
            return -1;
        }
        state S = seed;
        update(&S, p, (size_t)(q - p));
        final16(&S, out + 16 * i);
        p = q + 1;
    }
    return 0;
}
