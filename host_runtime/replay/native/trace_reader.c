/* A streaming reader of traces in libCacheSim's formats: see trace_reader.h. */
#define _POSIX_C_SOURCE 200809L

#include "trace_reader.h"
#include "xxh3.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHUNK (1u << 20)          /* bytes read at a time; the buffer's size unless a line is longer */
#define FIELD_MAX 128             /* a numeric field longer than this is not a number */
#define HEADER_GUESS_BYTES 1024   /* libCacheSim guesses a csv header from this much of the first line */
#define ORACLE_GENERAL_ITEM 24    /* uint32 time, uint64 id, uint32 size, int64 next access */
#define LCS_HEADER 8192           /* start magic, version, stat (8000 bytes), unused, end magic */
#define LCS_MAGIC 0x123456789abcdef0ULL

struct tr_reader {
    tr_params p;
    char *path;
    int fd;
    char *buf;
    size_t cap, start, end; /* buf[start, end): read, not yet decoded */
    int eof;                /* read() said the file ends at buf[end] */
    int64_t pos;            /* the line (text) or record (binary) last read */
    int64_t n_req;          /* requests returned since open / reset */
    int status;
    char msg[1024];
    /* csv: the columns each field goes to, as libCacheSim's callback does (obj id, then time, then size) */
    unsigned char delim;
    int has_header;
    int tcol, icol, scol, maxcol;
    /* binary */
    size_t item_size;
    int lcs_ver;
    char *field;           /* a quoted field, unquoted (grown to the line's length) */
    size_t field_cap;
};

static int fail(tr_reader *r, int code, const char *fmt, ...) {
    int n = snprintf(r->msg, sizeof r->msg, "%s: ", r->path ? r->path : "?");
    if (n < 0 || (size_t)n >= sizeof r->msg) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->msg + n, sizeof r->msg - n, fmt, ap);
    va_end(ap);
    r->status = code;
    return -1;
}

/* 'text' as a message shows it: quoted, at most 40 bytes, bytes that do not print as \xNN */
static const char *shown(char *out, size_t out_len, const char *s, size_t len) {
    size_t o = 0, limit = len > 40 ? 40 : len;
    out[o++] = '\'';
    for (size_t i = 0; i < limit && o + 8 < out_len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
            out[o++] = (char)c;
        } else {
            o += (size_t)snprintf(out + o, out_len - o, "\\x%02x", c);
        }
    }
    if (limit < len && o + 4 < out_len) {
        memcpy(out + o, "...", 3);
        o += 3;
    }
    out[o++] = '\'';
    out[o] = 0;
    return out;
}

/* ---- reading the file in chunks ---- */

/* Read more of the file into the buffer (moving what is left to its start, growing it only when it is full of one
 * line). 0, or -1 on an error. */
static int fill(tr_reader *r) {
    if (r->start > 0) {
        memmove(r->buf, r->buf + r->start, r->end - r->start);
        r->end -= r->start;
        r->start = 0;
    }
    if (r->end == r->cap) {
        if (r->cap >= (size_t)TR_MAX_LINE + 1)
            return fail(r, TR_E_PARSE, "line %lld: longer than %d bytes", (long long)r->pos + 1, TR_MAX_LINE);
        size_t cap = r->cap * 2 > (size_t)TR_MAX_LINE + 1 ? (size_t)TR_MAX_LINE + 1 : r->cap * 2;
        char *grown = realloc(r->buf, cap);
        if (!grown) return fail(r, TR_E_NOMEM, "out of memory for a line of %zu bytes", cap);
        r->buf = grown;
        r->cap = cap;
    }
    for (;;) {
        ssize_t got = read(r->fd, r->buf + r->end, r->cap - r->end);
        if (got > 0) {
            r->end += (size_t)got;
            return 0;
        }
        if (got == 0) {
            r->eof = 1;
            return 0;
        }
        if (errno != EINTR) return fail(r, TR_E_IO, "cannot read: %s", strerror(errno));
    }
}

/* The next line, without its '\n' (the last one may have none). 1: a line; 0: the end of the file; -1: error. The
 * line lies in the buffer until the next call. */
