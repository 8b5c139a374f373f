/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every L3 blob: the same
 * values as the `crc32c` package the Python read path uses (crc32c(data, value)).
 *
 * Why our own: the native read engine (read_pages.c) checksums each chunk right after it lands, while
 * the chunk is still in the core's cache, and copies it out in the same pass; a checksum library
 * behind Python calls cannot sit inside that loop.
 *
 * Speed: the SSE4.2 crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle, so
 * one dependency chain runs at a third of what the unit can do. Three chains over three adjacent
 * blocks run in parallel and are joined with "shift" operators: for a block B of L bytes,
 * raw(s, A||B) = raw(raw(s, A), 0^L) ^ raw(0, B), since the register update is linear over GF(2), and
 * raw(x, 0^L) is a fixed 32x32 bit matrix applied to x, kept as four 256-entry tables (one per byte
 * of x). The tables are derived at first use from the update itself (the image of each basis bit
 * after L zero bytes), so there are no magic constants to get wrong.
 * Without SSE4.2 (other CPUs) a slicing-by-8 table loop gives the same values, slower. */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpl3_native.h"

#define POLY 0x82F63B78u
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256

static uint32_t sw_table[8][256];
static uint32_t shift_long[4][256], shift_short[4][256];
static int have_hw;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int force_software;  /* tests: exercise the fallback on a machine that has the instruction */

static uint32_t raw_sw(uint32_t s, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { s = sw_table[0][(s ^ *p++) & 0xff] ^ (s >> 8); n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= s;
        s = sw_table[7][w & 0xff] ^ sw_table[6][(w >> 8) & 0xff] ^ sw_table[5][(w >> 16) & 0xff] ^
            sw_table[4][(w >> 24) & 0xff] ^ sw_table[3][(w >> 32) & 0xff] ^ sw_table[2][(w >> 40) & 0xff] ^
            sw_table[1][(w >> 48) & 0xff] ^ sw_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) s = sw_table[0][(s ^ *p++) & 0xff] ^ (s >> 8);
    return s;
}

static inline uint32_t shift(uint32_t tab[4][256], uint32_t s) {
    return tab[0][s & 0xff] ^ tab[1][(s >> 8) & 0xff] ^ tab[2][(s >> 16) & 0xff] ^ tab[3][s >> 24];
}

/* tab[k][b] = raw(b << 8k, 0^len), from the images of the 32 basis bits. */
static void build_shift(uint32_t tab[4][256], size_t len) {
    static const uint8_t zeros[LONG_BLOCK];
    uint32_t col[32];
    for (int i = 0; i < 32; i++) col[i] = raw_sw(1u << i, zeros, len);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int j = 0; j < 8; j++)
                if (b & (1 << j)) v ^= col[8 * k + j];
            tab[k][b] = v;
        }
}

static void init(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t s = b;
        for (int j = 0; j < 8; j++) s = (s >> 1) ^ (POLY & (0u - (s & 1)));
        sw_table[0][b] = s;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++)
            sw_table[k][b] = (sw_table[k - 1][b] >> 8) ^ sw_table[0][sw_table[k - 1][b] & 0xff];
    build_shift(shift_long, LONG_BLOCK);
    build_shift(shift_short, SHORT_BLOCK);
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_hw = __builtin_cpu_supports("sse4.2");
#endif
}

#if defined(__x86_64__)
#include <nmmintrin.h>

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Three chains over blocks of `len` bytes at p, p + len, p + 2 len; returns the state after all three. */
__attribute__((target("sse4.2"))) static inline uint32_t three_way(uint32_t s, const uint8_t *p, size_t len,
                                                                     uint32_t tab[4][256]) {
    uint64_t c0 = s, c1 = 0, c2 = 0;
    for (size_t i = 0; i < len; i += 8) {
        c0 = _mm_crc32_u64(c0, load64(p + i));
        c1 = _mm_crc32_u64(c1, load64(p + len + i));
        c2 = _mm_crc32_u64(c2, load64(p + 2 * len + i));
    }
    uint32_t r = shift(tab, (uint32_t)c0) ^ (uint32_t)c1;
    return shift(tab, r) ^ (uint32_t)c2;
}

__attribute__((target("sse4.2"))) static uint32_t raw_hw(uint32_t s, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { s = _mm_crc32_u8(s, *p++); n--; }
    while (n >= 3 * LONG_BLOCK) { s = three_way(s, p, LONG_BLOCK, shift_long); p += 3 * LONG_BLOCK; n -= 3 * LONG_BLOCK; }
    while (n >= 3 * SHORT_BLOCK) { s = three_way(s, p, SHORT_BLOCK, shift_short); p += 3 * SHORT_BLOCK; n -= 3 * SHORT_BLOCK; }
    uint64_t c = s;
    while (n >= 8) { c = _mm_crc32_u64(c, load64(p)); p += 8; n -= 8; }
    s = (uint32_t)c;
    while (n--) s = _mm_crc32_u8(s, *p++);
    return s;
}
#endif

uint32_t cpl3_crc32c_raw(uint32_t state, const void *buf, size_t n) {
    pthread_once(&init_once, init);
#if defined(__x86_64__)
    if (have_hw && !force_software) return raw_hw(state, (const uint8_t *)buf, n);
#endif
    return raw_sw(state, (const uint8_t *)buf, n);
}

uint32_t cpl3_crc32c(uint32_t value, const void *buf, size_t n) {
    return ~cpl3_crc32c_raw(~value, buf, n);
}

/* 1 when the hardware path serves cpl3_crc32c, 0 for the table loop. `software` = 1 forces the table
 * loop from now on (tests), 0 restores the default; -1 only asks. */
int cpl3_crc32c_hardware(int software) {
    pthread_once(&init_once, init);
    if (software >= 0) force_software = software;
    return have_hw && !force_software;
}
