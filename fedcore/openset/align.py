"""Layer-wise optimal-transport alignment of feed-forward networks: FedPD++'s GDCA and SBA (§4.3).

Hidden units are interchangeable: two clients may learn the same filter at different indices,
and averaging them index by index mixes unrelated units. Alignment matches client A's units to
a reference client B's, layer by layer, and reorders A before averaging:

1. the previous layer's transport reorders this layer's *inputs* (Eq. 17);
2. the transport between A's and B's output units is found on their (input-aligned) weights:
   the ground cost is the Euclidean distance between unit weight vectors, the marginals are
   uniform, and the coupling comes from entropic OT (POT's Sinkhorn, log domain) or from an
   exact assignment (scipy's Hungarian ``linear_sum_assignment``);
3. A's units are reordered with it (Eq. 18), together with their bias and BatchNorm vectors.

A transport ``P`` is ``n x n`` with rows for A's units and columns for B's, scaled so that a
perfect match is a permutation matrix (Sinkhorn's is doubly stochastic, a soft permutation).
Reordered weights are ``P^T W``; the next layer's inputs become ``W P``. The classifier's
outputs are classes and are never reordered.

A network whose layers run in registration order says so with ``sequential = True``: layer j's
inputs follow layer j − 1's transport. Any other network is traced (``torch.fx``) and its graph
decides the plan. A residual sum ties the layers that write into it to one order: the first of
them (in forward order) decides the transport, from its own units and those of every other
writer whose inputs are already aligned (a downsampling shortcut), and the later writers follow
it. Operations alignment cannot follow (a concatenation, a reshape, GroupNorm) are refused with
the fix.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from fedcore.registry import check_choice

State = Dict[str, torch.Tensor]
Masks = Mapping[str, torch.Tensor]

ALIGN_METHODS = ("sinkhorn", "hungarian", "none")
_PASS_THROUGH = (nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Dropout, nn.Identity)


def _widths(mod: nn.Module) -> Tuple[int, int]:
    """(inputs, outputs) of a conv or linear layer: channels or features."""
    if isinstance(mod, nn.Conv2d):
        return mod.in_channels, mod.out_channels
    linear = cast(nn.Linear, mod)  # a conv or a linear layer
    return linear.in_features, linear.out_features


@dataclass(frozen=True)
class Layer:
    """One alignable layer: its state keys, its width and how its inputs follow the previous layer.

    ``spatial`` is the number of input positions per previous unit (a linear layer after a
    flattened ``C x 4 x 4`` map has ``spatial = 16``); ``last`` marks a layer whose outputs keep
    their order (the classifier). ``src`` is the plan index of the layer whose transport reorders
    this layer's inputs (None: the network's input). ``tie`` is the index of an earlier layer whose
    transport this layer shares (both write into one residual sum); ``joint`` lists the later
    layers writing into the same sum whose units join this layer's matching cost.
    """

    name: str
    weight: str
    bias: Optional[str]
    bn: Tuple[str, ...]  # BatchNorm vectors that follow this layer's units (weight, bias, running stats)
    out: int
    spatial: int
    last: bool
    src: Optional[int] = None
    tie: Optional[int] = None
    joint: Tuple[int, ...] = ()

    @property
    def keys(self) -> Tuple[str, ...]:
        return (self.weight,) + ((self.bias,) if self.bias else ()) + self.bn


def layer_plan(model: nn.Module) -> List[Layer]:
    """The alignable layers of ``model`` in forward order; refuses models alignment cannot follow."""
    if not getattr(model, "sequential", False):
        return _graph_plan(model)
    raw: List[dict] = []
    for name, mod in model.named_modules():
        if list(mod.children()):
            if not isinstance(mod, nn.Sequential) and mod is not model:
                raise ValueError(
                    f"{type(model).__name__}.{name} ({type(mod).__name__}) is a compound block that "
                    "alignment cannot follow; use align=none"
                )
            continue
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            if isinstance(mod, nn.Conv2d) and mod.groups != 1:
                raise ValueError(f"{name}: grouped convolutions cannot be aligned unit by unit; use align=none")
            raw.append({"name": name, "mod": mod, "bn": ()})
        elif isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
            if not raw:
                raise ValueError(f"{name}: a BatchNorm before any layer cannot be aligned; use align=none")
            raw[-1]["bn"] = tuple(
                f"{name}.{k}"
                for k in ("weight", "bias", "running_mean", "running_var")
                if getattr(mod, k, None) is not None
            )
        elif not isinstance(mod, _PASS_THROUGH):
            raise ValueError(f"{name} ({type(mod).__name__}) is a layer alignment cannot reorder; use align=none")
    plan: List[Layer] = []
    prev_out = None
    for j, r in enumerate(raw):
        mod = r["mod"]
        width_in, width_out = _widths(mod)
        spatial = 1
        if prev_out is not None:
            if isinstance(mod, nn.Linear) and width_in % prev_out == 0:
                spatial = width_in // prev_out
            elif width_in != prev_out:
                raise ValueError(
                    f"{r['name']} takes {width_in} inputs but the previous layer gives {prev_out} units: "
                    "the transport of one cannot reorder the other; use align=none"
                )
        plan.append(
            Layer(
                name=r["name"],
                weight=f"{r['name']}.weight",
                bias=f"{r['name']}.bias" if mod.bias is not None else None,
                bn=r["bn"],
                out=width_out,
                spatial=spatial,
                last=j == len(raw) - 1,
                src=j - 1 if j else None,
            )
        )
        prev_out = width_out
    return plan


_FLOW_FUNCTIONS = (
    "relu",
    "relu_",
    "flatten",
    "dropout",
    "adaptive_avg_pool2d",
    "avg_pool2d",
    "max_pool2d",
    "contiguous",
)
_SUMS = ("add", "add_")  # `out += x` traces as operator.add


def _graph_plan(model: nn.Module) -> List[Layer]:
    """The plan of a network with skip connections, from its traced graph (see the module docstring).

    Every tensor carries the *group* of layers whose transport orders its channels: a conv or
    linear layer starts its own group, pass-through operations keep their input's, and a sum
    merges its inputs' groups. A group that reaches the output (the classes) or the network's
    input keeps its order.
    """
    from torch import fx

    kind = type(model).__name__
    fix = (
        "use align=none, or a network whose layers and residual sums alignment can follow (lenet, cnn, resnet20, "
        "resnet18)"
    )
    try:
        graph = fx.symbolic_trace(model).graph
    except Exception as err:  # noqa: BLE001 - any tracing failure means the same thing here
        raise ValueError(f"{kind} cannot be aligned: its forward pass cannot be traced ({err}); {fix}") from err
    modules = dict(model.named_modules())
    INPUT = -1
    parent: Dict[int, int] = {INPUT: INPUT}

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    raw: List[dict] = []
    group: Dict[str, int] = {}  # node name -> the group ordering its channels
    producer: Dict[str, int] = {}  # node name -> the layer it comes from through pass-through steps only
    flat: Dict[str, bool] = {}  # node name -> (batch, features), as a linear layer needs, not (batch, C, ...)
    seen: set = set()
    output_groups: List[int] = []
    for node in graph.nodes:
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        if node.op == "placeholder":
            group[node.name], flat[node.name] = INPUT, False
            continue
        if node.op == "call_module" and isinstance(
            modules[node.target], (nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d)
        ):
            if node.target in seen:
                raise ValueError(
                    f"{kind}.{node.target} is called more than once: one set of weights in two places "
                    f"cannot take two orders; {fix}"
                )
            seen.add(node.target)
        if node.op == "output":
            outs = node.args[0]
            if not isinstance(outs, fx.Node):
                raise ValueError(
                    f"{kind} cannot be aligned: its forward pass returns {type(outs).__name__}, not one tensor; {fix}"
                )
            output_groups.append(group[outs.name])
            continue
        where = node.target if node.op == "call_module" else getattr(node.target, "__name__", str(node.target))
        if node.op == "call_module":
            mod = modules[node.target]
            if isinstance(mod, (nn.Conv2d, nn.Linear)):
                if isinstance(mod, nn.Conv2d) and mod.groups != 1:
                    raise ValueError(f"{node.target}: grouped convolutions cannot be aligned unit by unit; {fix}")
                g_in = group[tensors[0].name]
                if isinstance(mod, nn.Linear) and g_in != INPUT and not flat[tensors[0].name]:
                    raise ValueError(
                        f"{node.target}: a linear layer on a (batch, channels, ...) map acts on its last "
                        f"axis, not on the channels alignment reorders; flatten from dim 1 first or {fix}"
                    )
                j = len(raw)
                raw.append({"name": node.target, "mod": mod, "bn": (), "in": g_in})
                parent[j] = j
                group[node.name], producer[node.name], flat[node.name] = j, j, isinstance(mod, nn.Linear)
                continue
            if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
                jp = producer.get(tensors[0].name)
                if jp is None or raw[jp]["bn"] or mod.num_features != _widths(raw[jp]["mod"])[1]:
                    raise ValueError(
                        f"{node.target}: a BatchNorm that does not follow one conv or linear layer "
                        f"directly, channel for channel (after a sum, a flatten, or a second one) cannot "
                        f"be aligned; {fix}"
                    )
                raw[jp]["bn"] = tuple(
                    f"{node.target}.{k}"
                    for k in ("weight", "bias", "running_mean", "running_var")
                    if getattr(mod, k, None) is not None
                )
            elif isinstance(mod, nn.Flatten):
                if mod.start_dim != 1 or mod.end_dim != -1:
                    raise ValueError(f"{node.target}: only a flatten from dim 1 to the end keeps channels apart; {fix}")
            elif not isinstance(mod, _PASS_THROUGH):
                raise ValueError(f"{node.target} ({type(mod).__name__}) is a layer alignment cannot reorder; {fix}")
        elif node.op in ("call_function", "call_method") and where in _SUMS:
            if len(tensors) != 2:
                raise ValueError(f"{kind}: a sum ({node.name}) of {len(tensors)} tensors cannot be aligned; {fix}")
            ga, gb = find(group[tensors[0].name]), find(group[tensors[1].name])
            wa, wb = (None if g == INPUT else _widths(raw[g]["mod"])[1] for g in (ga, gb))
            if None not in (wa, wb) and wa != wb:
                raise ValueError(f"{kind}: {node.name} sums {wa} channels with {wb} (broadcasting); {fix}")
            parent[max(ga, gb)] = min(ga, gb)  # the input (-1) absorbs any group summed with it
            group[node.name] = min(ga, gb)
            flat[node.name] = flat[tensors[0].name] and flat[tensors[1].name]
            continue
        elif node.op in ("call_function", "call_method") and where in _FLOW_FUNCTIONS:
            if where == "flatten":
                start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
                end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
                if start != 1 or end != -1:
                    raise ValueError(
                        f"{kind}: {node.name} flattens from dim {start} to {end}; only a flatten from "
                        f"dim 1 to the end keeps channels apart; {fix}"
                    )
        else:
            raise ValueError(f"{kind}: the operation {where} ({node.name}) is one alignment cannot follow; {fix}")
        if not tensors:
            raise ValueError(f"{kind}: {node.name} takes no tensor; {fix}")
        flattens = where == "flatten" or node.op == "call_module" and isinstance(modules[node.target], nn.Flatten)
        group[node.name] = group[tensors[0].name]
        flat[node.name] = flat[tensors[0].name] or flattens
        if tensors[0].name in producer and not flattens:
            producer[node.name] = producer[tensors[0].name]
    if not raw:
        raise ValueError(f"{kind} has no conv or linear layer to align; {fix}")
    fixed = {find(INPUT)} | {find(g) for g in output_groups}
    roots = [find(j) for j in range(len(raw))]
    decider: Dict[int, int] = {}
    for j, g in enumerate(roots):
        decider.setdefault(g, j)
    width = {g: _widths(raw[j]["mod"])[1] for g, j in decider.items()}
    srcs: List[Optional[int]] = []
    for r in raw:
        g_in = find(r["in"])
        srcs.append(None if g_in == find(INPUT) else decider[g_in])
    plan: List[Layer] = []
    for j, r in enumerate(raw):
        mod, g, src = r["mod"], roots[j], srcs[j]
        width_in, width_out = _widths(mod)
        spatial = 1
        if src is not None:
            prev_out = width[roots[src]]
            if isinstance(mod, nn.Linear) and width_in % prev_out == 0:
                spatial = width_in // prev_out
            elif width_in != prev_out:
                raise ValueError(
                    f"{r['name']} takes {width_in} inputs but its input has {prev_out} channels: the "
                    f"transport of one cannot reorder the other; {fix}"
                )
        last = g in fixed
        lead = decider[g] == j
        joint = (
            tuple(m for m in range(j + 1, len(raw)) if roots[m] == g and (srcs[m] is None or cast(int, srcs[m]) < j))
            if lead and not last
            else ()
        )
        plan.append(
            Layer(
                name=r["name"],
                weight=f"{r['name']}.weight",
                bias=f"{r['name']}.bias" if mod.bias is not None else None,
                bn=r["bn"],
                out=width_out,
                spatial=spatial,
                last=last,
                src=src,
                tie=None if lead or last else decider[g],
                joint=joint,
            )
        )
    return plan


def shuffled_chain(plan: Sequence[Layer], generator: torch.Generator) -> "Chain":
    """A chain of random permutations, one per transport the plan allows (tied layers share one).

    Applied with :func:`apply_chain` it reorders a network's hidden units without changing its
    function: the tests' and benchmarks' stand-in for a client that learnt the same units elsewhere.
    """
    P: List[Optional[torch.Tensor]] = []
    for layer in plan:
        if layer.last:
            P.append(None)
        elif layer.tie is not None:
            P.append(P[layer.tie])
        else:
            P.append(torch.eye(layer.out)[torch.randperm(layer.out, generator=generator)])
    return Chain(P=P)


# ------------------------------------------------------------------------------------------ transports
@dataclass
class Transport:
    """One layer's coupling and what it cost: ``P`` (rows: A's units, columns: B's)."""

    P: torch.Tensor
    cost: float  # mean ground distance moved per unit, Σ P·C / n
    entropy: float  # mean row entropy of P over log n: 0 for a permutation, 1 for uniform
    converged: bool = True
    certified: bool = False  # proven optimal by :func:`certify`, no cost matrix built