static int next_line(tr_reader *r, const char **line, size_t *len) {
    for (;;) {
        char *s = r->buf + r->start;
        size_t avail = r->end - r->start;
        char *nl = avail ? memchr(s, '\n', avail) : NULL;
        if (nl) {
            *line = s;
            *len = (size_t)(nl - s);
            r->start += *len + 1;
            r->pos++;
            return 1;
        }
        if (r->eof) {
            if (!avail) return 0;
            *line = s;
            *len = avail;
            r->start = r->end;
            r->pos++;
            return 1;
        }
        if (fill(r) < 0) return -1;
    }
}

/* At least n bytes in the buffer (1), the end of the file (0), a partial record at the end (2), error (-1). */
static int need_bytes(tr_reader *r, size_t n) {
    while (r->end - r->start < n) {
        if (r->eof) return r->end == r->start ? 0 : 2;
        if (fill(r) < 0) return -1;
    }
    return 1;
}

/* ---- numbers, as the C library reads libCacheSim's fields ---- */

enum { NUM_OK = 0, NUM_NOT = 1, NUM_RANGE = 2 };

static int all_digits(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9') return 0;
    return 1;
}

static uint64_t decimal(const char *s, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v = v * 10 + (uint64_t)(s[i] - '0');
    return v;
}

/* A NUL-terminated copy of s[0, n) in out (FIELD_MAX bytes), or 0 when it does not fit. */
static int copied(char *out, const char *s, size_t n) {
    if (n == 0 || n >= FIELD_MAX || memchr(s, 0, n)) return 0;
    memcpy(out, s, n);
    out[n] = 0;
    return 1;
}

/* An object id as strtoull(s, &end, 0) reads it (0x.. hex, 0.. octal), the whole field: [0, 2^64). */
static int parse_u64(const char *s, size_t n, uint64_t *out) {
    if (n >= 1 && n <= 19 && (s[0] != '0' || n == 1) && all_digits(s, n)) {
        *out = decimal(s, n);
        return NUM_OK;
    }
    char tmp[FIELD_MAX], *end;
    if (!copied(tmp, s, n)) return NUM_NOT;
    errno = 0;
    unsigned long long v = strtoull(tmp, &end, 0);
    if (end == tmp || *end) return NUM_NOT;
    if (errno == ERANGE || memchr(tmp, '-', n)) return NUM_RANGE; /* strtoull wraps -1 to 2^64 - 1 */
    *out = (uint64_t)v;
    return NUM_OK;
}

/* An object size as strtoll(s, &end, 0) reads it, the whole field: [0, 2^63). */
static int parse_size(const char *s, size_t n, int64_t *out) {
    if (n >= 1 && n <= 18 && (s[0] != '0' || n == 1) && all_digits(s, n)) {
        *out = (int64_t)decimal(s, n);
        return NUM_OK;
    }
    char tmp[FIELD_MAX], *end;
    if (!copied(tmp, s, n)) return NUM_NOT;
    errno = 0;
    long long v = strtoll(tmp, &end, 0);
    if (end == tmp || *end) return NUM_NOT;
    if (errno == ERANGE || v < 0) return NUM_RANGE;
    *out = (int64_t)v;
    return NUM_OK;
}

/* A time as libCacheSim reads it, (int64_t)strtod(s, NULL) (truncated toward 0), the whole field. */
static int parse_time(const char *s, size_t n, int64_t *out) {
    if (n >= 1 && n <= 15 && all_digits(s, n)) { /* < 2^53: strtod reads it exactly */
        *out = (int64_t)decimal(s, n);
        return NUM_OK;
    }
    char tmp[FIELD_MAX], *end;
    if (!copied(tmp, s, n)) return NUM_NOT;
    double v = strtod(tmp, &end);
    if (end == tmp || *end || isnan(v)) return NUM_NOT;
    if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0)) return NUM_RANGE;
    *out = (int64_t)v;
    return NUM_OK;
}

/* ---- csv ---- */

static int is_blank(unsigned char c, unsigned char delim) { return (c == ' ' || c == '\t') && c != delim; }

