/* Timing resources, as emulator/timing.py specifies them, operation for operation: pipes, clocked units,
 * latency histograms, SSDs. (pipe_piece, clocked_plan and clocked_commit are chm_core_internal.h's.) */
#include "chm_core_internal.h"

_Static_assert(CHM_HIST_SUB_BUCKETS == 1 << CHM_HIST_SUB_BITS, "sub-buckets per power of two");
_Static_assert(CHM_HIST_BUCKETS == (64 - CHM_HIST_SUB_BITS + 1) * CHM_HIST_SUB_BUCKETS, "buckets for every uint64");

double chm_pipe_transfer(struct chm_pipe *p, double ready, uint64_t nbytes, double slowdown)
{
    return pipe_piece(p, ready, nbytes, slowdown, p->latency_ns * slowdown);
}

double chm_clocked_run(struct chm_clocked *c, double ready, uint64_t cycles)
{
    double occupancy, end = clocked_plan(c, ready, cycles, &occupancy);
    clocked_commit(c, end, occupancy);
    return end;
}

void chm_histogram_init(struct chm_histogram *h)
{
    memset(h, 0, sizeof(*h));
    h->min_ns = 1.0 / 0.0;
    h->max_ns = -1.0 / 0.0;
}

uint32_t chm_histogram_bucket(uint64_t ns)
{
    if (ns < CHM_HIST_SUB_BUCKETS)
        return (uint32_t)ns;
    unsigned shift = (unsigned)(64 - __builtin_clzll(ns)) - CHM_HIST_SUB_BITS - 1;  /* bit_length - 6 */
    return (shift << CHM_HIST_SUB_BITS) + (uint32_t)(ns >> shift);
}

void chm_histogram_add(struct chm_histogram *h, double latency_ns)
{
    uint64_t ns = !(latency_ns > 0) ? 0 : latency_ns >= 18446744073709551616.0 ? UINT64_MAX : (uint64_t)latency_ns;
    h->counts[chm_histogram_bucket(ns)]++;
    h->count++;
    h->total_ns += latency_ns;
    if (latency_ns < h->min_ns)
        h->min_ns = latency_ns;
    if (latency_ns > h->max_ns)
        h->max_ns = latency_ns;
}

/* -- an SSD (timing.SsdModel) -- */

/* heapq's _siftdown and _siftup, so the heaps are laid out as Python's are under the same calls. */
static void heap_siftdown(double *heap, uint64_t startpos, uint64_t pos)
{
    double newitem = heap[pos];
    while (pos > startpos) {
        uint64_t parentpos = (pos - 1) >> 1;
        double parent = heap[parentpos];
        if (!(newitem < parent))
            break;
        heap[pos] = parent;
        pos = parentpos;
    }
    heap[pos] = newitem;
}

static void heap_siftup(double *heap, uint64_t endpos, uint64_t pos)
{
    uint64_t startpos = pos, childpos = 2 * pos + 1;
    double newitem = heap[pos];
    while (childpos < endpos) {
        uint64_t rightpos = childpos + 1;
        if (rightpos < endpos && !(heap[childpos] < heap[rightpos]))
            childpos = rightpos;
        heap[pos] = heap[childpos];
        pos = childpos;
        childpos = 2 * pos + 1;
    }
    heap[pos] = newitem;
    heap_siftdown(heap, startpos, pos);
}

static void heap_replace(double *heap, uint64_t n, double item)  /* heapq.heapreplace */
{
    heap[0] = item;
    heap_siftup(heap, n, 0);
}

int chm_ssd_new(uint32_t parallelism, double read_latency_ns, double write_latency_ns, double slowdown,
                double read_bandwidth_gbps, double write_bandwidth_gbps, struct chm_ssd **out)
{
    if (!parallelism)
        return CHM_E_ARG;
    struct chm_ssd *s = calloc(1, sizeof *s);
    if (!s)
        return CHM_E_NOMEM;
    s->slots = calloc(parallelism, sizeof *s->slots);
    if (!s->slots) {
        free(s);
        return CHM_E_NOMEM;
    }
    s->parallelism = parallelism;
    s->read_latency_ns = read_latency_ns;
    s->write_latency_ns = write_latency_ns;
    s->slowdown = slowdown;
    s->read_media.bandwidth_gbps = read_bandwidth_gbps;
    s->write_media.bandwidth_gbps = write_bandwidth_gbps;
    *out = s;
    return CHM_OK;
}

void chm_ssd_free(struct chm_ssd *s)
{
    if (!s)
        return;
    free(s->slots);
    free(s->read_finishes);
    free(s);
}

int chm_ssd_reserve(struct chm_ssd *s, uint64_t reads)
{
    if (reads <= s->read_finishes_cap - s->n_read_finishes)
        return CHM_OK;
    uint64_t cap = s->read_finishes_cap ? s->read_finishes_cap : 16;
    while (cap - s->n_read_finishes < reads) {
        if (cap > UINT64_MAX / 2 / sizeof(double))
            return CHM_E_NOMEM;
        cap *= 2;
    }
    double *grown = realloc(s->read_finishes, cap * sizeof *grown);
    if (!grown)
        return CHM_E_NOMEM;
    s->read_finishes = grown;
    s->read_finishes_cap = cap;
    return CHM_OK;
}

/* max(ready, slots[0]), as Python's max picks */
static double ssd_start(const struct chm_ssd *s, double ready)
{
    return s->slots[0] > ready ? s->slots[0] : ready;
}

double chm_ssd_read(struct chm_ssd *s, double ready, uint64_t nbytes)
{
    if (chm_ssd_reserve(s, 1))
        return 0.0 / 0.0;
    double start = ssd_start(s, ready);
    double slow = start < s->writes_until ? s->slowdown : 1.0;
    s->slowed_reads += slow > 1.0;
    double finish = chm_pipe_transfer(&s->read_media, start + s->read_latency_ns * slow, nbytes, slow);
    heap_replace(s->slots, s->parallelism, finish);
    s->read_finishes[s->n_read_finishes] = finish;  /* heapq.heappush */
    heap_siftdown(s->read_finishes, 0, s->n_read_finishes++);
    if (finish > s->reads_until)
        s->reads_until = finish;
    return finish;
}

double chm_ssd_write(struct chm_ssd *s, double ready, uint64_t nbytes)
{
    double start = ssd_start(s, ready);
    double finish = chm_pipe_transfer(&s->write_media, start + s->write_latency_ns, nbytes, 1.0);
    heap_replace(s->slots, s->parallelism, finish);
    if (finish > s->writes_until)  /* max(writes_until, finish) */
        s->writes_until = finish;
    return finish;
}

uint64_t chm_ssd_reads_in_flight(struct chm_ssd *s, double now)
{
    double *heap = s->read_finishes;
    while (s->n_read_finishes && heap[0] <= now) {  /* heapq.heappop */
        double last = heap[--s->n_read_finishes];
        if (s->n_read_finishes) {
            heap[0] = last;
            heap_siftup(heap, s->n_read_finishes, 0);
        }
    }
    return s->n_read_finishes;
}
