/*
 * A stress client for tests/system: random-size writes and reads in its own
 * region checked against a reference copy in its own memory, and reads of
 * the shared region checked against its known pattern.
 *
 *   stress_client NODE SEED OWN_ADDR OWN_SIZE SHARED_ADDR SHARED_SIZE SECONDS
 * Prints "ops=N mismatches=M refused=R" and exits 0 if M == 0.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <chm.h>

static uint64_t rng_state;

static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static uint8_t shared_byte(uint64_t offset)
{
    return (uint8_t)(offset * 2654435761u >> 13);
}

int main(int argc, char **argv)
{
    if (argc != 8) {
        fprintf(stderr, "usage: %s NODE SEED OWN_ADDR OWN_SIZE SHARED_ADDR SHARED_SIZE SECONDS\n", argv[0]);
        return 2;
    }
    const char *node = argv[1];
    rng_state = strtoull(argv[2], NULL, 0) | 1;
    uint64_t own = strtoull(argv[3], NULL, 0), own_size = strtoull(argv[4], NULL, 0);
    uint64_t shared = strtoull(argv[5], NULL, 0), shared_size = strtoull(argv[6], NULL, 0);
    double seconds = atof(argv[7]);

    chm_dev *dev;
    int ret = chm_open(node, &dev);
    if (ret < 0) {
        fprintf(stderr, "chm_open: %s\n", chm_strerror(ret));
        return 1;
    }
    uint8_t *ref = calloc(1, own_size), *buf = malloc(own_size), *data = malloc(own_size);
    /* The region starts as whatever the device holds: read it as the reference. */
    if (chm_read(dev, own, ref, own_size) != (ssize_t)own_size)
        return 1;
    unsigned long ops = 0, mismatches = 0, refused = 0;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        uint64_t len = 1 + rnd() % (own_size / 4), off = rnd() % (own_size - len + 1);
        switch (rnd() % 3) {
        case 0:
            for (uint64_t i = 0; i < len; i++)
                data[i] = (uint8_t)rnd();
            ret = (int)chm_write(dev, own + off, data, len);
            if (ret == -EAGAIN) {
                refused++;
                usleep(200);
            } else if (ret == (int)len) {
                memcpy(ref + off, data, len);
            } else {
                fprintf(stderr, "chm_write: %s\n", chm_strerror(ret));
                return 1;
            }
            break;
        case 1:
            if (chm_read(dev, own + off, buf, len) != (ssize_t)len)
                return 1;
            mismatches += memcmp(buf, ref + off, len) != 0;
            break;
        default: {
            uint64_t slen = 1 + rnd() % (shared_size / 2), soff = rnd() % (shared_size - slen + 1);
            uint8_t *sbuf = slen <= own_size ? buf : malloc(slen);
            if (chm_read(dev, shared + soff, sbuf, slen) != (ssize_t)slen)
                return 1;
            for (uint64_t i = 0; i < slen; i++)
                if (sbuf[i] != shared_byte(soff + i)) {
                    mismatches++;
                    break;
                }
            if (sbuf != buf)
                free(sbuf);
        }
        }
        ops++;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
    /* A final full comparison of the own region. */
    if (chm_read(dev, own, buf, own_size) != (ssize_t)own_size)
        return 1;
    mismatches += memcmp(buf, ref, own_size) != 0;
    printf("ops=%lu mismatches=%lu refused=%lu\n", ops, mismatches, refused);
    chm_close(dev);
    return mismatches != 0;
}