static int field_error(tr_reader *r, const char *col_name, int col, const char *s, size_t n, int why,
                       const char *allowed) {
    char v[256];
    shown(v, sizeof v, s, n);
    return fail(r, TR_E_PARSE, "line %lld: %s %d: %s %s (%s)", (long long)r->pos, col_name, col, v,
                why == NUM_RANGE ? "is out of range" : "is not a number", allowed);
}

/* One csv data line -> a request. 0, or -1 on an error. */
static int csv_row(tr_reader *r, const char *line, size_t len, int64_t *t, uint64_t *id, int64_t *size) {
    const unsigned char delim = r->delim;
    while (len > 0 && line[len - 1] == '\r') len--; /* libcsv: a CR ends the row */
    if (memchr(line, '\r', len))
        return fail(r, TR_E_PARSE, "line %lld: a carriage return inside the line (libcsv would start a new row "
                    "there)", (long long)r->pos);
    size_t i = 0;
    while (i < len && is_blank((unsigned char)line[i], delim)) i++;
    if (i == len)
        return fail(r, TR_E_PARSE, "line %lld: an empty line (libCacheSim would read it as a request for object 0 "
                    "at time 0)", (long long)r->pos);
    *t = 0;
    *id = 0;
    *size = 1; /* libCacheSim's values for a column it is not given */
    i = 0;
    for (int col = 1;; col++) {
        while (i < len && is_blank((unsigned char)line[i], delim)) i++;
        const char *fs;
        size_t fl;
        int role = col == r->icol ? 1 : col == r->tcol ? 2 : col == r->scol ? 3 : 0;
        if (i < len && line[i] == '"') { /* quoted: "" is a quote, the delimiter is text */
            if (r->field_cap < len) {
                char *grown = realloc(r->field, len);
                if (!grown) return fail(r, TR_E_NOMEM, "out of memory for a field of %zu bytes", len);
                r->field = grown;
                r->field_cap = len;
            }
            size_t o = 0, open = i;
            int closed = 0;
            for (i++; i < len; i++) {
                if (line[i] == '"') {
                    if (i + 1 < len && line[i + 1] == '"') {
                        i++;
                    } else {
                        closed = 1;
                        i++;
                        break;
                    }
                }
                r->field[o++] = line[i];
            }
            while (i < len && is_blank((unsigned char)line[i], delim)) i++;
            if (!closed || (i < len && (unsigned char)line[i] != delim)) {
                char v[256];
                shown(v, sizeof v, line + open, (i < len ? i + 1 : len) - open);
                return fail(r, TR_E_PARSE, "line %lld: column %d: %s is not a quoted field (a quote, the text with "
                            "\"\" for a quote, a quote, then the delimiter)", (long long)r->pos, col, v);
            }
            fs = r->field;
            fl = o;
        } else {
            size_t b = i;
            const char *d = memchr(line + i, delim, len - i);
            i = d ? (size_t)(d - line) : len;
            size_t e = i;
            while (e > b && is_blank((unsigned char)line[e - 1], delim)) e--;
            fs = line + b;
            fl = e - b;
        }
        if (role == 1 && !r->p.obj_id_is_num) {
            *id = xxh3_64(fs, fl); /* libCacheSim: get_hash_value_str(field, length) */
        } else if (role == 1) {
            int why = parse_u64(fs, fl, id);
            if (why) return field_error(r, "obj-id-col", col, fs, fl, why, "an object id: an integer in [0, 2^64), "
                                        "0x.. hex, 0.. octal, as strtoull reads it");
        } else if (role == 2) {
            int why = parse_time(fs, fl, t);
            if (why) return field_error(r, "time-col", col, fs, fl, why, "a time: a number in [-2^63, 2^63) as "
                                        "strtod reads it");
        } else if (role == 3) {
            int why = parse_size(fs, fl, size);
            if (why) return field_error(r, "obj-size-col", col, fs, fl, why, "an object size: an integer in [0, "
                                        "2^63), 0x.. hex, 0.. octal, as strtoll reads it");
        }
        if (col >= r->maxcol) return 0;
        if (i >= len) { /* the row ends before a column a request needs */
            const char *names[3] = {"obj-id-col", "time-col", "obj-size-col"}, *name = names[0];
            const int cols[3] = {r->icol, r->tcol, r->scol};
            int missing = 0;
            for (int k = 0; k < 3; k++)
                if (cols[k] > col && (missing == 0 || cols[k] < missing)) name = names[k], missing = cols[k];
            return fail(r, TR_E_PARSE, "line %lld: %d column%s, but %s is %d (columns are counted from 1; "
                        "libCacheSim would read a missing time or id as 0, a missing size as 1)",
                        (long long)r->pos, col, col == 1 ? "" : "s", name, missing);
        }
        i++; /* the delimiter */
    }
}

