// A user kernel library as a user would write one: it includes only the C ABI
// header. Tests load these by symbol.
#include <cstdio>

#include "tandem/kernel_abi.h"

extern "C" {

// out[i] = x[i] + 1 for contiguous float32 vectors.
int user_add_one(const td_args* args, char* err, size_t err_len) {
  if (args->n_tensors != 2) {
    std::snprintf(err, err_len, "user_add_one: expected 2 tensors, got %d", args->n_tensors);
    return 1;
  }
  const td_tensor& x = args->tensors[0];
  const td_tensor& out = args->tensors[1];
  if (x.dtype != TD_FLOAT32 || out.dtype != TD_FLOAT32 || x.ndim != 1 || out.ndim != 1 || x.shape[0] != out.shape[0]) {
    std::snprintf(err, err_len, "user_add_one: expected two float32 vectors of one length");
    return 1;
  }
  const float* xp = static_cast<const float*>(x.data);
  float* op = static_cast<float*>(out.data);
  for (int64_t i = 0; i < x.shape[0]; ++i) op[i * out.strides[0]] = xp[i * x.strides[0]] + 1.0f;
  return 0;
}

// Always fails, with a message: for failure-isolation tests.
int user_fail(const td_args* args, char* err, size_t err_len) {
  std::snprintf(err, err_len, "user_fail: failing on purpose");
  return 7;
}

}
