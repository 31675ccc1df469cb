"""The integration tests' fixture: a class-level patch changes a modeling module for the whole
process, so ``restored`` puts back every module attribute and class attribute the patch
functions replace."""

from __future__ import annotations

import importlib

import pytest

import tileops.integrations.transformers as tit

PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
          "mixtral": "Mixtral"}
_ABSENT = object()


@pytest.fixture
def restored():
    """Undo class-level patches after the test: the modeling modules' names and the model
    classes' attributes the patch functions set."""
    saved = []
    for kind, prefix in PREFIX.items():
        modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        for name in (f"{prefix}RMSNorm", f"{prefix}MLP", f"{prefix}RotaryEmbedding",
                     "apply_rotary_pos_emb", f"{prefix}SparseMoeBlock",
                     f"{prefix}BlockSparseTop2MLP"):
            if getattr(modeling, name, _ABSENT) is not _ABSENT:
                saved.append((modeling, name, getattr(modeling, name)))
        for cls_name, attr in ((f"{prefix}ForCausalLM", "loss_function"),
                               (f"{prefix}ForCausalLM", "forward"),
                               (f"{prefix}PreTrainedModel", "get_correct_attn_implementation")):
            cls = getattr(modeling, cls_name)
            saved.append((cls, attr, cls.__dict__.get(attr)))
    originals = dict(tit._originals)
    yield
    for owner, name, value in saved:
        if value is None:
            if name in vars(owner):
                delattr(owner, name)
        else:
            setattr(owner, name, value)
    tit._originals.clear()
    tit._originals.update(originals)
