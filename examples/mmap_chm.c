/*
 * mmap_chm: the device as memory. Map a range of a CXL-HM device, write a
 * pattern into it with plain stores, unmap, map it again, verify the pattern
 * with plain loads, check it through chm_read too, and print the device's
 * chm_mmap counters.
 *
 *   cc mmap_chm.c $(pkg-config --cflags --libs libchm) -o mmap_chm
 *   chm serve --policy lru &   # in another shell (a one-area policy)
 *   ./mmap_chm [node] [MiB]    # default: $CHM_DEVICE, else chm0; 8 MiB
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <chm.h>

#define MAP_ADDR (64ull << 20)   /* device address of the mapping */

static int fail(const char *what, long err)
{
    fprintf(stderr, "mmap_chm: %s: %s\n", what, chm_strerror((int)err));
    if (err == -EOPNOTSUPP && chm_mmap_unsupported())
        fprintf(stderr, "mmap_chm: %s\n", chm_mmap_unsupported());
    return 1;
}

static uint64_t pattern(size_t i)
{
    return (uint64_t)i * 0x9e3779b97f4a7c15ull + 1;
}

int main(int argc, char **argv)
{
    size_t len = (size_t)(argc > 2 ? strtoull(argv[2], NULL, 10) : 8) << 20;
    chm_dev *dev;
    int ret = chm_open(argc > 1 ? argv[1] : NULL, &dev);
    if (ret < 0)
        return fail("chm_open", ret);

    void *p;
    if ((ret = chm_mmap_range(dev, MAP_ADDR, len, &p, 0)) < 0)
        return fail("chm_mmap_range", ret);
    uint64_t *words = p;
    size_t n = len / sizeof *words;
    for (size_t i = 0; i < n; i++)   /* plain stores: each page's first one faults, the rest do not */
        words[i] = pattern(i);
    printf("wrote %zu bytes through the mapping at %p\n", len, p);
    if ((ret = chm_munmap(dev, p)) < 0)
        return fail("chm_munmap", ret);

    if ((ret = chm_mmap_range(dev, MAP_ADDR, len, &p, 0)) < 0)
        return fail("chm_mmap_range (again)", ret);
    words = p;
    size_t wrong = 0;
    for (size_t i = 0; i < n; i++)
        wrong += words[i] != pattern(i);
    printf("mapped again at %p: %zu of %zu words wrong\n", p, wrong, n);

    uint64_t back[512];
    ssize_t got = chm_read(dev, MAP_ADDR + len - sizeof back, back, sizeof back);
    if (got < 0)
        return fail("chm_read", got);
    int agree = memcmp(back, (char *)p + len - sizeof back, sizeof back) == 0;
    printf("chm_read of the last %zu bytes: %s\n", sizeof back, agree ? "match" : "MISMATCH");

    struct chm_stats st;
    if ((ret = chm_get_stats(dev, &st)) < 0)
        return fail("chm_get_stats", ret);
    printf("map_faults=%llu map_write_faults=%llu map_punches=%llu page_hits=%llu page_misses=%llu\n",
           (unsigned long long)st.map_faults, (unsigned long long)st.map_write_faults,
           (unsigned long long)st.map_punches, (unsigned long long)st.page_hits, (unsigned long long)st.page_misses);
    chm_munmap(dev, p);
    chm_close(dev);
    return wrong || !agree;
}
