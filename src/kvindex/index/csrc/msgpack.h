/* A bounds-checked msgpack reader: just what vLLM's and SGLang's event batches use.
 *
 * Every read checks the bytes left first and fails (returns 0) rather than reading past
 * the end, so any input, however hostile, is either read or refused; the caller then
 * hands the batch to the Python decoder, which decides what it means. Reads never
 * allocate.
 */
#ifndef KVCORE_MSGPACK_H
#define KVCORE_MSGPACK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} mp_reader;

enum mp_int_kind { MP_UINT = 0, MP_NEGATIVE = 1 };

#define MP_MAX_DEPTH 64

static inline int mp_left(const mp_reader *r, size_t n) { return (size_t)(r->end - r->p) >= n; }

static inline uint16_t mp_be16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t mp_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t mp_be64(const uint8_t *p) {
    return ((uint64_t)mp_be32(p) << 32) | mp_be32(p + 4);
}

static inline int mp_peek(const mp_reader *r, uint8_t *byte) {
    if (!mp_left(r, 1))
        return 0;
    *byte = r->p[0];
    return 1;
}

static inline int mp_is_nil(const mp_reader *r) { return r->p < r->end && r->p[0] == 0xc0; }

static inline int mp_nil(mp_reader *r) {
    if (!mp_is_nil(r))
        return 0;
    r->p++;
    return 1;
}

/* An integer: non-negative ones as MP_UINT with their value, negative ones as
 * MP_NEGATIVE with their two's complement bits. msgpack allows any width for any value. */
static inline int mp_int(mp_reader *r, int *kind, uint64_t *value) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return 0;
    if (t <= 0x7f) {
        *kind = MP_UINT, *value = t, r->p += 1;
        return 1;
    }
    if (t >= 0xe0) {
        *kind = MP_NEGATIVE, *value = (uint64_t)(int64_t)(int8_t)t, r->p += 1;
        return 1;
    }
    const uint8_t *p = r->p + 1;
    uint64_t v;
    int64_t s;
    switch (t) {
    case 0xcc: if (!mp_left(r, 2)) return 0; v = p[0]; r->p += 2; break;
    case 0xcd: if (!mp_left(r, 3)) return 0; v = mp_be16(p); r->p += 3; break;
    case 0xce: if (!mp_left(r, 5)) return 0; v = mp_be32(p); r->p += 5; break;
    case 0xcf: if (!mp_left(r, 9)) return 0; v = mp_be64(p); r->p += 9; break;
    case 0xd0: if (!mp_left(r, 2)) return 0; s = (int8_t)p[0]; r->p += 2; goto sign;
    case 0xd1: if (!mp_left(r, 3)) return 0; s = (int16_t)mp_be16(p); r->p += 3; goto sign;
    case 0xd2: if (!mp_left(r, 5)) return 0; s = (int32_t)mp_be32(p); r->p += 5; goto sign;
    case 0xd3: if (!mp_left(r, 9)) return 0; s = (int64_t)mp_be64(p); r->p += 9; goto sign;
    default: return 0;
    }
    *kind = MP_UINT, *value = v;
    return 1;
sign:
    *kind = s < 0 ? MP_NEGATIVE : MP_UINT, *value = (uint64_t)s;
    return 1;
}

/* A float64, float32 or integer (msgspec takes an int where a float is declared). */
static inline int mp_float(mp_reader *r, double *out) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return 0;
    if (t == 0xcb) {
        if (!mp_left(r, 9))
            return 0;
        uint64_t bits = mp_be64(r->p + 1);
        memcpy(out, &bits, 8);
        r->p += 9;
        return 1;
    }
    if (t == 0xca) {
        if (!mp_left(r, 5))
            return 0;
        uint32_t bits = mp_be32(r->p + 1);
        float f;
        memcpy(&f, &bits, 4);
        *out = f;
        r->p += 5;
        return 1;
    }
    int kind;
    uint64_t v;
    if (!mp_int(r, &kind, &v))
        return 0;
    *out = kind == MP_UINT ? (double)v : (double)(int64_t)v;
    return 1;
}

static inline int mp_array(mp_reader *r, uint32_t *n) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return 0;
    if ((t & 0xf0) == 0x90) {
        *n = t & 0x0f, r->p += 1;
        return 1;
    }
    if (t == 0xdc && mp_left(r, 3)) {
        *n = mp_be16(r->p + 1), r->p += 3;
        return 1;
    }
    if (t == 0xdd && mp_left(r, 5)) {
        *n = mp_be32(r->p + 1), r->p += 5;
        return 1;
    }
    return 0;
}

static inline int mp_map(mp_reader *r, uint32_t *n) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return 0;
    if ((t & 0xf0) == 0x80) {
        *n = t & 0x0f, r->p += 1;
        return 1;
    }
    if (t == 0xde && mp_left(r, 3)) {
        *n = mp_be16(r->p + 1), r->p += 3;
        return 1;
    }
    if (t == 0xdf && mp_left(r, 5)) {
        *n = mp_be32(r->p + 1), r->p += 5;
        return 1;
    }
    return 0;
}

