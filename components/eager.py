"""outside_compile: run a function eagerly, outside torch.compile's graphs.

For code whose shapes change every step (MoE token splits) or that talks to other ranks in a
data-dependent way (expert-parallel all-to-alls, context-parallel rings): compiling it would
recompile each step or break the graph anyway.
"""

import torch

# A decorator (a graph break at the call). torch._disable_dynamo is torch's lazy form of
# torch.compiler.disable (private): it imports the compiler at the first call, not at import, so
# importing Kiln stays ~0.5 s per process cheaper.
outside_compile = torch._disable_dynamo
