/* Write admission (write_buffer.WriteAdmission): pages of the write buffer taken and given back. */
#include "chm_core_internal.h"

int chm_admission_admit(struct chm_admission *a, uint64_t pages)
{
    uint64_t free_pages = a->capacity_pages - a->used_pages;
#if CHM_MUTATION == CHM_MUTATION_EXACT_FIT
    if (pages >= free_pages)
#else
    if (pages > free_pages)
#endif
        return 0;
    a->used_pages += pages;
    return 1;
}

int chm_admission_release(struct chm_admission *a, uint64_t pages)
{
    if (pages > a->used_pages)
        return CHM_E_ARG;
    a->used_pages -= pages;
    return CHM_OK;
}
