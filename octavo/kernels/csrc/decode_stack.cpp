// DecodeStack (decode_stack.h), the decoder layers of a step in one call, and its registration as
// torch.classes.octavo.DecodeStack. A translation unit of its own, beside the kernels'
// (cpu_ops.cpp, whose entry points it calls through ops.h), so that the two compile in parallel.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

#include "layer_ops.h"
#include "stack_linear.h"
#include "decode_stack.h"

TORCH_LIBRARY_FRAGMENT(octavo, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_norms", &DecodeStack::set_norms)
      .def("set_linears", &DecodeStack::set_linears)
      .def("set_query_temperature", &DecodeStack::set_query_temperature)
      .def("set_latent", &DecodeStack::set_latent)
      .def("set_output_gate", &DecodeStack::set_output_gate)
      .def("set_delta_net", &DecodeStack::set_delta_net)
      .def("set_delta_net_spans", &DecodeStack::set_delta_net_spans)
      .def("set_routing", &DecodeStack::set_routing)
      .def("set_mlp", &DecodeStack::set_mlp)
      .def("set_all_reduce", &DecodeStack::set_all_reduce)
      .def("forward", &DecodeStack::forward);
}
