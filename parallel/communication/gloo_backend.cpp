// The only translation unit that includes ProcessGroupGloo.hpp. The torch wheel ships that header
// but not the gloo headers it includes; they come from Debian's libgloo-dev. This file must not
// emit any gloo code or data: all it does is call ProcessGroupGloo's out-of-line constructor and
// Options::create_default in libtorch_cpu and hold the result through c10d::Backend, so the gloo
// that runs is the one built into libtorch, whatever version of the headers compiled this file.
// tests/parallel/gloo_object_check.cmake fails the build's tests if this object references or
// defines any gloo:: symbol.
#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "parallel/communication/process_group.h"

namespace shampoo::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace shampoo::detail
