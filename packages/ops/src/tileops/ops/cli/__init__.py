"""The ``tileops`` command: run, benchmark and inspect the operators.

    tileops run [OP...]            every implemented op on its spec workloads, checked against
                                   float64, with times and the roofline
    tileops bench OP [OP...]       side by side with the op's contenders (torch eager,
                                   torch.compile, peers such as Liger): JSON, Markdown, PNG
    tileops list                   ops, families, status, dtypes, the targets that serve them
    tileops explain OP [--code]    the signature, type families, effects, roofline, every
                                   workload (family grids expanded), and the generated check code
    tileops check [PATH...]        validate specs (file:line errors)
    tileops scaffold OP            write the op module skeleton for a spec entry
    tileops env                    versions, GPUs, the cache directory, environment knobs
    tileops cache clear            empty the cache directory
    tileops model llama            a Hugging Face model patched onto the ops: its training step
                                   and greedy decode against the unpatched model

Also ``python -m tileops.ops.cli``. Exit status: 0 success, 1 a failed check (a mismatch, an
invalid spec, an op that failed), 2 bad usage (an unknown op, device, dtype or option).

One module a command or concern: :mod:`.run`, :mod:`.bench` (the harness) and :mod:`.report`
(its JSON, Markdown and plot), :mod:`.explain` (list, explain, check), :mod:`.scaffold`,
:mod:`.cache` (env, cache); beneath them :mod:`.driver` (what run and bench share),
:mod:`.runner` (one case), :mod:`.timing`, :mod:`.formatting` and :mod:`.core` (usage errors,
op, device, dtype and target lookup). The workloads themselves are
:mod:`tileops.ops.workloads`, a library module.
"""

from __future__ import annotations

import click

from . import bench, cache, explain, model, run, scaffold

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tileops-ops", prog_name="tileops",
                      message="%(prog)s %(version)s")
def main() -> None:
    """TileOPs: spec-driven GPU operators for PyTorch.

    `tileops run` runs every implemented op on its spec workloads (on the CPU through the
    reference target when there is no GPU) and checks each against float64.
    """


# the modules stay reachable under their names (tileops.ops.cli.bench is the module)
for _command in (run.run, bench.bench, explain.list_ops, explain.explain, explain.check,
                 scaffold.scaffold, cache.env_cmd, cache.cache, model.model):
    main.add_command(_command)
