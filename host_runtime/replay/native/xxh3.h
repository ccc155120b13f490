/* XXH3_64bits (seed 0, the default secret): the hash libCacheSim gives a csv object id that is not a number
 * (get_hash_value_str, HASH_TYPE XXHASH3). Written from the XXH3 algorithm as xxHash specifies it;
 * tests/host_runtime/test_native_reader.py checks it against the xxhash package on every length to 2 KiB. */
#ifndef TR_XXH3_H
#define TR_XXH3_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static const unsigned char XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
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

static inline uint64_t xxh_r64(const unsigned char *p) { /* little-endian, as xxHash reads */
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static inline uint32_t xxh_r32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t xxh_rotl64(uint64_t x, int r) { return x << r | x >> (64 - r); }

static inline uint64_t xxh_swap64(uint64_t x) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | ((x >> (8 * i)) & 0xff);
    return v;
}

static inline uint64_t xxh_fold(uint64_t a, uint64_t b) { /* the 128-bit product's halves, xor-ed */
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
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

static inline uint64_t xxh3_mix16(const unsigned char *in, const unsigned char *secret) {
    return xxh_fold(xxh_r64(in) ^ xxh_r64(secret), xxh_r64(in + 8) ^ xxh_r64(secret + 8));
}

static inline void xxh3_stripe(uint64_t acc[8], const unsigned char *in, const unsigned char *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t data = xxh_r64(in + 8 * i), key = data ^ xxh_r64(secret + 8 * i);
        acc[i ^ 1] += data;
        acc[i] += (key & 0xffffffffULL) * (key >> 32);
    }
}

static uint64_t xxh3_long(const unsigned char *in, size_t len) {
    const unsigned char *secret = XXH3_SECRET;
    const size_t secret_size = sizeof XXH3_SECRET, stripes_per_block = (secret_size - 64) / 8,
                 block = 64 * stripes_per_block, blocks = (len - 1) / block;
    uint64_t acc[8] = {XXH_P32_3, XXH_P64_1, XXH_P64_2, XXH_P64_3, XXH_P64_4, XXH_P32_2, XXH_P64_5, XXH_P32_1};
    for (size_t b = 0; b < blocks; b++) {
        for (size_t s = 0; s < stripes_per_block; s++) xxh3_stripe(acc, in + b * block + 64 * s, secret + 8 * s);
        for (int i = 0; i < 8; i++) { /* scramble */
            uint64_t a = acc[i];
            a ^= a >> 47;
            a ^= xxh_r64(secret + secret_size - 64 + 8 * i);
            acc[i] = a * XXH_P32_1;
        }
    }
    size_t stripes = ((len - 1) - block * blocks) / 64;
    for (size_t s = 0; s < stripes; s++) xxh3_stripe(acc, in + blocks * block + 64 * s, secret + 8 * s);
    xxh3_stripe(acc, in + len - 64, secret + secret_size - 64 - 7);
    uint64_t h = (uint64_t)len * XXH_P64_1;
    for (int i = 0; i < 4; i++)
        h += xxh_fold(acc[2 * i] ^ xxh_r64(secret + 11 + 16 * i), acc[2 * i + 1] ^ xxh_r64(secret + 11 + 16 * i + 8));
    return xxh3_avalanche(h);
}

static inline uint64_t xxh3_64(const void *data, size_t len) {
    const unsigned char *in = data, *secret = XXH3_SECRET;
    if (len == 0) return xxh64_avalanche(xxh_r64(secret + 56) ^ xxh_r64(secret + 64));
    if (len <= 3) {
        uint32_t combined = (uint32_t)in[0] << 16 | (uint32_t)in[len >> 1] << 24 | (uint32_t)in[len - 1] |
                            (uint32_t)len << 8;
        return xxh64_avalanche((uint64_t)combined ^ (uint64_t)(xxh_r32(secret) ^ xxh_r32(secret + 4)));
    }
    if (len <= 8) {
        uint64_t x = ((uint64_t)xxh_r32(in + len - 4) + ((uint64_t)xxh_r32(in) << 32)) ^
                     (xxh_r64(secret + 8) ^ xxh_r64(secret + 16));
        x ^= xxh_rotl64(x, 49) ^ xxh_rotl64(x, 24);
        x *= XXH_MX2;
        x ^= (x >> 35) + len;
        x *= XXH_MX2;
        return x ^ (x >> 28);
    }
    if (len <= 16) {
        uint64_t lo = xxh_r64(in) ^ (xxh_r64(secret + 24) ^ xxh_r64(secret + 32));
        uint64_t hi = xxh_r64(in + len - 8) ^ (xxh_r64(secret + 40) ^ xxh_r64(secret + 48));
        return xxh3_avalanche(len + xxh_swap64(lo) + hi + xxh_fold(lo, hi));
    }
    uint64_t acc = (uint64_t)len * XXH_P64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) acc += xxh3_mix16(in + 48, secret + 96) + xxh3_mix16(in + len - 64, secret + 112);
                acc += xxh3_mix16(in + 32, secret + 64) + xxh3_mix16(in + len - 48, secret + 80);
            }
            acc += xxh3_mix16(in + 16, secret + 32) + xxh3_mix16(in + len - 32, secret + 48);
        }
        acc += xxh3_mix16(in, secret) + xxh3_mix16(in + len - 16, secret + 16);
        return xxh3_avalanche(acc);
    }
    if (len <= 240) {
        for (size_t i = 0; i < 8; i++) acc += xxh3_mix16(in + 16 * i, secret + 16 * i);
        acc = xxh3_avalanche(acc);
        for (size_t i = 8; i < len / 16; i++) acc += xxh3_mix16(in + 16 * i, secret + 16 * (i - 8) + 3);
        acc += xxh3_mix16(in + len - 16, secret + 136 - 17);
        return xxh3_avalanche(acc);
    }
    return xxh3_long(in, len);
}

#endif
