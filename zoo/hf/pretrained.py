"""Kept for old imports: ``zoo.hf.pretrained`` was loading, saving and the atomic directory swap in
one module; they are now :mod:`zoo.hf.load` (``from_pretrained``, config reading),
:mod:`zoo.hf.save` (``save_pretrained``), :mod:`zoo.hf.stored` (a model's stored tensors) and
:mod:`zoo.hf.atomic` (the directory swap). Import from those.
"""

from zoo.hf.load import DTYPE_NAMES, from_pretrained, hf_config, load_arrays, read_config, read_generation_config
from zoo.hf.save import check_save_path, save_pretrained
from zoo.hf.stored import GATHER_BYTES

__all__ = [
    "DTYPE_NAMES", "GATHER_BYTES", "check_save_path", "from_pretrained", "hf_config", "load_arrays", "read_config",
    "read_generation_config", "save_pretrained",
]  # fmt: skip