static inline int mp_span(mp_reader *r, size_t header, size_t len, const uint8_t **data,
                          uint32_t *n) {
    if (!mp_left(r, header) || (size_t)(r->end - r->p) - header < len)
        return 0;
    *data = r->p + header;
    *n = (uint32_t)len;
    r->p += header + len;
    return 1;
}

/* A str's bytes (not checked as UTF-8: see mp_utf8). */
static inline int mp_str(mp_reader *r, const uint8_t **data, uint32_t *n) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return 0;
    if ((t & 0xe0) == 0xa0)
        return mp_span(r, 1, t & 0x1f, data, n);
    if (t == 0xd9 && mp_left(r, 2))
        return mp_span(r, 2, r->p[1], data, n);
    if (t == 0xda && mp_left(r, 3))
        return mp_span(r, 3, mp_be16(r->p + 1), data, n);
    if (t == 0xdb && mp_left(r, 5))
        return mp_span(r, 5, mp_be32(r->p + 1), data, n);
    return 0;
}

static inline int mp_bin(mp_reader *r, const uint8_t **data, uint32_t *n) {
    uint8_t t;
    if (!mp_peek(r, &t))
        return 0;
    if (t == 0xc4 && mp_left(r, 2))
        return mp_span(r, 2, r->p[1], data, n);
    if (t == 0xc5 && mp_left(r, 3))
        return mp_span(r, 3, mp_be16(r->p + 1), data, n);
    if (t == 0xc6 && mp_left(r, 5))
        return mp_span(r, 5, mp_be32(r->p + 1), data, n);
    return 0;
}

/* Whether `n` bytes are valid UTF-8 (what msgspec requires of a str field): no overlong
 * forms, no surrogates, nothing past U+10FFFF. */
static inline int mp_utf8(const uint8_t *s, uint32_t n) {
    uint32_t i = 0;
    /* ASCII eight bytes at a time: every name vLLM and SGLang send is ASCII. */
    while (i + 8 <= n) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        if (w & 0x8080808080808080ULL)
            break;
        i += 8;
    }
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        uint32_t need, cp;
        if ((c & 0xe0) == 0xc0)
            need = 1, cp = c & 0x1f;
        else if ((c & 0xf0) == 0xe0)
            need = 2, cp = c & 0x0f;
        else if ((c & 0xf8) == 0xf0)
            need = 3, cp = c & 0x07;
        else
            return 0;
        if (n - i <= need) /* the continuation bytes must all be there */
            return 0;
        for (uint32_t k = 1; k <= need; k++) {
            uint8_t d = s[i + k];
            if ((d & 0xc0) != 0x80)
                return 0;
            cp = (cp << 6) | (d & 0x3f);
        }
        if ((need == 1 && cp < 0x80) || (need == 2 && cp < 0x800) || (need == 3 && cp < 0x10000))
            return 0; /* overlong */
        if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += need + 1;
    }
    return 1;
}

/* Skip one value of any type (nested at most MP_MAX_DEPTH deep). */
static int mp_skip_depth(mp_reader *r, int depth) {
    uint8_t t;
    if (depth > MP_MAX_DEPTH || !mp_peek(r, &t))
        return 0;
    const uint8_t *data;
    uint32_t n;
    int kind;
    uint64_t v;
    double d;
    if (t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xd3))
        return mp_int(r, &kind, &v);
    if (t == 0xc0 || t == 0xc2 || t == 0xc3) {
        r->p++;
        return 1;
    }
    if (t == 0xca || t == 0xcb)
        return mp_float(r, &d);
    if ((t & 0xe0) == 0xa0 || (t >= 0xd9 && t <= 0xdb))
        return mp_str(r, &data, &n);
    if (t >= 0xc4 && t <= 0xc6)
        return mp_bin(r, &data, &n);
    if ((t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd) {
        if (!mp_array(r, &n))
            return 0;
        for (uint32_t i = 0; i < n; i++)
            if (!mp_skip_depth(r, depth + 1))
                return 0;
        return 1;
    }
    if ((t & 0xf0) == 0x80 || t == 0xde || t == 0xdf) {
        if (!mp_map(r, &n))
            return 0;
        /* Counted in 64 bits: 2 * n in 32 wrapped to 0 for n >= 2^31, and such a map was
         * skipped as if complete. Each key and value takes a byte at least. */
        uint64_t items = 2 * (uint64_t)n;
        if (items > (uint64_t)(r->end - r->p))
            return 0;
        for (uint64_t i = 0; i < items; i++)
            if (!mp_skip_depth(r, depth + 1))
                return 0;
        return 1;
    }
    /* ext types and the never-used 0xc1: not something an event batch carries. */
    return 0;
}

static inline int mp_skip(mp_reader *r) { return mp_skip_depth(r, 0); }

#endif
