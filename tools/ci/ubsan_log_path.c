/*
 * Preloaded (after the ASan runtime) into every process of the sanitizer job, tools/ci/sanitize.py: sends
 * UBSan's reports to files, as ASan's go to its log_path.
 *
 * With both sanitizers (gcc links two runtimes, libasan and libubsan) UBSan ignores log_path and writes to
 * fd 2, which a test captures or discards, or a dying process takes with it. libubsan's own
 * __sanitizer_set_report_path (not ASan's, which the preload makes the first definition) sends them to
 * $CHM_UBSAN_LOG_PATH.<pid>. $CHM_UBSAN_RUNTIME names the libubsan that the sanitized builds link.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

__attribute__((constructor)) static void route_ubsan_reports(void)
{
    const char *path = getenv("CHM_UBSAN_LOG_PATH"), *runtime = getenv("CHM_UBSAN_RUNTIME");
    if (!path || !runtime)
        return;
    void *ubsan = dlopen(runtime, RTLD_NOW | RTLD_GLOBAL);
    void (*set_report_path)(const char *) =
        ubsan ? (void (*)(const char *))dlsym(ubsan, "__sanitizer_set_report_path") : NULL;
    if (!set_report_path) {
        fprintf(stderr, "ubsan_log_path: cannot route UBSan's reports: %s\n", dlerror());
        exit(1);
    }
    set_report_path(path);
}
