/* The hit query's batch lookup in HeldDigests' open-addressing table (sglang_cp/l3/held.py), called
 * while the caller keeps the GIL.
 *
 * Why C: the numpy form issues ~15 array operations per probe round, and numpy releases the GIL for each
 * one over 500 elements; beside a busy scheduler thread each release waits up to CPython's 5 ms switch
 * interval (16,384 keys: 6.6 ms alone, 258 ms beside a busy thread). Holding the GIL also means the
 * table's one writer (a Python thread) cannot store into it during the call. */
#include <string.h>

#include "cpl3_native.h"

#define HELD_VAL 0xFFFFull
#define HELD_TOMB 0x8000ull

/* digests: n 16-byte digests back to back (two little-endian words a, b each). Per digest, linear probing
 * from slot b & m over at most max_probes slots: a slot whose key bits (w & ~HELD_VAL) equal a's is the
 * digest's, its value w & HELD_VAL (a tomb reads 0); an empty slot (value 0) ends the chain: 0.
 * out[i] = that value, or UINT64_MAX when the chain went past max_probes (the caller asks its dict).
 * *full = how many answered values hold every bit of mask. Returns the number past max_probes. */
int64_t cpl3_held_probe(const uint64_t *tab, uint64_t m, const uint8_t *digests, uint64_t n, uint32_t max_probes,
                        uint64_t mask, uint64_t *out, uint64_t *full) {
    int64_t unresolved = 0;
    uint64_t count = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t a, b;
        memcpy(&a, digests + 16 * i, 8);
        memcpy(&b, digests + 16 * i + 8, 8);
        a &= ~HELD_VAL;
        uint64_t pos = b & m, v = 0;
        uint32_t k = 0;
        for (; k < max_probes; k++) {
            uint64_t w = tab[pos];
            uint64_t val = w & HELD_VAL;
            if (val == 0)
                break;
            if ((w & ~HELD_VAL) == a) {
                v = val & (HELD_TOMB - 1);
                break;
            }
            pos = (pos + 1) & m;
        }
        if (k == max_probes) {
            out[i] = UINT64_MAX;
            unresolved++;
            continue;
        }
        out[i] = v;
        count += (v & mask) == mask;
    }
    *full = count;
    return unresolved;
}
