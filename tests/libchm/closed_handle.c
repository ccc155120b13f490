/*
 * closed_handle: every libchm entry point on a handle chm_close has closed.
 * chm.h documents it as undefined (like free) but detected where cheap:
 * a second chm_close does nothing, calls return -EBADF, chm_buffer NULL,
 * chm_last_latency_ns 0. Exits 0 (pass), 1 (fail), 77 (skip: no device).
 *
 *   closed_handle NODE
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <chm.h>

#define EXIT_PASS 0
#define EXIT_FAIL 1
#define EXIT_SKIP 77

/* Results are recorded first and printed after: printf may allocate, and a
 * reused allocation would hide the closed handle (detection is best effort). */
struct check {
    const char *call;
    long got, want;
};

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: closed_handle NODE\n");
        return EXIT_FAIL;
    }
    chm_dev *dev;
    int ret = chm_open(argv[1], &dev);
    if (ret == -ENODEV)
        return EXIT_SKIP;
    if (ret < 0) {
        fprintf(stderr, "chm_open: %s\n", chm_strerror(ret));
        return EXIT_FAIL;
    }
    static char data[4096];
    static struct chm_info info;
    static struct chm_stats stats;
    static struct chm_completion comp;
    static char json[256];

    chm_close(dev);
    chm_close(dev);   /* double close: must do nothing */
    struct check checks[] = {
        { "chm_read", (long)chm_read(dev, 0, data, sizeof(data)), -EBADF },
        { "chm_write", (long)chm_write(dev, 0, data, sizeof(data)), -EBADF },
        { "chm_flush", chm_flush(dev), -EBADF },
        { "chm_get_info", chm_get_info(dev, &info), -EBADF },
        { "chm_get_stats", chm_get_stats(dev, &stats), -EBADF },
        { "chm_stats_json", (long)chm_stats_json(dev, json, sizeof(json)), -EBADF },
        { "chm_prefetch_object", (long)chm_prefetch_object(dev, 0, 4096), -EBADF },
        { "chm_prefetch_wait", chm_prefetch_wait(dev, 1, 0), -EBADF },
        { "chm_prefetch_release", chm_prefetch_release(dev, 1), -EBADF },
        { "chm_submit_read", chm_submit_read(dev, 0, data, sizeof(data), 1), -EBADF },
        { "chm_submit_write", chm_submit_write(dev, 0, data, sizeof(data), 1), -EBADF },
        { "chm_reap", chm_reap(dev, &comp, 1, 0), -EBADF },
        { "chm_buffer is NULL", chm_buffer(dev, NULL) == NULL, 1 },
        { "chm_last_latency_ns", (long)chm_last_latency_ns(dev), 0 },
    };
    chm_close(dev);   /* and a third time, after the calls */

    int failed = 0;
    for (size_t i = 0; i < sizeof(checks) / sizeof(checks[0]); i++) {
        if (checks[i].got != checks[i].want) {
            fprintf(stderr, "FAIL %s: got %ld, want %ld\n", checks[i].call, checks[i].got, checks[i].want);
            failed = 1;
        }
    }
    if (strcmp(chm_strerror(-EBADF), strerror(EBADF)) == 0) {
        fprintf(stderr, "FAIL chm_strerror(-EBADF) has no libchm text\n");
        failed = 1;
    }
    if (!failed)
        printf("closed handle: double close ignored, every call refused\n");
    return failed ? EXIT_FAIL : EXIT_PASS;
}
