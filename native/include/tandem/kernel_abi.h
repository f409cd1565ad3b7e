/* Tandem kernel ABI: the plain C contract between the engine and a kernel.
 *
 * A kernel is a function that receives its tensor and scalar arguments and
 * returns 0 on success or a non-zero code after writing a message into `err`.
 * Built-in kernels and kernels loaded by symbol from a user's shared library
 * share this ABI, so a user library needs only this header.
 */
#ifndef TANDEM_KERNEL_ABI_H
#define TANDEM_KERNEL_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TD_ABI_VERSION 1
#define TD_MAX_DIMS 8

typedef enum td_dtype {
  TD_FLOAT32 = 0,
  TD_FLOAT16 = 1,
  TD_BFLOAT16 = 2,
  TD_INT32 = 3,
  TD_INT64 = 4,
  TD_UINT8 = 5
} td_dtype;

typedef enum td_access { TD_READ = 1, TD_WRITE = 2, TD_READWRITE = 3 } td_access;

/* A strided view into device memory. Strides count elements, not bytes. */
typedef struct td_tensor {
  void* data;               /* address of element [0, 0, ...] */
  int32_t dtype;            /* td_dtype */
  int32_t ndim;             /* 0 <= ndim <= TD_MAX_DIMS */
  int32_t access;           /* td_access */
  int32_t reserved;
  int64_t shape[TD_MAX_DIMS];
  int64_t strides[TD_MAX_DIMS];
} td_tensor;

typedef enum td_scalar_kind { TD_SCALAR_INT = 0, TD_SCALAR_FLOAT = 1 } td_scalar_kind;

typedef struct td_scalar {
  int32_t kind; /* td_scalar_kind */
  int32_t reserved;
  union {
    int64_t i;
    double f;
  } value;
} td_scalar;

/* Everything a kernel call receives. Scalars are positional, in the order the
 * kernel's signature declares them. */
typedef struct td_args {
  const td_tensor* tensors;
  int32_t n_tensors;
  int32_t n_scalars;
  const td_scalar* scalars;
  int32_t worker; /* index of the pool worker running the call, -1 off-pool */
  int32_t reserved;
} td_args;

/* Returns 0 on success. On failure writes a NUL-terminated message of at most
 * err_len bytes into err and returns non-zero. */
typedef int (*td_kernel_fn)(const td_args* args, char* err, size_t err_len);

static inline size_t td_dtype_size(int32_t dtype) {
  switch (dtype) {
    case TD_FLOAT32: return 4;
    case TD_FLOAT16: return 2;
    case TD_BFLOAT16: return 2;
    case TD_INT32: return 4;
    case TD_INT64: return 8;
    case TD_UINT8: return 1;
    default: return 0;
  }
}

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_KERNEL_ABI_H */
