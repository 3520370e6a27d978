// The C++ side of the extension: declarations of the CUDA entry points and the
// eager autograd function. load_inline binds the names in `functions=` to Python.
#include <string>
#include <vector>

std::vector<at::Tensor> forward(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                                const c10::optional<at::Tensor>& bias, int64_t groups, double eps,
                                const std::string& kernel, int64_t team);

std::string plan(const at::Tensor& x, int64_t groups, const std::string& kernel, int64_t team);

std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                                 const at::Tensor& rstd, const c10::optional<at::Tensor>& weight,
                                 int64_t groups, bool need_dx, bool need_affine,
                                 const std::string& kernel, int64_t lag);

std::string backward_plan(const at::Tensor& x, int64_t groups, const std::string& kernel,
                          int64_t lag);

#include "autograd.h"
