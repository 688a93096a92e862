/* bf16 <-> fp32 by their bits: a bf16 is an fp32's upper half, rounded to nearest, ties to even,
 * as torch rounds. Integer operations, so -ffast-math cannot merge a rounding into the arithmetic
 * around it. (No NaN handling: the values these kernels round are finite.) Shared by the kernels
 * that read or write bf16 one value at a time; kernels/cpu/__init__.py's build hashes the headers
 * a source includes with it. */
#ifndef PAGEDSERVE_BF16_BITS_H
#define PAGEDSERVE_BF16_BITS_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#endif
