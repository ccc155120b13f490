/*
 * chm_stats.h -- the device's statistics fields: the one list of them.
 *
 * The wire's struct chm_wire_stats (chm_wire.h), libchm's public struct
 * chm_stats (chm.h) and the emulator's counter names (driver.wire.STATS_COUNTERS,
 * the keys of Controller.stats) are all made from these two lists; the cffi
 * builds expand them (driver/wire_build.py: expand_stats_fields). Every field
 * is a uint64_t. Append only: a field's position is its place on the wire.
 */
#ifndef CHM_STATS_H
#define CHM_STATS_H

/* Counters: events since the device started, kept by the controller. */
#define CHM_STATS_COUNTERS(X) \
    X(reads) X(writes) X(prefetches) X(releases) X(flush_calls) \
    X(read_bytes) X(write_bytes) X(hit_bytes) X(prefetch_bytes) \
    X(ssd_read_bytes) X(ssd_write_bytes) \
    X(page_hits) X(page_misses) X(merged_misses) X(refused_writes) X(evictions) \
    X(flush_batches) X(flushed_pages) \
    X(prefetch_staged_pages) X(prefetch_resident_pages) X(refused_write_bytes) X(rmw_reads) \
    X(dirty_evictions) X(media_errors) X(flush_failures) X(media_refused_writes) \
    X(read_failures) X(lost_pages)

/* Gauges: the state now. clients: queue pairs attached; clock_ns: the asking
 * handle's virtual clock (modelled ns). */
#define CHM_STATS_GAUGES(X) \
    X(dirty_pages) X(prefetch_pages_held) X(clients) X(clock_ns)

/* chm_mmap's counters, kept by the device server (emulator/serve/mapping.py): faults served (a mapped page's
 * first touch per residency, and first writes), leases not acked in time, clients cut off for that, frames
 * punched out of clients' mappings before reuse, and writable pages write-protected before a snapshot. */
#define CHM_STATS_MAP(X) \
    X(map_faults) X(map_write_faults) X(map_leases_expired) X(map_clients_cut_off) X(map_punches) \
    X(map_writeprotects)

#define CHM_STATS_FIELDS(X) CHM_STATS_COUNTERS(X) CHM_STATS_GAUGES(X) CHM_STATS_MAP(X)
#define CHM_STATS_U64(name) uint64_t name;

#endif
