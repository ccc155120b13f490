/*
 * buffer_mapping: the FFI support of chm.h. A reference from chm_mapping_get
 * keeps chm_buffer() mapped after chm_close (a binding's view may outlive the
 * handle); the last chm_mapping_put unmaps it. Exits 0 (pass), 1 (fail),
 * 77 (skip: no device).
 *
 *   buffer_mapping NODE
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include <chm.h>

#define EXIT_PASS 0
#define EXIT_FAIL 1
#define EXIT_SKIP 77

/* msync fails with ENOMEM on a range that is not mapped: a probe that cannot fault. */
static int is_mapped(void *page)
{
    return msync(page, 4096, MS_ASYNC) == 0;
}

static int fail(const char *what)
{
    fprintf(stderr, "FAIL %s\n", what);
    return EXIT_FAIL;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: buffer_mapping NODE\n");
        return EXIT_FAIL;
    }
    chm_dev *dev;
    int ret = chm_open(argv[1], &dev);
    if (ret == -ENODEV)
        return EXIT_SKIP;
    if (ret < 0)
        return fail(chm_strerror(ret));
    size_t len;
    char *buf = chm_buffer(dev, &len);   /* the staging buffer starts on a page boundary */
    chm_mapping *first = chm_mapping_get(dev), *second = chm_mapping_get(dev);
    if (!buf || !first || first != second)
        return fail("chm_mapping_get on an open handle");
    chm_close(dev);
    if (!is_mapped(buf) || !is_mapped(buf + len - 4096))
        return fail("the buffer was unmapped by chm_close while references were held");
    memcpy(buf, "detached", 8);          /* a held view stays writable; the device no longer reads it */
    chm_mapping_put(first);
    if (!is_mapped(buf))
        return fail("the buffer was unmapped while a reference was left");
    chm_mapping_put(second);
    if (is_mapped(buf) || errno != ENOMEM)
        return fail("the buffer is still mapped after the last reference was put");
    chm_mapping_put(NULL);
    if (chm_mapping_get(NULL) != NULL)
        return fail("chm_mapping_get(NULL)");
    printf("buffer mapping: kept past chm_close, unmapped with the last reference\n");
    return EXIT_PASS;
}
