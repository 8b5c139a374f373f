/* Shared declarations of the L3 store's native library (built by the package build into
 * sglang_cp/l3/_native, loaded with ctypes by sglang_cp/l3/native.py). */
#ifndef CPL3_NATIVE_H
#define CPL3_NATIVE_H
#include <stddef.h>
#include <stdint.h>

uint32_t cpl3_crc32c_raw(uint32_t state, const void *buf, size_t n);
uint32_t cpl3_crc32c(uint32_t value, const void *buf, size_t n);

#endif
