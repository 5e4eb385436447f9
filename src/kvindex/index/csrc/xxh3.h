/* XXH3-64 with a seed (xxHash 0.8's XXH3_64bits_withSeed, written from its specification,
 * doc/xxhash_spec.md), scalar: NVIDIA Dynamo's local block hashes (kvindex/index/localhash.py:
 * XXH3-64 of a block's token ids as u32 little-endian, seeded by its namespace). Checked
 * against the `xxhash` package over every length class and many seeds
 * (tests/test_localhash.py). Little-endian reads: x86 and arm64. */
#ifndef KVCORE_XXH3_H
#define KVCORE_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The specification's default secret (kSecret). */
static const uint8_t XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c,
    0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb,
    0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e,
    0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
    0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb,
    0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97,
    0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7,
    0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
    0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83,
    0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26,
    0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc,
    0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define XXH_P32_1 0x9E3779B1U
#define XXH_P32_2 0x85EBCA77U
#define XXH_P32_3 0xC2B2AE3DU
#define XXH_P64_1 0x9E3779B185EBCA87ULL
#define XXH_P64_2 0xC2B2AE3D27D4EB4FULL
#define XXH_P64_3 0x165667B19E3779F9ULL
#define XXH_P64_4 0x85EBCA77C2B2AE63ULL
#define XXH_P64_5 0x27D4EB2F165667C5ULL
#define XXH_MX1 0x165667919E3779F9ULL
#define XXH_MX2 0x9FB21C651E98DF25ULL

static inline uint64_t xxh_r64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t xxh_r32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t xxh_rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t xxh_fold64(uint64_t a, uint64_t b) {
    __uint128_t m = (__uint128_t)a * b;
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= XXH_P64_2;
    h ^= h >> 29;
    h *= XXH_P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= XXH_MX1;
    return h ^ (h >> 32);
}

static inline uint64_t xxh3_rrmxmx(uint64_t h, uint64_t len) {
    h ^= xxh_rotl64(h, 49) ^ xxh_rotl64(h, 24);
    h *= XXH_MX2;
    h ^= (h >> 35) + len;
    h *= XXH_MX2;
    return h ^ (h >> 28);
}

static inline uint64_t xxh3_mix16(const uint8_t *p, const uint8_t *s, uint64_t seed) {
    return xxh_fold64(xxh_r64(p) ^ (xxh_r64(s) + seed), xxh_r64(p + 8) ^ (xxh_r64(s + 8) - seed));
}

static uint64_t xxh3_0to16(const uint8_t *p, size_t len, const uint8_t *s, uint64_t seed) {
    if (len > 8) {
        uint64_t lo = xxh_r64(p) ^ ((xxh_r64(s + 24) ^ xxh_r64(s + 32)) + seed);
        uint64_t hi = xxh_r64(p + len - 8) ^ ((xxh_r64(s + 40) ^ xxh_r64(s + 48)) - seed);
        uint64_t acc = len + __builtin_bswap64(lo) + hi + xxh_fold64(lo, hi);
        return xxh3_avalanche(acc);
    }
    if (len >= 4) {
        seed ^= (uint64_t)__builtin_bswap32((uint32_t)seed) << 32;
        uint64_t in64 = xxh_r32(p + len - 4) + ((uint64_t)xxh_r32(p) << 32);
        uint64_t bitflip = (xxh_r64(s + 8) ^ xxh_r64(s + 16)) - seed;
        return xxh3_rrmxmx(in64 ^ bitflip, len);
    }
    if (len > 0) {
        uint32_t combined = ((uint32_t)p[0] << 16) | ((uint32_t)p[len >> 1] << 24) |
                            (uint32_t)p[len - 1] | ((uint32_t)len << 8);
        uint64_t bitflip = (xxh_r32(s) ^ xxh_r32(s + 4)) + seed;
        return xxh64_avalanche((uint64_t)combined ^ bitflip);
    }
    return xxh64_avalanche(seed ^ (xxh_r64(s + 56) ^ xxh_r64(s + 64)));
}

