"""``tileops model``: a whole model on TileOPs, the library working as a whole.

``tileops model llama`` runs the Llama benchmarks of the repository (``benchmarks/llama.py``:
the training step, and ``--decode``: greedy decode over the paged KV cache), each against
the unpatched model, and prints their tables. The benchmarks are scripts of the source
checkout, not of the installed package (they are what the GPU runs report), so the command
imports them from the checkout this package was installed from and says so where there is
none. Where CUDA is absent (or with ``--tiny``) it runs their tiny mode: the CPU, the ops'
reference target, a tiny float32 model, against eager only.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tempfile
from pathlib import Path

import click
import torch

__all__ = ["model"]

#: the checkout's benchmarks folder: this file is packages/ops/src/tileops/ops/cli/model.py
BENCHMARKS = Path(__file__).resolve().parents[6] / "benchmarks"
MODELS = ("llama",)
#: the extra the integration needs (``tileops.integrations.transformers.EXTRA``; the command
#: line is a layer below the integrations and does not import them, the benchmarks do)
EXTRA = "tileops-ops[transformers]"


def _fail(text: str) -> None:
    click.echo(f"tileops model: {text}", err=True)
    sys.exit(2)


def _benchmark(name: str):
    """The benchmark script ``name`` of the checkout, imported as the scripts import their
    siblings (their folder first on the path)."""
    if not (BENCHMARKS / f"{name}.py").is_file():
        _fail(f"needs the source checkout's benchmarks ({BENCHMARKS / f'{name}.py'} is not "
              f"there): run it from a checkout installed with pip install -e")
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


@click.command("model")
@click.argument("name", metavar="MODEL", type=click.Choice(MODELS))
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="decoder layers (default: the benchmarks' 4, 2 in the tiny mode)")
@click.option("--train", "train", is_flag=True, help="only the training step")
@click.option("--decode", "decode", is_flag=True, help="only greedy decode (paged KV cache)")
@click.option("--tiny", is_flag=True,
              help="the tiny CPU mode even where CUDA is available")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="results folder (default: a new temporary one)")
def model(name: str, layers: int | None, train: bool, decode: bool, tiny: bool,
          out: Path | None) -> None:
    """Run a Hugging Face MODEL patched onto TileOPs: the training step and greedy decode
    against the unpatched model (torch eager, torch.compile, Liger-Kernel where installed),
    printing each benchmark's table. Both modes unless --train or --decode picks one. Exits
    1 when a benchmark's TileOPs contender fails a check, 2 on bad usage or a missing extra."""
    if importlib.util.find_spec("transformers") is None:
        _fail(f"transformers is not installed; install the extra: pip install '{EXTRA}'")
    modes = [m for m, on in (("train", train), ("decode", decode)) if on] or ["train", "decode"]
    if not tiny and not torch.cuda.is_available():
        click.echo("no CUDA device: the tiny CPU mode, through the reference target")
        tiny = True
    out = out if out is not None else Path(tempfile.mkdtemp(prefix="tileops-model-"))
    bench = _benchmark(name)
    common = [] if layers is None else ["--layers", str(layers)]
    common += ["--out", str(out)]
    status = 0
    for mode in modes:
        argv = list(common)
        if mode == "decode":
            argv.append("--decode")
        if tiny:  # against eager only: torch.compile's compiles would take most of the run
            argv += ["--dry-run", "--against", "eager"]
            if mode == "train":
                argv += ["--steps", "3", "--warmup", "1"]
        click.echo(f"== {name} {mode}: benchmarks/{name}.py {' '.join(argv)}", err=True)
        status = max(status, bench.main(argv))
    sys.exit(status)