/* The first line: libCacheSim refuses a trace whose first line lacks the delimiter, guesses a header from it
 * unless told, and skips a header. */
static int csv_prologue(tr_reader *r) {
    int64_t pos = r->pos;
    const char *line;
    size_t len;
    int got = next_line(r, &line, &len);
    if (got <= 0) return got; /* an empty file: no requests */
    size_t before = (size_t)(line - r->buf); /* where the line starts (next_line may have moved the buffer) */
    if (!memchr(line, r->delim, len)) {
        char v[256], d[16];
        return fail(r, TR_E_PARSE, "line 1: %s has no %s in it: the trace does not use that delimiter (libCacheSim "
                    "refuses it)", shown(v, sizeof v, line, len), shown(d, sizeof d, (const char *)&r->delim, 1));
    }
    int header = r->p.has_header;
    if (header < 0) { /* libCacheSim's guess: more digits than letters is no header */
        size_t n = len + (r->start > before + len ? 1 : 0); /* with its '\n', as getline returns it */
        if (n >= HEADER_GUESS_BYTES)
            return fail(r, TR_E_UNSUPPORTED, "line 1: %zu bytes, too long for libCacheSim's guess whether it is a "
                        "header (set has-header)", n);
        int digits = 0, letters = 0;
        for (size_t i = 0; i < len; i++) {
            char c = line[i];
            if (c >= '0' && c <= '9') digits++;
            else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) letters++;
        }
        header = !(digits > letters);
    }
    r->has_header = header;
    if (!header) { /* the line is a request: read it again */
        r->start = before;
        r->pos = pos;
    }
    return 0;
}

/* ---- binary formats ---- */

