"""torch dtype -> spec dtype name, for building kernel call specs: the signature package's
torch adapter already holds the mapping."""

from tileops.signature import torch_adapter

NAMES = torch_adapter().names
