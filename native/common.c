/* common.c: library-wide entry points. */
#include "offload_native.h"

#define OFFLOAD_ABI_VERSION 11

OFFLOAD_API int offload_abi_version(void) { return OFFLOAD_ABI_VERSION; }
