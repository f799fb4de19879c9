"""What model code calls inside the parallel step; each hook is the identity outside it.

- :mod:`zoo.hooks.step`: the traced step's state and its collectives (FSDP's per-layer gather,
  the tensor-parallel sum, context parallelism, varying-axis types, the remat policy);
- :mod:`zoo.hooks.pipeline`: a layer stack run as pipeline stages (GPipe and interleaved);
- :mod:`zoo.hooks.vocab`: the embedding and loss head with the vocabulary split over devices;
- :mod:`zoo.hooks.products`: terms a model wrapper adds to a named product (LoRA's dropout path).

Model code imports these and nothing of :mod:`zoo.parallel`, which builds the mesh and enters
the step around the model call.
"""

from zoo.hooks.step import *  # noqa: F403  (zoo.hooks.X: the hooks' names before the package split)
from zoo.hooks.step import __all__  # noqa: F401
