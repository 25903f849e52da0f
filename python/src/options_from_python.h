#pragma once
/// ShampooOptions and DistributedOptions from the flat dictionaries that the Python layer
/// (distributed_shampoo_cpp/_translate.py) builds out of the reference's keyword arguments and
/// config objects. Every key is required; a missing key or a value of the wrong type is an error
/// naming the key. The Python layer has already refused what the engine does not support.

#include <pybind11/pybind11.h>

#include "shampoo/shampoo_options.h"

namespace shampoo::python {

ShampooOptions shampoo_options_from(const pybind11::dict& options);

/// `process_group`: None or a torch.distributed ProcessGroup.
DistributedOptions distributed_options_from(const pybind11::dict& options,
                                            const pybind11::object& process_group);

}  // namespace shampoo::python