static uint32_t u32_at(const char *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static uint64_t u64_at(const char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static int lcs_prologue(tr_reader *r) {
    int got = need_bytes(r, LCS_HEADER);
    if (got < 0) return -1;
    if (got != 1)
        return fail(r, TR_E_PARSE, "not an lcs trace: %zu bytes, shorter than its %d-byte header",
                    r->end - r->start, LCS_HEADER);
    const char *h = r->buf + r->start;
    uint64_t start_magic = u64_at(h), version = u64_at(h + 8), end_magic = u64_at(h + LCS_HEADER - 8);
    int64_t n_req = (int64_t)u64_at(h + 24), n_obj = (int64_t)u64_at(h + 32);
    if (start_magic != LCS_MAGIC || end_magic != LCS_MAGIC)
        return fail(r, TR_E_PARSE, "not an lcs trace: its header's %s magic is 0x%llx, not 0x%llx",
                    start_magic != LCS_MAGIC ? "start" : "end",
                    (unsigned long long)(start_magic != LCS_MAGIC ? start_magic : end_magic), LCS_MAGIC);
    if (n_req < 0 || n_obj < 0)
        return fail(r, TR_E_PARSE, "lcs header: n_req %lld, n_obj %lld must be >= 0", (long long)n_req,
                    (long long)n_obj);
    static const size_t sizes[] = {0, 24, 28, 36, 40, 44, 52, 68, 100}; /* lcs_req_v1_t .. lcs_req_v8_t */
    if (version < 1 || version > 8)
        return fail(r, TR_E_PARSE, "lcs header: version %llu is not one of 1..8", (unsigned long long)version);
    r->lcs_ver = (int)version;
    r->item_size = sizes[version];
    r->start += LCS_HEADER;
    return 0;
}

/* ---- the reader ---- */

static int prologue(tr_reader *r) {
    switch (r->p.format) {
        case TR_CSV: return csv_prologue(r);
        case TR_LCS: return lcs_prologue(r);
        default: return 0;
    }
}

static int check_params(tr_reader *r) {
    const tr_params *p = &r->p;
    if (p->format < TR_CSV || p->format > TR_LCS)
        return fail(r, TR_E_PARAM, "format %d is not one of csv (%d), txt (%d), oracleGeneral (%d), lcs (%d)",
                    p->format, TR_CSV, TR_TXT, TR_ORACLE_GENERAL, TR_LCS);
    size_t plen = strlen(r->path);
    if (plen >= 4 && strcmp(r->path + plen - 4, ".zst") == 0)
        return fail(r, TR_E_UNSUPPORTED, "a zstd-compressed trace (libCacheSim decompresses it; this reader does "
                    "not)");
    if (p->format == TR_CSV || p->format == TR_TXT) {
        if (!p->obj_id_is_num && p->format == TR_TXT)
            return fail(r, TR_E_UNSUPPORTED, "obj-id-is-num = false: libCacheSim numbers such txt ids as glib "
                        "quarks (in the order the process first sees them), this reader reads numeric ids only");
    }
    if (p->format == TR_CSV) {
        if (p->time_col < 0 || p->obj_id_col < 0 || p->obj_size_col < 0)
            return fail(r, TR_E_PARAM, "columns are counted from 1 (time-col %d, obj-id-col %d, obj-size-col %d)",
                        p->time_col, p->obj_id_col, p->obj_size_col);
        if (p->cnt_col)
            return fail(r, TR_E_UNSUPPORTED, "cnt-col (libCacheSim repeats a request cnt times; this reader "
                        "does not)");
        if (p->delimiter <= 0 || p->delimiter > 255 || p->delimiter == '\n' || p->delimiter == '\r' ||
            p->delimiter == '"')
            return fail(r, TR_E_PARAM, "delimiter %d is not a byte that can separate csv fields", p->delimiter);
        if (p->has_header < -1 || p->has_header > 1)
            return fail(r, TR_E_PARAM, "has_header %d is not 1, 0 or -1 (guess)", p->has_header);
        r->delim = (unsigned char)p->delimiter;
        /* libCacheSim's callback gives a field to the obj id, else the time, else the size */
        r->icol = p->obj_id_col;
        r->tcol = p->time_col != r->icol ? p->time_col : 0;
        r->scol = p->obj_size_col != r->icol && p->obj_size_col != p->time_col ? p->obj_size_col : 0;
        r->maxcol = r->icol > r->tcol ? r->icol : r->tcol;
        if (r->scol > r->maxcol) r->maxcol = r->scol;
        if (r->maxcol == 0) r->maxcol = 1;
    }
    if (p->format == TR_ORACLE_GENERAL) r->item_size = ORACLE_GENERAL_ITEM;
    return 0;
}

tr_reader *tr_open(const char *path, const tr_params *params) {
    tr_reader *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->fd = -1;
    r->path = strdup(path ? path : "");
    if (!r->path) {
        free(r);
        return NULL;
    }
    r->p = *params;
    if (check_params(r) < 0) return r;
    r->buf = malloc(CHUNK);
    if (!r->buf) {
        fail(r, TR_E_NOMEM, "out of memory");
        return r;
    }
    r->cap = CHUNK;
    r->fd = open(r->path, O_RDONLY);
    if (r->fd < 0) {
        fail(r, TR_E_IO, "cannot open: %s", strerror(errno));
        return r;
    }
    prologue(r);
    return r;
}

int tr_reset(tr_reader *r) {
    if (r->fd < 0 || !r->buf) return r->status;
    if (lseek(r->fd, 0, SEEK_SET) < 0) return fail(r, TR_E_IO, "cannot seek: %s", strerror(errno));
    r->start = r->end = 0;
    r->eof = 0;
    r->pos = 0;
    r->n_req = 0;
    r->status = TR_OK;
    r->msg[0] = 0;
    prologue(r);
    return r->status;
}

static int64_t binary_batch(tr_reader *r, int64_t *times, uint64_t *obj_ids, int64_t *sizes, int64_t max,
                            int64_t cap) {
    const size_t item = r->item_size;
    const int wide_size = r->p.format == TR_LCS && r->lcs_ver >= 3; /* lcs v3..: int64 size */
    int64_t n = 0;
    while (n < max && !(cap > 1 && r->n_req >= cap)) {
        int got = need_bytes(r, item);
        if (got < 0) return -1;
        if (got == 0) break;
        if (got == 2)
            return fail(r, TR_E_PARSE, "record %lld: %zu of its %zu bytes (the file ends inside the record)",
                        (long long)r->pos + 1, r->end - r->start, item);
        const char *rec = r->buf + r->start;
        r->start += item;
        r->pos++;
        int64_t size = wide_size ? (int64_t)u64_at(rec + 12) : (int64_t)u32_at(rec + 12);
        if (size < 0)
            return fail(r, TR_E_PARSE, "record %lld: obj_size %lld must be >= 0", (long long)r->pos,
                        (long long)size);
        if (size == 0 && r->p.ignore_size_zero_req) continue;
        times[n] = (int64_t)u32_at(rec);
        obj_ids[n] = u64_at(rec + 4);
        sizes[n] = r->p.ignore_obj_size ? 1 : size;
        n++;
        r->n_req++;
    }
    return n;
}

static int txt_row(tr_reader *r, const char *line, size_t len, uint64_t *id) {
    size_t b = 0, e = len;
    while (b < e && (line[b] == ' ' || (line[b] >= '\t' && line[b] <= '\r'))) b++;
    while (e > b && (line[e - 1] == ' ' || (line[e - 1] >= '\t' && line[e - 1] <= '\r'))) e--;
    int why = parse_u64(line + b, e - b, id);
    if (why) {
        char v[256];
        shown(v, sizeof v, line, len);
        return fail(r, TR_E_PARSE, "line %lld: %s %s (a txt line is one object id: an integer in [0, 2^64), 0x.. "
                    "hex, 0.. octal, as strtoull reads it)", (long long)r->pos, v,
                    why == NUM_RANGE ? "is out of range" : "is not a number");
    }
    return 0;
}

int64_t tr_next_batch(tr_reader *r, int64_t *times, uint64_t *obj_ids, int64_t *sizes, int64_t max) {
    if (r->status != TR_OK) return -1;
    const int64_t cap = r->p.cap_at_n_req;
    if (r->p.format == TR_ORACLE_GENERAL || r->p.format == TR_LCS)
        return binary_batch(r, times, obj_ids, sizes, max, cap);
    int64_t n = 0;
    while (n < max && !(cap > 1 && r->n_req >= cap)) {
        const char *line;
        size_t len;
        int got = next_line(r, &line, &len);
        if (got < 0) return -1;
        if (got == 0) break;
        int64_t t = 0, size = 1;
        uint64_t id = 0;
        if (r->p.format == TR_TXT) {
            if (len == 0) continue; /* a line that is only '\n': libCacheSim skips it */
            if (txt_row(r, line, len, &id) < 0) return -1;
        } else {
            if (csv_row(r, line, len, &t, &id, &size) < 0) return -1;
            if (size == 0 && r->p.ignore_size_zero_req) continue;
        }
        times[n] = t;
        obj_ids[n] = id;
        sizes[n] = r->p.ignore_obj_size ? 1 : size;
        n++;
        r->n_req++;
    }
    return n;
}

int tr_status(const tr_reader *r) { return r->status; }
const char *tr_message(const tr_reader *r) { return r->msg; }
int64_t tr_requests(const tr_reader *r) { return r->n_req; }
int64_t tr_position(const tr_reader *r) { return r->pos; }

void tr_close(tr_reader *r) {
    if (!r) return;
    if (r->fd >= 0) close(r->fd);
    free(r->buf);
    free(r->field);
    free(r->path);
    free(r);
}

uint64_t tr_xxh3_64(const char *s, size_t len) { return xxh3_64(s, len); }
