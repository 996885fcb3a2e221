/* offload_native.h: the whole C ABI of the offload native library.
 *
 * A handful of functions on raw pointers and sizes, loaded by offload/_native.py with
 * ctypes (which releases the GIL for every call). No Python or torch headers. Every
 * function returns 0 on success or a negative errno-style code; nothing here allocates
 * memory that the caller must free except through the matching *_destroy function.
 */
#ifndef OFFLOAD_NATIVE_H
#define OFFLOAD_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#define OFFLOAD_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

/* ---- common ------------------------------------------------------------------------ */
OFFLOAD_API int offload_abi_version(void);

/* ---- CPU Adam (native/adam.c) --------------------------------------------------------- */
/* BEGIN ADAM SECTION */
/* END ADAM SECTION */

/* ---- I/O engine and checksums (native/aio.c, native/crc32c.c) ---------------------------- */
/* BEGIN AIO SECTION */
/* END AIO SECTION */

#ifdef __cplusplus
}
#endif
#endif
