/* A streaming reader of traces in libCacheSim's formats (csv, txt, oracleGeneral, lcs), in C, with no
 * object per request: requests come out in batches of three arrays (clock time, object id, object size).
 *
 * Our own code, written to give what libCacheSim 0.3.5's reader (traceReader/reader.c, generalReader/csv.c
 * with libcsv, generalReader/txt.c, customizedReader/oracle/oracleGeneralBin.h, customizedReader/lcs.c) gives,
 * through its Python binding's defaults (ReaderInitParam(): obj_id_is_num, ignore_size_zero_req, delimiter ','),
 * request for request; tests/host_runtime/test_native_reader.py pins the two together on every format here.
 *
 * What libCacheSim reads from a file it cannot read whole is not copied: where it would read a request that is
 * not in the file (a blank csv line: object 0 at time 0; a column past the row's end: 0; a truncated binary
 * record: whatever follows the file) or abort the process (a txt line that is no number, a missing file), this
 * reader stops with an error naming the file, the line or record, the field and the value. A csv object id that
 * is not a number (obj-id-is-num = false) is hashed as libCacheSim hashes it (XXH3_64bits of the field, xxh3.h).
 *
 * The file is read in chunks into one buffer (1 MiB, grown only for a longer line, at most TR_MAX_LINE bytes):
 * the reader's memory does not grow with the trace.
 *
 * Built by host_runtime/replay/native_reader_build.py (cffi API mode: the text between the cdef markers below
 * is the cdef); used through host_runtime/replay/native_reader.py.
 */
#ifndef TRACE_READER_H
#define TRACE_READER_H

#include <stddef.h>
#include <stdint.h>

/* ---- cdef begin ---- */

/* Formats (libCacheSim's names: csv, txt, oracleGeneral, lcs) */
#define TR_CSV 1
#define TR_TXT 2
#define TR_ORACLE_GENERAL 3
#define TR_LCS 4

/* Status codes (tr_status) */
#define TR_OK 0
#define TR_E_IO 1          /* the file cannot be opened or read */
#define TR_E_PARSE 2       /* the file holds something that is not a request of the format */
#define TR_E_PARAM 3       /* a bad parameter */
#define TR_E_UNSUPPORTED 4 /* libCacheSim reads it, this reader does not (e.g. hashed object ids) */
#define TR_E_NOMEM 5

#define TR_MAX_LINE 16777216 /* the longest csv / txt line read */

typedef struct {
    int format;                /* TR_CSV, TR_TXT, TR_ORACLE_GENERAL, TR_LCS */
    /* csv: 1-based columns, 0 = none (libCacheSim's time_field, obj_id_field, obj_size_field) */
    int time_col;
    int obj_id_col;
    int obj_size_col;
    int cnt_col;               /* libCacheSim's cnt_field: not supported here (!= 0: TR_E_UNSUPPORTED) */
    int delimiter;             /* csv: one byte, e.g. ',' '\t' ' ' */
    int has_header;            /* csv: 1 / 0, or -1: guess from the first line as libCacheSim does */
    int obj_id_is_num;         /* csv, txt: 1: ids are numbers; 0: csv ids are hashed (XXH3 of the field, as
                                * libCacheSim does), txt ids are not supported here (glib quarks) */
    int ignore_obj_size;       /* every request's size is 1 (sizes are still read: size-0 requests are skipped) */
    int ignore_size_zero_req;  /* skip requests of size 0 (libCacheSim's default: 1) */
    int64_t cap_at_n_req;      /* at most this many requests; <= 1: no cap (libCacheSim's rule) */
} tr_params;

typedef struct tr_reader tr_reader;

/* Open a trace. Returns NULL only when out of memory; otherwise a reader whose tr_status() says whether it
 * opened (TR_OK) or why not (tr_message()). Close it with tr_close() either way. */
tr_reader *tr_open(const char *path, const tr_params *params);

/* Decode up to max requests into the arrays. Returns how many (0: the end of the trace), or -1 on an error
 * (tr_status(), tr_message(); the reader stays at the error). */
int64_t tr_next_batch(tr_reader *r, int64_t *times, uint64_t *obj_ids, int64_t *sizes, int64_t max);

/* Back to the first request. Returns tr_status(). */
int tr_reset(tr_reader *r);

int tr_status(const tr_reader *r);
const char *tr_message(const tr_reader *r);
/* Requests returned since open / reset, and the line (csv, txt) or record (binary) last read. */
int64_t tr_requests(const tr_reader *r);
int64_t tr_position(const tr_reader *r);
void tr_close(tr_reader *r);

/* XXH3_64bits(s, len): the id libCacheSim gives a csv object id that is not a number (obj-id-is-num = false) */
uint64_t tr_xxh3_64(const char *s, size_t len);

/* ---- cdef end ---- */

#endif