static uint64_t xxh3_17to128(const uint8_t *p, size_t len, const uint8_t *s, uint64_t seed) {
    uint64_t acc = len * XXH_P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += xxh3_mix16(p + 48, s + 96, seed);
                acc += xxh3_mix16(p + len - 64, s + 112, seed);
            }
            acc += xxh3_mix16(p + 32, s + 64, seed);
            acc += xxh3_mix16(p + len - 48, s + 80, seed);
        }
        acc += xxh3_mix16(p + 16, s + 32, seed);
        acc += xxh3_mix16(p + len - 32, s + 48, seed);
    }
    acc += xxh3_mix16(p, s, seed);
    acc += xxh3_mix16(p + len - 16, s + 16, seed);
    return xxh3_avalanche(acc);
}

static uint64_t xxh3_129to240(const uint8_t *p, size_t len, const uint8_t *s, uint64_t seed) {
    uint64_t acc = len * XXH_P64_1;
    size_t rounds = len / 16;
    for (size_t i = 0; i < 8; i++)
        acc += xxh3_mix16(p + 16 * i, s + 16 * i, seed);
    acc = xxh3_avalanche(acc);
    for (size_t i = 8; i < rounds; i++)
        acc += xxh3_mix16(p + 16 * i, s + 16 * (i - 8) + 3, seed);
    acc += xxh3_mix16(p + len - 16, s + 136 - 17, seed);
    return xxh3_avalanche(acc);
}

static inline void xxh3_accumulate512(uint64_t *acc, const uint8_t *p, const uint8_t *s) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = xxh_r64(p + 8 * i);
        uint64_t k = v ^ xxh_r64(s + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (uint64_t)(uint32_t)k * (k >> 32);
    }
}

static uint64_t xxh3_long(const uint8_t *p, size_t len, uint64_t seed) {
    uint8_t s[192];
    for (int i = 0; i < 192; i += 16) {
        uint64_t lo = xxh_r64(XXH3_SECRET + i) + seed, hi = xxh_r64(XXH3_SECRET + i + 8) - seed;
        memcpy(s + i, &lo, 8);
        memcpy(s + i + 8, &hi, 8);
    }
    uint64_t acc[8] = {XXH_P32_3, XXH_P64_1, XXH_P64_2, XXH_P64_3,
                       XXH_P64_4, XXH_P32_2, XXH_P64_5, XXH_P32_1};
    const size_t stripes_per_block = (192 - 64) / 8, block_len = 64 * stripes_per_block;
    size_t blocks = (len - 1) / block_len;
    for (size_t n = 0; n < blocks; n++) {
        for (size_t k = 0; k < stripes_per_block; k++)
            xxh3_accumulate512(acc, p + n * block_len + k * 64, s + k * 8);
        for (int i = 0; i < 8; i++) { /* scramble */
            uint64_t a = acc[i];
            a ^= a >> 47;
            a ^= xxh_r64(s + 192 - 64 + 8 * i);
            acc[i] = a * XXH_P32_1;
        }
    }
    size_t stripes = ((len - 1) - block_len * blocks) / 64;
    for (size_t k = 0; k < stripes; k++)
        xxh3_accumulate512(acc, p + blocks * block_len + k * 64, s + k * 8);
    xxh3_accumulate512(acc, p + len - 64, s + 192 - 64 - 7);
    uint64_t result = len * XXH_P64_1;
    for (int i = 0; i < 4; i++)
        result += xxh_fold64(acc[2 * i] ^ xxh_r64(s + 11 + 16 * i),
                             acc[2 * i + 1] ^ xxh_r64(s + 11 + 16 * i + 8));
    return xxh3_avalanche(result);
}

/* XXH3_64bits_withSeed(p, len, seed). */
static inline uint64_t xxh3_64(const uint8_t *p, size_t len, uint64_t seed) {
    if (len <= 16)
        return xxh3_0to16(p, len, XXH3_SECRET, seed);
    if (len <= 128)
        return xxh3_17to128(p, len, XXH3_SECRET, seed);
    if (len <= 240)
        return xxh3_129to240(p, len, XXH3_SECRET, seed);
    return xxh3_long(p, len, seed);
}

#endif