COST_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def unit_matrix(
    tensors: Mapping[str, torch.Tensor],
    layer: Layer,
    prev: Optional[torch.Tensor],
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """(out, features) rows describing each unit: its input-aligned weights, bias and BN affine.

    ``tensors`` are weights, or masks keyed like them (a part's mask, row by row).
    """
    return torch.cat(unit_blocks(tensors, layer, prev, dtype), 1)


def unit_blocks(
    tensors: Mapping[str, torch.Tensor],
    layer: Layer,
    prev: Optional[torch.Tensor],
    dtype: torch.dtype = torch.float64,
) -> List[torch.Tensor]:
    """:func:`unit_matrix`'s columns as blocks (the weights, then bias and BN affine), the weights not copied
    again: :func:`unit_distance` takes float32 blocks as they are (unmasked), without concatenating them."""
    blocks = [align_inputs(tensors[layer.weight], prev, layer).reshape(layer.out, -1).to(dtype)]
    small = [
        tensors[key].reshape(layer.out, 1)
        for key in ((layer.bias,) if layer.bias else ()) + tuple(k for k in layer.bn if k.endswith(("weight", "bias")))
    ]
    if small:
        blocks.append(torch.cat(small, 1).to(dtype))
    return blocks


def permutation_source(P: torch.Tensor) -> Optional[torch.Tensor]:
    """For a permutation matrix ``P`` (rows: A's units, columns: B's), the A unit each column takes; else None.

    ``P^T W`` is then ``W[source]`` and ``W P`` is ``W[:, source]``: a gather, bit for bit the same as the
    product (multiplying by 1 and adding zeros are exact), in O(n) instead of O(n^2) per weight row.
    """
    n = P.shape[0]
    if P.dim() != 2 or P.shape[1] != n or int(torch.count_nonzero(P)) != n:
        return None
    source = P.argmax(0)  # n nonzero entries, one 1 in every column: a permutation
    if not bool((P[source, torch.arange(n)] == 1).all()) or int(torch.bincount(source, minlength=n).max()) != 1:
        return None
    return source


def align_inputs(w: torch.Tensor, prev: Optional[torch.Tensor], layer: Layer) -> torch.Tensor:
    """Reorder a weight's input axis by the previous layer's transport ``prev`` (Eq. 17)."""
    if prev is None:
        return w
    source = permutation_source(prev)
    if source is not None and bool((source == torch.arange(len(source))).all()):
        return w  # the identity: nothing to reorder, no copy
    if w.dim() == 4:  # conv (out, in, k, k)
        return w.index_select(1, source) if source is not None else torch.einsum("oikl,ij->ojkl", w, prev.to(w.dtype))
    out, width = w.shape
    grouped = w.reshape(out, width // layer.spatial, layer.spatial)  # flatten order: channel-major
    if source is not None:
        return grouped.index_select(1, source).reshape(out, width)
    return torch.einsum("ois,ij->ojs", grouped, prev.to(w.dtype)).reshape(out, width)


def unit_distance(
    a: torch.Tensor | Sequence[torch.Tensor],
    b: torch.Tensor | Sequence[torch.Tensor],
    a_weight: Optional[torch.Tensor] = None,
    b_weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Euclidean distances between the rows of ``a`` and ``b``; with weights, on the coordinates both hold.

    ``C_ij = sqrt(Σ_d wa_id · wb_jd · (a_id − b_jd)²)``: two units are close when they agree where
    both parts have mass, whatever the mask patterns are elsewhere. ``a`` and ``b`` may be lists of
    column blocks (:func:`unit_blocks`), the rows being their concatenations.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        a_blocks, b_blocks = list(a), list(b)
        if a_weight is not None or a_blocks[0].dtype == torch.float64:
            return unit_distance(torch.cat(a_blocks, 1), torch.cat(b_blocks, 1), a_weight, b_weight)
        # block by block into one accumulator: ‖a‖² + ‖b‖² − 2 Σ_blocks a·b, no block copied
        sq = (
            sum(torch.linalg.vector_norm(x, dim=1).square() for x in a_blocks)[:, None]
            + sum(torch.linalg.vector_norm(y, dim=1).square() for y in b_blocks)[None]
        )
        for x, y in zip(a_blocks, b_blocks):
            sq = sq.addmm_(x, y.t(), alpha=-2.0)
        return sq.clamp_min_(0).sqrt_()
    if a_weight is None:
        if a.dtype == torch.float64:
            return torch.cdist(a, b)
        # one matrix product with the squared norms added: torch.cdist copies both sides into wider
        # matrices first, and took 1.9x as long on a ResNet-18's layers (benchmarks/fedpd_align.py)
        sq = torch.addmm((a * a).sum(1, keepdim=True) + (b * b).sum(1)[None], a, b.t(), alpha=-2.0)
        return sq.clamp_min(0).sqrt()
    wa, wb = a_weight.to(a.dtype), cast(torch.Tensor, b_weight).to(b.dtype)  # the weights come in pairs
    sq = (wa * a * a) @ wb.t() - 2 * (wa * a) @ (wb * b).t() + wa @ (wb * b * b).t()
    return sq.clamp_min(0).sqrt()


def transport(
    a: torch.Tensor | Sequence[torch.Tensor],
    b: torch.Tensor | Sequence[torch.Tensor],
    *,
    method: str = "sinkhorn",
    reg: float = 0.05,
    max_iter: int = 200,
    tol: float = 1e-6,
    where: str = "",
    a_weight: Optional[torch.Tensor] = None,
    b_weight: Optional[torch.Tensor] = None,
    extra: Optional[torch.Tensor] = None,
    extra_weight: float = 1.0,
    hard: bool = False,
    dtype: torch.dtype = torch.float64,
    screen: Optional["Screen"] = None,
) -> Transport:
    """The coupling of A's units (rows of ``a``) to B's (rows of ``b``).

    ``a_weight``/``b_weight`` weight the coordinates (a part's masks, :func:`unit_distance`);
    ``extra`` is a second cost between the same units (SBA's BatchNorm history), added after both
    are divided by their means, times ``extra_weight``. The reported ``cost`` is the weights' alone.

    The ground cost is divided by its mean, so ``reg`` is relative to a typical distance between
    two units and means the same on every layer (a maximum would let one outlying unit set it).
    Sinkhorn runs in the log domain until its marginals are within ``tol`` (POT's ``stopThr``) or
    for ``max_iter`` iterations; if it returns non-finite values the layer keeps its order
    (identity) with a warning, never silent NaNs.

    ``hard`` rounds Sinkhorn's plan to a permutation (the assignment that keeps most of its mass), so
    each of A's units goes whole to one of B's; Hungarian's is always one. A hard transport takes a
    shortcut: when every unit of A is at least as close to B's unit at its own index as to any other,
    the identity is an optimal assignment (its cost is the sum of the row minima, a lower bound on any
    assignment) and no solver runs. Clients that start a round from one global model usually stand so.
    ``dtype`` is the precision of the cost matrix (float32 halves its time; float64 as before).
    ``screen`` (the reference's :class:`Screen`) lets Hungarian skip the cost matrix where :func:`certify`
    proves a permutation optimal; the unweighted cost with no ``extra`` only. Rounded Sinkhorn keeps its own
    answer (the plan's heaviest permutation need not be the cheapest), so it is never screened.
    """
    if method not in ALIGN_METHODS or method == "none":
        raise ValueError(f"unknown alignment {method!r}; use one of sinkhorn, hungarian (or none to skip alignment)")
    a_blocks = [a] if isinstance(a, torch.Tensor) else list(a)
    b_blocks = [b] if isinstance(b, torch.Tensor) else list(b)
    n = a_blocks[0].shape[0]
    where = f"{where}: " if where else ""
    if b_blocks[0].shape[0] != n:
        raise ValueError(
            f"{where}{n} units against {b_blocks[0].shape[0]}: alignment needs the same architecture everywhere"
        )
    if screen is not None and method == "hungarian" and a_weight is None and (extra is None or extra_weight <= 0):
        proof = certify(a_blocks, b_blocks, screen)
        if proof is not None:
            target, dist = proof
            P = torch.zeros((n, n), dtype=torch.float64)
            P[torch.arange(n), target] = 1.0
            return Transport(P=P, cost=float(dist.mean()), entropy=0.0, certified=True)
    C = unit_distance([x.to(dtype) for x in a_blocks], [y.to(dtype) for y in b_blocks], a_weight, b_weight)
    scale = float(C.mean())
    Cn = C / scale if scale > 0 else C
    if extra is not None and extra_weight > 0:
        e = extra.to(dtype)
        e_scale = float(e.mean())
        Cn = Cn + extra_weight * (e / e_scale if e_scale > 0 else e)
    P, converged = couple(Cn, method=method, reg=reg, max_iter=max_iter, tol=tol, hard=hard, where=where)
    return Transport(P=P, cost=float((P.to(C.dtype) * C).sum()) / n, entropy=row_entropy(P), converged=converged)


SKETCH_DIM = 32  # random projections per unit, whose nearest neighbours propose the matches
SCREEN_MARGIN = 1e-3  # relative slack on the certificate's inequality, above float32's rounding of a distance


@dataclass(frozen=True)
class Screen:
    """What :func:`certify` needs of the reference's units, built once a round per layer (:func:`screen_of`).

    ``gaps[j]`` is the distance from the reference's unit j to its nearest other unit (float64);
    ``project`` maps each column block to ``SKETCH_DIM`` random directions; ``sketch`` holds the
    reference's units projected so.
    """

    gaps: torch.Tensor
    project: Tuple[torch.Tensor, ...]
    sketch: torch.Tensor


def screen_of(b_blocks: Sequence[torch.Tensor], *, seed: int = 0) -> Screen:
    """The reference's :class:`Screen`: one ``units x units`` distance matrix, in the blocks' precision.

    The gaps must be lower bounds: ``|b_i|^2 + |b_j|^2 - 2 b_i.b_j`` loses at most about ``d u`` of
    ``|b_i|^2 + |b_j|^2`` to rounding (u the unit roundoff, d the row length), so ``4 d eps`` (eps = 2u) of
    it is taken off before the root; two coinciding units get a gap of 0 and are never proven apart.
    """
    rows = torch.cat(list(b_blocks), 1)
    norms = (rows * rows).sum(1)
    scale = norms[:, None] + norms[None]
    sq = torch.addmm(scale, rows, rows.t(), alpha=-2.0)
    D = (sq - 4 * rows.shape[1] * torch.finfo(rows.dtype).eps * scale).clamp_min(0).sqrt().double()
    D.fill_diagonal_(math.inf)
    project = tuple(_directions(seed, k, y.shape[1], y.dtype) for k, y in enumerate(b_blocks))
    return Screen(gaps=D.min(1).values, project=project, sketch=_sketch(b_blocks, project))


@functools.lru_cache(maxsize=256)
def _directions(seed: int, block: int, features: int, dtype: torch.dtype) -> torch.Tensor:
    """``SKETCH_DIM`` random directions for one column block, the same every round (a pure function)."""
    g = torch.Generator().manual_seed(seed * 1009 + block)
    return torch.randn(features, SKETCH_DIM, generator=g, dtype=torch.float64).to(dtype) / math.sqrt(SKETCH_DIM)


def _sketch(blocks: Sequence[torch.Tensor], project: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((x @ r for x, r in zip(blocks[1:], project[1:])), blocks[0] @ project[0])


def _row_distances(
    a_blocks: Sequence[torch.Tensor], b_blocks: Sequence[torch.Tensor], target: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``‖a_i − b_target[i]‖`` for every row i (``target`` None: B's row i), from the differences: no
    cancellation, so float32 rows are good to far better than :data:`SCREEN_MARGIN`. Returned in float64."""
    sq = torch.zeros(a_blocks[0].shape[0], dtype=torch.float64)
    for x, y in zip(a_blocks, b_blocks):
        sq += torch.linalg.vector_norm(x - (y if target is None else y.index_select(0, target)), dim=1).double() ** 2
    return sq.sqrt()


def certify(
    a_blocks: Sequence[torch.Tensor], b_blocks: Sequence[torch.Tensor], screen: Screen
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """A permutation proven to be an optimal assignment of A's units to B's without the cost matrix, or None.

    Each of A's units i gets a candidate c(i): the reference unit nearest to it in the random sketch.
    The triangle inequality gives ``‖a_i − b_j‖ ≥ gap_c − ‖a_i − b_c‖`` for every other j, so
    ``2 ‖a_i − b_c‖ < gap_c`` proves b_c strictly nearest to a_i. When every row is proven
    so and the candidates form a permutation, its cost is the sum of the row minima, a lower bound on any
    assignment: it is the unique optimum, the one Hungarian returns. Returns ``(c, ‖a_i − b_c(i)‖)``.
    Units standing closer to each other than twice their distance to the match fall back to the solver.
    The proof is about the exact distances: a float32 solver agrees with it unless two of its costs lie
    within float32's rounding of each other, where the screen's answer is the right one.
    """
    n = a_blocks[0].shape[0]
    target = torch.cdist(_sketch(a_blocks, screen.project), screen.sketch).argmin(1)
    if int(torch.bincount(target, minlength=n).max()) != 1:
        return None
    in_place = bool((target == torch.arange(n)).all())
    dist = _row_distances(a_blocks, b_blocks, None if in_place else target)
    if not bool((2 * dist * (1 + SCREEN_MARGIN) < screen.gaps[target]).all()):
        return None
    return target, dist


def couple(
    Cn: torch.Tensor,
    *,
    method: str = "sinkhorn",
    reg: float = 0.05,
    max_iter: int = 200,
    tol: float = 1e-6,
    hard: bool = False,
    where: str = "",
) -> Tuple[torch.Tensor, bool]:
    """(the transport for the square cost ``Cn``, whether its solver converged); see :func:`transport`."""
    n = Cn.shape[0]
    if (hard or method == "hungarian") and bool((Cn.diagonal() <= Cn.min(1).values).all()):
        return torch.eye(n, dtype=torch.float64), True
    if method == "hungarian":
        return _assignment(Cn), True
    P, converged = _sinkhorn(Cn, reg=reg, max_iter=max_iter, tol=tol, where=where)
    return (_assignment(-P) if hard else P), converged


def _assignment(C: torch.Tensor) -> torch.Tensor:
    """The permutation matrix of the exact assignment minimising ``C`` (scipy's Hungarian)."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(C.double().numpy())
    P = torch.zeros(C.shape, dtype=torch.float64)
    P[rows, cols] = 1.0
    return P


def _sinkhorn(Cn: torch.Tensor, *, reg: float, max_iter: int, tol: float, where: str) -> Tuple[torch.Tensor, bool]:
    """Entropic OT between uniform marginals (POT, log domain), scaled so a permutation has entries 1."""
    import ot

    if reg <= 0:
        raise ValueError(f"Sinkhorn needs reg > 0, got {reg}; try 0.05 (the cost is scaled to mean 1)")
    if not 0 < tol < 5e-2:
        raise ValueError(f"Sinkhorn's tol must be in (0, 0.05), got {tol}; the default is 1e-6, 1e-3 is faster")
    n = Cn.shape[0]
    Cn = Cn.double()
    u = torch.full((n,), 1.0 / n, dtype=torch.float64)
    # torch tensors in, so POT's torch backend runs the log-domain loop (about 10x numpy's here)
    T = ot.sinkhorn(u, u, Cn, reg, method="sinkhorn_log", numItermax=max_iter, stopThr=tol, warn=False)
    P = (T * n).double()
    err = max(float((P.sum(1) - 1).abs().max()), float((P.sum(0) - 1).abs().max()))  # relative marginal error
    if not bool(torch.isfinite(P).all()):
        warnings.warn(
            f"{where}Sinkhorn returned non-finite values; this layer keeps its order. Increase reg "
            f"(now {reg}) or use align=hungarian",
            RuntimeWarning,
            stacklevel=5,
        )
        return torch.eye(n, dtype=torch.float64), False
    converged = err <= 5e-2  # warn when more than 5 % of a unit's mass is misplaced
    if not converged:
        warnings.warn(
            f"{where}Sinkhorn did not converge in {max_iter} iterations (relative marginal error "
            f"{err:.2g}); "
            f"increase max_iter or reg (now {reg}), or use align=hungarian",
            RuntimeWarning,
            stacklevel=5,
        )
    return P, converged


def row_entropy(P: torch.Tensor) -> float:
    """Mean entropy of the rows of P (normalised to sum 1), divided by log n: 0 = permutation, 1 = uniform."""
    n = P.shape[0]
    if n < 2 or int(torch.count_nonzero(P)) == n:  # one entry a row: no entropy to compute
        return 0.0
    rows = P / P.sum(1, keepdim=True).clamp_min(1e-300)
    h = -(rows * torch.log(rows.clamp_min(1e-300))).sum(1)
    return float(h.mean()) / math.log(n)


# ------------------------------------------------------------------------------------------ chains
@dataclass
class Chain:
    """The transports of every layer of one client against the reference (None: the layer keeps its order)."""

    P: List[Optional[torch.Tensor]]
    costs: List[float] = field(default_factory=list)
    entropies: List[float] = field(default_factory=list)
    quality: List[float] = field(default_factory=list)  # Hungarian's cost / this cost, per layer
    certified: List[bool] = field(default_factory=list)  # per solved layer: proven by :func:`certify`


PART_COSTS = ("weighted", "masked")
SBA_MODES = ("compose", "added")


def align_chain(
    state: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    plan: Sequence[Layer],
    *,
    method: str = "hungarian",
    reg: float = 0.05,
    max_iter: int = 200,
    tol: float = 1e-6,
    mask: Optional[Masks] = None,
    ref_mask: Optional[Masks] = None,
    part_cost: str = "weighted",
    bank_costs: Optional[Mapping[str, torch.Tensor]] = None,
    sba_weight: float = 1.0,
    sba_mode: str = "compose",
    hard: bool = True,
    cost_dtype: str = "float32",
    quality: bool = False,
    where: str = "",
    ref_units: Optional[Dict[str, Any]] = None,
    screen: bool = True,
) -> Chain:
    """Transports aligning ``state`` to ``ref`` layer by layer, each carried into the next layer's inputs.
    The defaults are FedPD++'s: exact (Hungarian) permutations, SBA composed, float32 costs.

    ``mask``/``ref_mask`` make it a part's alignment (FedPD++'s close/open/shared parts, Eq. 19–21).
    ``part_cost="weighted"`` compares units on the coordinates both parts hold (:func:`unit_distance`);
    ``"masked"`` compares the masked weights ``S ⊙ P`` themselves, the literal reading, under which
    two copies of one model with different masks are matched by their mask patterns.
    ``bank_costs`` maps a layer name to SBA's cost between channels (:func:`fedcore.openset.sba.bank_cost`).
    ``sba_mode="compose"`` is §4.3's order: A's units are first reordered by the transport of their
    BatchNorm histories, then the reordered weights are matched, and the layer's transport is the
    product of the two. ``"added"`` adds the history cost to the weights' cost, times ``sba_weight``.
    ``hard`` and ``cost_dtype`` (``float64`` or ``float32``) are :func:`transport`'s ``hard`` and ``dtype``.
    ``ref_units``: a dict shared by the chains of one round that align whole models to the same ``ref``;
    the reference's unit rows are built once and kept there, and with ``screen`` (Hungarian transports of
    whole models) also each layer's :class:`Screen`, so that a layer whose match :func:`certify` proves
    needs no cost matrix.
    """
    check_choice("part_cost", part_cost, PART_COSTS)
    check_choice("sba_mode", sba_mode, SBA_MODES)
    check_choice("cost_dtype", cost_dtype, tuple(COST_DTYPES))
    dtype = COST_DTYPES[cost_dtype]
    chain = Chain(P=[])
    for layer in plan:
        if layer.last:
            chain.P.append(None)
            continue
        if layer.tie is not None:  # writes into a residual sum whose order an earlier layer decided
            chain.P.append(chain.P[layer.tie])
            continue
        members = [layer] + [plan[m] for m in layer.joint]

        def units(tensors, aligned, members=members) -> List[torch.Tensor]:
            return [
                block
                for m in members
                for block in unit_blocks(tensors, m, chain.P[m.src] if aligned and m.src is not None else None, dtype)
            ]

        a_blocks = units(state, True)
        if ref_units is not None and mask is None:
            key = f"{layer.name}:{cost_dtype}"
            b_blocks = ref_units[key] if key in ref_units else ref_units.setdefault(key, units(ref, False))
        else:
            b_blocks = units(ref, False)
        a: torch.Tensor | List[torch.Tensor] = a_blocks
        b: torch.Tensor | List[torch.Tensor] = b_blocks
        wa = wb = None
        if mask is not None:  # a part's masks weight the coordinates: whole matrices
            a, b = torch.cat(a_blocks, 1), torch.cat(b_blocks, 1)
            ma, mb = torch.cat(units(mask, True), 1), torch.cat(units(ref_mask, False), 1)
            if part_cost == "masked":
                a, b = a * ma, b * mb
            else:
                wa, wb = ma, mb
        extras = [bank_costs[m.name] for m in members if bank_costs and m.name in bank_costs]
        extra = sum(extras[1:], extras[0]) if extras else None
        first = None  # SBA's reordering of A's units, when composed
        if extra is not None and sba_mode == "compose":
            e = extra.to(dtype)
            first, _ = couple(
                e / float(e.mean()) if float(e.mean()) > 0 else e,
                method=method,
                reg=reg,
                max_iter=max_iter,
                tol=tol,
                hard=hard,
                where=f"{where} {layer.name} SBA".strip(),
            )
            a = _reorder_rows(a, first) if isinstance(a, torch.Tensor) else [_reorder_rows(x, first) for x in a]
            wa = _reorder_rows(wa, first) if wa is not None else None
            extra = None
        solve: Dict[str, Any] = dict(a_weight=wa, b_weight=wb, extra=extra, extra_weight=sba_weight, dtype=dtype)
        proof = None
        if screen and ref_units is not None and mask is None and method == "hungarian" and extra is None:
            key = f"{layer.name}:{cost_dtype}:screen"
            proof = ref_units[key] if key in ref_units else ref_units.setdefault(key, screen_of(b_blocks))
        t = transport(
            a,
            b,
            method=method,
            reg=reg,
            max_iter=max_iter,
            tol=tol,
            where=f"{where} {layer.name}".strip(),
            hard=hard,
            screen=proof,
            **solve,
        )
        if quality:
            exact = transport(a, b, method="hungarian", **solve)
            chain.quality.append(1.0 if t.cost <= 0 else min(exact.cost / t.cost, 1.0))
        P = t.P if first is None else first @ t.P
        chain.P.append(P)
        chain.costs.append(t.cost)
        chain.certified.append(t.certified)
        chain.entropies.append(t.entropy if first is None else row_entropy(P))
    return chain


def _reorder_rows(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``P^T x``: A's unit rows in the order (or blend) the transport ``P`` gives them."""
    source = permutation_source(P)
    return x.index_select(0, source) if source is not None else P.to(x.dtype).t() @ x


def apply_chain(tensors: Mapping[str, torch.Tensor], plan: Sequence[Layer], chain: Chain) -> State:
    """``tensors`` (weights, or masks: anything keyed like the state) reordered by ``chain``.

    Keys outside the plan (``num_batches_tracked``) pass through unchanged.
    """
    out = dict(tensors)
    for layer, P in zip(plan, chain.P):
        if layer.weight not in tensors:
            continue
        w = align_inputs(tensors[layer.weight], chain.P[layer.src] if layer.src is not None else None, layer)
        if P is not None:
            w = _reorder_rows(w.reshape(layer.out, -1), P).reshape(w.shape)
            for key in ((layer.bias,) if layer.bias else ()) + layer.bn:
                if key in tensors:
                    out[key] = _reorder_rows(tensors[key], P)
        out[layer.weight] = w
    return out


def identity_chain(plan: Sequence[Layer]) -> Chain:
    return Chain(P=[None] * len(plan))


def identity_layers(chain: Chain) -> List[bool]:
    """Per layer, whether ``chain`` keeps its order there: no transport, or one that is the identity
    permutation (every unit's whole mass on its own index)."""
    return [P is None or (P.shape[0] == P.shape[1] and bool((P.diagonal() == 1).all())) for P in chain.P]
