"""The estimate for every stage and offload variant, and the recommendation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from zerorun.estimate.activations import activation_bytes, working_set
from zerorun.estimate.communication import traffic
from zerorun.estimate.hierarchy import gradient_group, group_size, kept_units, secondary_bytes
from zerorun.estimate.layout import Layout
from zerorun.estimate.states import _optimizer_slices, model_states
from zerorun.estimate.policies import OFFLOADS, OptimizerModel, Precision, grad_accum_bytes
from zerorun.estimate.sizes import format_bytes
from zerorun.telemetry.format import count


#: A stage fits when its device total leaves at least this fraction of the device memory free.
MIN_HEADROOM = 0.10

# Note [Peak]: a rank's memory peaks either at the end of forward (model states, all activations, at stage 3
# the gathered units) or during backward, where activations are freed as gradient buckets fill and wait for
# their reduce-scatters. The estimate is model states + gathered units + max(activations, backward transients)
# (benchmarks/estimate_vs_measured.py: stage 1 on gloo, whose pending reduce-scatters each hold a receive buffer
# the size of their bucket, peaks at the end of backward once activations are smaller than the gradients).
# With zero.hierarchy the secondary shards, held from the forward through backward to the step, are added
# (Note [Secondary shards] in zero/hierarchy.py).


# --------------------------------------------------------------------------------------------- report
@dataclass(frozen=True)
class Setup:
    """Everything an estimate depends on besides the model.

    Attributes:
        nodes, procs_per_node: the hosts; world size = ``nodes * procs_per_node`` unless ``world_size`` is set
            (a hostfile whose nodes run different numbers of ranks).
        device_memory: bytes per rank; device: what it is (``"cpu"``: host memory shared by the node's ranks).
        cpu_memory: host bytes per node. bandwidth: bytes per second per rank.
        micro_batch, seq_len, grad_accum_steps, bucket_mb, prefetch, prefetch_bytes, activation_checkpointing: as
            in a recipe.
        grad_accum_dtype: ``zero.grad_accum_dtype`` (``None``: unset; Note [Gradient accumulation buffer]).
        offload: the ``zero.offload_optimizer`` variants to estimate besides no offload: ``none``, ``cpu``,
            ``disk`` or ``all`` (both; on a CPU-only machine disk only). offload_buffer_mb: disk's host buffer.
        offload_params: the recipe sets ``zero.offload_params: disk``: a stage-3 row with the parameters
            offloaded (``params``, or ``disk+params`` with the optimizer's disk offload, which is added
            whenever disk is estimated).
        memory_source: where ``device_memory`` and ``cpu_memory`` came from (Note [Whose memory] in
            estimate/hosts.py), for people.
        node_ranks: the ranks of each node, in order (a hostfile's slots); empty: ``nodes`` of
            ``procs_per_node`` (:attr:`node_layout`).
        hierarchy: ``zero.hierarchy`` (``node``, a number of ranks, or ``None``): the stage-3 rows' secondary
            shards and their all-gathers (Note [Secondary shards] in zero/hierarchy.py).
    """

    nodes: int
    procs_per_node: int
    precision: Precision
    optimizer: OptimizerModel
    device_memory: int
    device: str
    cpu_memory: int
    bandwidth: float
    micro_batch: int = 1
    seq_len: int | None = None
    grad_accum_steps: int = 1
    bucket_mb: float = 25.0
    prefetch: bool = True
    prefetch_bytes: int | None = None
    activation_checkpointing: bool = False
    world_size: int | None = None
    offload: str = "none"
    offload_buffer_mb: float = 64.0
    grad_accum_dtype: str | None = None
    offload_params: bool = False
    memory_source: str = ""
    node_ranks: tuple[int, ...] = ()
    hierarchy: int | str | None = None
    quantize_block: int | None = None  # zero.quantize_weights: int8, this many elements per scale; None: exact
    grad_quantize: tuple[int, int] | None = None  # zero.quantize_grads: (bits, elements per scale); None: exact

    @property
    def grad_accum_bytes(self) -> int:
        """Bytes per element gradients are accumulated in (``policies.grad_accum_bytes``)."""
        return grad_accum_bytes(self.precision, self.grad_accum_steps, self.grad_accum_dtype)

    @property
    def ranks(self) -> int:
        return self.world_size or self.nodes * self.procs_per_node

    @property
    def node_layout(self) -> tuple[int, ...]:
        """The ranks of each node, consecutive in rank order (as the launch plan numbers them)."""
        if self.node_ranks:
            return self.node_ranks
        even = self.nodes * self.procs_per_node == self.ranks
        return (self.procs_per_node,) * self.nodes if even else (self.ranks,)


@dataclass
class StageRow:
    """One stage (and offload variant) of an :class:`Estimate`. Bytes per rank unless named per node."""

    stage: int
    offload: str  # "none", "cpu" (optimizer states + fp32 master slices in host memory) or "disk"
    params: int
    grads: int
    optimizer: int  # in device memory (memory_bytes()["optimizer"]); offloaded: offload_host, offload_disk
    model_states: int
    working_set: int  # gathered + backward (Note [Peak])
    gathered: int
    backward_transient: int
    activations: int
    device_total: int
    headroom: int
    fits: bool
    cpu_per_node: int  # at least the model built in fp32 by every rank at start (Note [Host memory at start])
    disk_per_node: int
    comm_bytes: int  # sent per step
    comm_s: float
    offload_host: int = 0  # per rank: offload_bytes()["host"] (cpu on an accelerator; disk's paging buffer)
    offload_disk: int = 0  # per rank: offload_bytes()["disk"] (the swap file)
    grad_accum: int = 0  # the fp32 gradient accumulation buffer, in model_states (Note [Gradient accumulation buffer])
    comm_bytes_inter_node: int = 0  # of comm_bytes, to ranks on other nodes (Note [Nodes of a group])
    secondary: int = 0  # zero.hierarchy's secondary shards, forward to step, in device_total (Note [Secondary shards])

    @property
    def label(self) -> str:
        return f"{self.stage}" + ("" if self.offload == "none" else f" + offload {self.offload}")


@dataclass
class Estimate:
    """The result of :func:`estimate`: inputs, counts, one :class:`StageRow` per stage/offload variant,
    activations (bytes per micro-batch, or ``None`` without a declared shape) and a recommendation."""

    setup: dict
    params: dict
    rows: list[StageRow]
    activations: dict | None
    recommendation: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"setup": self.setup, "params": self.params, "stages": [asdict(r) | {"label": r.label}
                                                                        for r in self.rows],
                "activations": self.activations, "recommendation": self.recommendation, "notes": self.notes}


# Note [Host memory at start]: on an accelerator every rank builds the whole model in fp32 host memory before
# moving it to its device (rank/loop.py; meta-device init is used on CPU only), so a node needs at least
# ranks per node x 4 bytes x all parameters of host memory for a moment, at every stage.
def _row(layout: Layout, setup: Setup, stage: int, offload: str, act: int, world_size: int | None = None,
         group: int | None = None, grad_group: int | None = None) -> StageRow:
    """One row; ``group``: the secondary group's ranks (zero.hierarchy, stage 3 without offloaded parameters,
    which the runtime refuses beside it); ``grad_group``: the inner level of the gradients' reduce-scatter
    (``placement.gradient_group``). With ``world_size`` (the search for the fewest nodes: only ``fits`` counts)
    the traffic is counted as on one node."""
    N = world_size or setup.ranks
    p = setup.precision
    group = group if stage == 3 and not offload.endswith("params") else None
    secondary = secondary_bytes(layout, N, p.param_bytes, group)
    on_host = setup.device == "cpu"
    optimizer_offload = offload.removesuffix("params").removesuffix("+") or "none"  # "params", "disk+params"
    ms = model_states(layout, stage, N, p, setup.optimizer, optimizer_offload, buffer_mb=setup.offload_buffer_mb,
                      device_is_host=on_host, grad_accum_bytes=setup.grad_accum_bytes,
                      offload_params=offload.endswith("params"))
    ws = working_set(layout, stage, N, p, bucket_mb=setup.bucket_mb, prefetch=setup.prefetch, gloo=on_host,
                     prefetch_bytes=setup.prefetch_bytes)
    total = ms.total + ws.gathered + max(act, ws.backward) + secondary  # Note [Peak]
    if on_host:  # the device is the host: disk's paging buffer takes the same memory
        total += ms.host
        host_rank = total
    else:  # Note [Host memory at start]; cpu offload also stages every gradient slice and parameter slice
        slices = sum(_optimizer_slices(layout, stage, N))
        staged = slices * (p.reduce_bytes + p.param_bytes) if optimizer_offload == "cpu" else 0
        host_rank = max(ms.host + staged, layout.total * 4)
    headroom = setup.device_memory - total
    cpu = setup.procs_per_node * host_rank
    fits = headroom >= MIN_HEADROOM * setup.device_memory and cpu <= setup.cpu_memory
    sent = traffic(layout, stage, N, p, setup.grad_accum_steps, node_ranks=() if world_size else setup.node_layout,
                   group=None if world_size else group,
                   quantize_block=None if stage != 3 or offload.endswith("params") else setup.quantize_block,
                   grad_group=None if world_size else grad_group, grad_quantize=setup.grad_quantize)
    return StageRow(stage, offload, ms.params, ms.grads, ms.optimizer, ms.total, ws.total, ws.gathered,
                    ws.backward, act, total, headroom, fits, cpu, setup.procs_per_node * ms.disk, sent.sent,
                    sent.sent / setup.bandwidth, ms.host, ms.disk, ms.grad_accum, sent.inter_node, secondary)


def offload_variants(setup: Setup) -> tuple[str, ...]:
    """The offload modes :func:`estimate` adds rows for (at stages 0-3, after the rows without offload):
    ``setup.offload``'s, where ``all`` is cpu and disk on an accelerator and disk alone on a CPU-only machine
    (there ``cpu`` moves nothing off the device and adds an fp32 master at fp32; asked for by name it is
    estimated all the same, as the engine runs it)."""
    if setup.offload == "all":
        return ("disk",) if setup.device == "cpu" else ("cpu", "disk")
    return () if setup.offload == "none" else (setup.offload,)


def estimate(layout: Layout, setup: Setup) -> Estimate:
    """Per-rank memory, per-node host memory and communication for stages 0-3 (and, per
    :func:`offload_variants`, with the optimizer offloaded), activations when ``layout.shape`` is declared,
    and a recommendation: the lowest stage that fits with ``MIN_HEADROOM`` (no offload first), or what to
    change.

    Raises:
        ValueError: ``setup.offload`` not one of :data:`OFFLOADS`; see :func:`model_states`.
    """
    if setup.offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {setup.offload!r}")
    notes: list[str] = []
    act = _activations(layout, setup, notes)
    if not layout.exact and not layout.units:
        notes.append("stage 3's gathered units not counted: pass --largest-layer")
    fused = "_fused" if layout.shape and layout.shape.get("fused_attention") else ""
    if act is not None:
        act["fused_attention"] = bool(fused)

    def act_for(stage: int, checkpointed: bool = setup.activation_checkpointing) -> int:
        if act is None:
            return 0
        return act[("checkpointed" if stage == 3 and checkpointed else "total") + fused]

    modes = offload_variants(setup)
    if setup.offload == "all" and setup.device == "cpu":
        notes.append("no cpu-offload rows: on a CPU-only machine the device memory is host memory (--offload cpu "
                     "shows them)")
    if "disk" in modes:
        notes.append(f"disk offload: a host buffer of {setup.offload_buffer_mb:g} MiB per rank "
                     "(zero.offload_buffer_mb) and the swap files under zero.offload_path (disk column)")
    variants = [(s, "none") for s in range(4)] + [(s, o) for o in modes for s in range(4)]
    if setup.offload_params and "disk" not in modes:  # Note [Parameter offload] in zero/param_offload.py
        variants.append((3, "params"))
    if "disk" in modes:
        variants.append((3, "disk+params"))
        notes.append("disk+params: stage 3 with zero.offload_params disk too (the parameter slices in the swap "
                     "files, in memory only while their unit is gathered)")
    group = group_size(setup.hierarchy, setup.node_layout)  # Note [Secondary shards] in zero/hierarchy.py
    if group:
        notes.append(f"zero.hierarchy: stage 3 keeps a secondary shard of the parameters, 1/{group} of every unit "
                     "but the persistent one, from the forward to the step (2nd column, in the total); all-gathers "
                     "after a unit's first of a step stay within its group of "
                     f"{group} ranks (ZeRO++ hpZ)")
    # the gradients' inner level below stage 3, where zero.hierarchy does not apply (traffic() takes ``group`` at 3)
    grad_group = gradient_group(None, bool(setup.grad_quantize), setup.node_layout)
    if setup.grad_quantize:  # Note [Quantized gradients] in zero/quantized_grads.py
        notes.append(f"zero.quantize_grads: stages 1-3 reduce-scatter the gradients as {setup.grad_quantize[0]}-bit "
                     f"blocks of {setup.grad_quantize[1]} with an fp32 scale each (ZeRO++ qgZ)"
                     + (f", within groups of {group or grad_group} ranks first" if group or grad_group else "")
                     + " (sent, inter)")
    rows = [_row(layout, setup, s, o, act_for(s), group=group, grad_group=grad_group) for s, o in variants]
    wide = setup.grad_accum_bytes > setup.precision.grad_bytes
    if wide:  # only ever fp32: wider than 2-byte gradients (Note [Gradient accumulation buffer])
        notes.append("gradients accumulate in fp32 (zero.grad_accum_dtype; unset: fp32 when grad_accum_steps > 1 "
                     "under bf16/fp16), counted in grads: a buffer of the whole model beside them at stages 0-1 "
                     "(Ψ x 4 bytes), the rank's gradient partition kept in fp32 at stages 2-3 (Ψ/N x 4 bytes)")
    notes += stage3_assumptions(layout, setup.ranks, setup.precision.param_bytes)
    return Estimate(_setup_info(setup, layout), _params_info(layout), rows, act,
                    _recommend(setup, layout, rows, act_for, group), notes)


def stage3_assumptions(layout: Layout, world_size: int, param_bytes: int) -> list[str]:
    """What stage 3's bytes sent assume of the order the forward runs its units, which the layout cannot see
    (a review found both off for a model that registers its head before its blocks, or freezes a block behind a
    trainable embedding): the unit kept from forward into backward taken as the last listed one in the model's
    order (Note [Kept from forward to backward] in zero/stage3_outer.py: the run keeps the one its forward ends
    with), and units holding frozen parameters only taken as gathered in forward only (no gradient through them)."""
    notes = []
    listed = layout.listed_units
    last = [u.name for u in listed if u.name in kept_units(layout, world_size, param_bytes)]
    if last:
        notes.append(f"stage 3 sent: counts {last[0]} as the unit the forward ends with, kept into backward (the last "
                     "listed unit in the model's order); the run keeps the one its forward really ends with, so a "
                     "model that runs its units in another order sends that unit's bytes less or more")
    frozen = [u.name for u in listed if u.frozen and not u.trainable]
    if frozen:
        notes.append(f"stage 3 sent: {len(frozen)} unit{'s' * (len(frozen) != 1)} holding frozen parameters only "
                     f"({', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}) counted as gathered in forward "
                     "only; where a gradient flows through one (a trainable module runs before it), its backward "
                     "gathers it again")
    return notes


def _activations(layout: Layout, setup: Setup, notes: list[str]) -> dict | None:
    """Activation bytes per rank (:func:`activation_bytes`) when ``layout.shape`` declares a transformer, else
    None; a note in ``notes`` says why they are not counted."""
    act = None
    if layout.shape:
        try:
            act = activation_bytes(layout.shape, micro_batch=setup.micro_batch, seq_len=setup.seq_len,
                                   element_bytes=setup.precision.activation_bytes)
        except (KeyError, TypeError, ValueError):
            notes.append("model.shape lacks n_layer, d_model, n_head, seq_len or vocab_size: activations not "
                         "estimated")
    if act is None:
        notes.append("activations not counted: no transformer shape (a recipe whose model sets `shape`: n_layer, "
                     "d_model, n_head, seq_len, vocab_size)")
    return act


def _params_info(layout: Layout) -> dict:
    """The model's part of the estimate's JSON: parameter counts (elements), the largest unit, the shape."""
    largest = layout.largest_unit
    return {"total": layout.total, "trainable": layout.trainable, "frozen": layout.frozen,
            "largest_unit": {"name": largest.name, "params": largest.numel} if largest else None,
            "units": len([u for u in layout.units if u.name != "<root>"]), "exact_layout": layout.exact,
            "shape": layout.shape}


def _setup_info(s: Setup, layout: Layout) -> dict:
    """The setup's part of the estimate's JSON (memory in bytes, bandwidth in bytes/s)."""
    return {"nodes": s.nodes, "procs_per_node": s.procs_per_node, "world_size": s.ranks,
            "precision": s.precision.name, "reduce_dtype": "fp32" if s.precision.reduce_bytes == 4 else
            s.precision.name, "optimizer": s.optimizer.name, "optimizer_states": s.optimizer.states,
            "offload": s.offload, "offload_buffer_mb": s.offload_buffer_mb,
            "device": s.device, "device_memory": s.device_memory, "cpu_memory_per_node": s.cpu_memory,
            "memory_source": s.memory_source,
            "bandwidth_bytes_per_s": s.bandwidth, "micro_batch": s.micro_batch,
            "seq_len": s.seq_len or (layout.shape or {}).get("seq_len"),
            "grad_accum_steps": s.grad_accum_steps, "grad_accum_dtype": s.grad_accum_dtype,
            "activation_checkpointing": s.activation_checkpointing, "node_ranks": list(s.node_layout),
            "hierarchy": s.hierarchy, "quantize_block": s.quantize_block,
            "quantize_grads": list(s.grad_quantize) if s.grad_quantize else None,
            "min_headroom": MIN_HEADROOM}


def _recommend(setup: Setup, layout: Layout, rows: list[StageRow], act_for, group: int | None = None) -> str:
    for row in rows:
        if row.fits:
            return (f"stage {row.label}: {format_bytes(row.device_total)} of {format_bytes(setup.device_memory)} "
                    f"per rank, headroom {format_bytes(row.headroom)} "
                    f"({row.headroom / setup.device_memory:.0%})")
    hints = []
    s3 = rows[3]
    tries = [(act_for(3), "")]
    if layout.shape and not setup.activation_checkpointing:
        tries.append((act_for(3, checkpointed=True), " with train.activation_checkpointing"))
    for activations, how in tries:
        nodes = _nodes_for_stage3(layout, setup, activations, group)
        if nodes is not None:
            ranks = count(nodes * setup.procs_per_node, "rank")
            hints.append(f"stage 3{how} fits on {count(nodes, 'node')} ({ranks})")
            break
    if s3.gathered > 0.25 * setup.device_memory and layout.unit_hint:
        hints.append(f"stage 3 gathers {format_bytes(s3.gathered)} at once: make smaller units, e.g. "
                     f"zero.units: [{layout.unit_hint}]")
    if s3.activations > 0.25 * setup.device_memory:
        one = act_for(0) // max(setup.micro_batch, 1)
        hints.append(f"activations take {format_bytes(s3.activations)} per rank: a smaller train.micro_batch_size "
                     f"({format_bytes(one)} per sample) or train.activation_checkpointing at stage 3 "
                     f"({format_bytes(act_for(3, checkpointed=True))})")
    device_ok = [r for r in rows if r.headroom >= MIN_HEADROOM * setup.device_memory]
    if device_ok:  # then host memory is what is short (Note [Host memory at start])
        r = device_ok[0]
        hints.append(f"stage {r.label} fits the device but needs {format_bytes(r.cpu_per_node)} host memory per "
                     f"node (have {format_bytes(setup.cpu_memory)}): fewer ranks per node or more host memory")
    best = min(rows, key=lambda r: r.device_total)
    head = (f"no stage fits {format_bytes(setup.device_memory)} per rank with {MIN_HEADROOM:.0%} headroom "
            f"(smallest: stage {best.label}, {format_bytes(best.device_total)})")
    return head + ("; " + "; ".join(hints) if hints else "; use more device memory per rank")


def _nodes_for_stage3(layout: Layout, setup: Setup, activations: int, group: int | None = None,
                      max_nodes: int = 1 << 20) -> int | None:
    """The fewest nodes (of ``setup.procs_per_node`` ranks) on which stage 3 fits (with secondary shards of
    ``group`` ranks), or ``None``."""
    def fits(nodes: int) -> bool:
        return _row(layout, setup, 3, "none", activations, world_size=nodes * setup.procs_per_node,
                    group=group).fits

    if not fits(max_nodes):
        return None
    lo, hi = setup.nodes, max_nodes  # per-rank bytes shrink as ranks grow: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo
