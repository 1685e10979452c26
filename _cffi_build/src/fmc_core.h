/* Public C API of the flagcx_mc core.  The declarations live in core_cdefs.h so that the cffi
 * cdef and the C compiler read the very same text. */
#ifndef FMC_CORE_H
#define FMC_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "core_cdefs.h"

#endif
