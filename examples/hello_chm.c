/*
 * hello_chm: write an object to a CXL-HM device, prefetch it, wait, read it
 * back, release it and print the device's counters.
 *
 *   cc hello_chm.c $(pkg-config --cflags --libs libchm) -o hello_chm
 *   chm serve &            # in another shell
 *   ./hello_chm [node]     # default: $CHM_DEVICE, else chm0
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <chm.h>

#define OBJECT_ADDR 0x100000ull
#define OBJECT_SIZE (256 * 1024)

static int fail(const char *what, long err)
{
    fprintf(stderr, "hello_chm: %s: %s\n", what, chm_strerror((int)err));
    return 1;
}

int main(int argc, char **argv)
{
    chm_dev *dev;
    int ret = chm_open(argc > 1 ? argv[1] : NULL, &dev);
    if (ret < 0)
        return fail("chm_open", ret);

    struct chm_info info;
    chm_get_info(dev, &info);
    printf("device: %llu bytes, %llu bytes DRAM, page %llu, %u SSD(s), policy %s\n",
           (unsigned long long)info.capacity_bytes, (unsigned long long)info.dram_bytes,
           (unsigned long long)info.page_size, info.ssd_count, info.policy);

    char *object = malloc(OBJECT_SIZE), *back = malloc(OBJECT_SIZE);
    for (size_t i = 0; i < OBJECT_SIZE; i++)
        object[i] = (char)(i * 31 + 7);

    ssize_t n = chm_write(dev, OBJECT_ADDR, object, OBJECT_SIZE);
    if (n < 0)
        return fail("chm_write", n);
    printf("wrote %zd bytes at 0x%llx (modelled %llu ns)\n", n, OBJECT_ADDR,
           (unsigned long long)chm_last_latency_ns(dev));
    if ((ret = chm_flush(dev)) < 0)
        return fail("chm_flush", ret);

    chm_req req = chm_prefetch_object(dev, OBJECT_ADDR, OBJECT_SIZE);
    if (req < 0)
        return fail("chm_prefetch_object", req);
    if ((ret = chm_prefetch_wait(dev, req, -1)) < 0)
        return fail("chm_prefetch_wait", ret);
    printf("prefetched handle %lld, staged after %llu ns\n", (long long)req,
           (unsigned long long)chm_last_latency_ns(dev));

    n = chm_read(dev, OBJECT_ADDR, back, OBJECT_SIZE);
    if (n < 0)
        return fail("chm_read", n);
    int same = memcmp(object, back, OBJECT_SIZE) == 0;
    printf("read %zd bytes back: %s (modelled %llu ns)\n", n, same ? "match" : "MISMATCH",
           (unsigned long long)chm_last_latency_ns(dev));
    if ((ret = chm_prefetch_release(dev, req)) < 0)
        return fail("chm_prefetch_release", ret);
    ret = chm_prefetch_release(dev, req);
    printf("second release: %s\n", chm_strerror(ret));

    struct chm_stats st;
    if ((ret = chm_get_stats(dev, &st)) < 0)
        return fail("chm_get_stats", ret);
    printf("stats: reads=%llu writes=%llu prefetches=%llu releases=%llu read_bytes=%llu write_bytes=%llu "
           "ssd_write_bytes=%llu clients=%llu\n",
           (unsigned long long)st.reads, (unsigned long long)st.writes, (unsigned long long)st.prefetches,
           (unsigned long long)st.releases, (unsigned long long)st.read_bytes, (unsigned long long)st.write_bytes,
           (unsigned long long)st.ssd_write_bytes, (unsigned long long)st.clients);
    free(object);
    free(back);
    chm_close(dev);
    return same ? 0 : 1;
}
