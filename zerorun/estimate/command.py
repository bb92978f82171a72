"""``zerorun estimate``'s entry point: arguments or a recipe to an :class:`Estimate`, and the machine's memory."""

from __future__ import annotations

from zerorun.errors import ZerorunError
from zerorun.estimate.hosts import choose, detect_memory  # noqa: F401 - detect_memory: the package's API
from zerorun.estimate.layout import layout_of_count, layout_of_recipe
from zerorun.estimate.policies import OFFLOADS, optimizer_model, precision_of
from zerorun.estimate.report import Estimate, Setup, estimate
from zerorun.estimate.sizes import check_ranks, parse_bandwidth, parse_bytes, parse_count


def from_arguments(*, recipe: str | None, overrides: list[str], hostfile: str | None, params: str | None,
                   largest_layer: str | None, nodes: int | None, procs_per_node: int | None, precision: str | None,
                   optimizer: str | None, device_memory: str | None, cpu_memory: str | None, bandwidth: str,
                   micro_batch: int | None, offload: str | None = None, ssh=None) -> Estimate:
    """The :class:`Estimate` for ``zerorun estimate``'s arguments (strings as typed; see ``zerorun estimate
    --help``): a recipe (with overrides) or ``params``, the hostfile or ``nodes`` x ``procs_per_node``, sizes
    parsed with :func:`parse_count`, :func:`parse_bytes` and :func:`parse_bandwidth`. A recipe gives the
    precision, ``zero.reduce_dtype``, ``zero.offload_optimizer`` (when it sets it; else every variant, as
    without a recipe: ``all``), ``zero.offload_buffer_mb`` and ``zero.grad_accum_dtype`` (Note [Gradient
    accumulation buffer]); ``precision`` and ``offload`` override them. The memory per rank and per node:
    ``device_memory``/``cpu_memory``, else ``hostfile``'s hosts' (asked over SSH with ``ssh``, a
    ``SshOptions``), else this machine's (Note [Whose memory] in estimate/hosts.py).

    Raises:
        ZerorunError: neither or both of ``recipe`` and ``params``; ``largest_layer`` without ``params``, or
            more than it; a bad recipe, hostfile, model module or flag value (the message names the file, field
            or flag); a host of ``hostfile`` that does not tell its memory.
    """
    _check_sources(recipe, params, largest_layer)
    hosts = None
    if hostfile:  # the layout zerorun train could launch on it: no more nodes than hosts, ranks than slots
        from zerorun.recipe.hostfile import read_hostfile, select_hosts

        hosts = select_hosts(read_hostfile(hostfile), num_nodes=nodes, num_procs=procs_per_node,
                             nodes_flag=f"--nodes {nodes}", procs_flag=f"--procs-per-node {procs_per_node}")
        nodes = procs_per_node = None  # the selected hosts say both, each host its own slots
    if offload is not None and offload not in OFFLOADS:
        raise ZerorunError(f"--offload: {offload!r} is not one of {', '.join(OFFLOADS)}")
    r, layout, prec, offload = _model(recipe, overrides, params, largest_layer, precision, offload)
    ppn = _procs_per_node(procs_per_node, hosts, r)
    check_ranks(nodes or (len(hosts) if hosts else 1), ppn)
    memory = choose(hostfile=hostfile, ssh=ssh, procs_per_node=ppn,
                    device_memory=None if device_memory is None else parse_bytes(device_memory, "--gpu-memory"),
                    host_memory=None if cpu_memory is None else parse_bytes(cpu_memory, "--host-memory"))
    setup = Setup(
        nodes=nodes or (len(hosts) if hosts else 1), procs_per_node=ppn,
        world_size=sum(h.slots for h in hosts) if hosts and not (nodes or procs_per_node) else None,
        precision=prec, optimizer=_optimizer(optimizer, r), device_memory=memory.device_bytes, device=memory.device,
        cpu_memory=memory.host_bytes, bandwidth=parse_bandwidth(bandwidth, "--bandwidth"),
        micro_batch=micro_batch or (r.train.micro_batch_size if r else 1),
        seq_len=r.data.seq_len if r else None, grad_accum_steps=r.train.grad_accum_steps if r else 1,
        bucket_mb=r.zero.bucket_mb if r else 25.0, prefetch=r.zero.prefetch if r else True,
        prefetch_bytes=r.zero.prefetch_bytes if r else None,
        activation_checkpointing=r.train.activation_checkpointing if r else False, offload=offload or "all",
        offload_buffer_mb=r.zero.offload_buffer_mb if r else 64.0,
        grad_accum_dtype=r.zero.grad_accum_dtype if r else None,
        offload_params=bool(r) and r.zero.offload_params == "disk", memory_source=memory.source,
        node_ranks=tuple(h.slots for h in hosts) if hosts and not (nodes or procs_per_node) else (),
        hierarchy=r.zero.hierarchy if r else None,
        quantize_block=r.zero.quantize_block if r and r.zero.quantize_weights else None,
        grad_quantize=(8 if r.zero.quantize_grads == "int8" else 4, r.zero.quantize_block)
        if r and r.zero.quantize_grads else None)
    return estimate(layout, setup)


def _check_sources(recipe: str | None, params: str | None, largest_layer: str | None) -> None:
    """Raises ZerorunError: neither or both of a recipe and ``--params``; ``--largest-layer`` without
    ``--params``."""
    if recipe is None and params is None:
        raise ZerorunError("estimate: give a recipe file or --params")
    if recipe is not None and params is not None:
        raise ZerorunError("estimate: give a recipe file or --params, not both")
    if largest_layer is not None and params is None:  # was ignored: a recipe's units are counted from its model
        raise ZerorunError("--largest-layer: only with --params (a recipe's largest unit is counted from its model)")


def _model(recipe: str | None, overrides: list[str], params: str | None, largest_layer: str | None,
           precision: str | None, offload: str | None):
    """``(recipe or None, layout, precision, offload)``: the model's layout from the recipe (its precision and
    ``zero.offload_optimizer`` unless the flags give them) or from ``--params``/``--largest-layer``.

    Raises:
        ZerorunError: a bad recipe or override, overrides without a recipe, a bad count, a largest layer larger
            than the model.
    """
    if recipe is not None:
        from zerorun.recipe import load_recipe

        r = load_recipe(recipe, overrides or [])
        prec = precision_of(precision or r.precision, r.zero.reduce_dtype)
        if offload is None and "offload_optimizer" in r.zero.model_fields_set:
            offload = r.zero.offload_optimizer
        return r, layout_of_recipe(r, prec.name), prec, offload
    if overrides:
        raise ZerorunError(f"estimate: overrides ({overrides[0]}) need a recipe")
    largest = parse_count(largest_layer, "--largest-layer") if largest_layer is not None else None
    total = parse_count(params, "--params")
    if largest is not None and largest > total:
        raise ZerorunError(f"--largest-layer: {largest_layer} is more parameters than the whole model "
                           f"(--params {params})")
    return None, layout_of_count(total, largest), precision_of(precision or "fp32"), offload


def _procs_per_node(procs_per_node: int | None, hosts, r) -> int:
    """Ranks per node: the flag, else the hostfile's largest slots, else the recipe's ``launch.procs_per_node``
    (a word, ``auto``/``gpu``/``cpu``, counted here with a note on stderr: Note [Ranks per node] in
    zerorun/launch/slots.py), else 1."""
    ppn = procs_per_node or (max(h.slots for h in hosts) if hosts else (r.launch.procs_per_node if r else 1))
    if isinstance(ppn, str):
        import sys

        from zerorun.launch.slots import assumed

        ppn, note = assumed(ppn, "launch.procs_per_node")
        sys.stderr.write(f"zerorun: estimate: {note}\n")
    return ppn


def _optimizer(optimizer: str | None, r):
    """The optimizer's state model: ``--optimizer``, else the recipe's ``train.optimizer``, else Adam."""
    if optimizer is not None:
        return optimizer_model(optimizer)
    if r is not None:
        return optimizer_model(r.train.optimizer.name, r.train.optimizer.kwargs(), "train.optimizer.name")
    return optimizer_model("adam")
