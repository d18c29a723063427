"""Device groups and shardings: replica groups and `{devices=...}` tilings read as mesh axes."""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotuner.hlo.text import Instr
from autotuner.problem import Entry

log = logging.getLogger(__name__)

# -- device groups and shardings -------------------------------------------------------------------

@dataclass(frozen=True)
class MeshInfo:
    """The logical mesh: axis names and sizes; partition p sits at np.unravel_index(p, sizes)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def coords(self) -> np.ndarray:
        """[size, naxes] mesh coordinates of each partition id."""
        return np.stack(np.unravel_index(np.arange(self.size), self.sizes), axis=-1) if self.names else \
            np.zeros((1, 0), dtype=int)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))

    def axes_for(self, index: np.ndarray, count: int) -> tuple[str, ...] | None:
        """The ordered mesh axes E (major to minor) with index[p] == ravel(coords(p)[E]) for every
        partition p, where prod(sizes of E) == count; None if no such axes exist."""
        coords = self.coords()
        if count == 1:
            return () if np.all(index == 0) else None
        cand = [i for i, s in enumerate(self.sizes) if s > 1]
        for r in range(1, len(cand) + 1):
            for perm in itertools.permutations(cand, r):
                if math.prod(self.sizes[i] for i in perm) != count:
                    continue
                flat = np.ravel_multi_index(tuple(coords[:, i] for i in perm),
                                            tuple(self.sizes[i] for i in perm))
                if np.array_equal(flat, index):
                    return tuple(self.names[i] for i in perm)
        return None

    def group_axes(self, groups: np.ndarray) -> tuple[str, ...] | None:
        """The ordered axes a collective's groups [ngroups, group_size] run along (None if the
        groups are not slices of the mesh along whole axes, in mesh order)."""
        if groups.size != self.size or sorted(groups.ravel().tolist()) != list(range(self.size)):
            return None
        index = np.empty(self.size, dtype=int)
        for g in groups:
            index[g] = np.arange(len(g))
        axes = self.axes_for(index, groups.shape[1])
        if axes is None:
            return None
        others = [i for i, n in enumerate(self.names) if n not in axes]
        coords = self.coords()
        for g in groups:  # each group must be one slice: fixed coordinates on the other axes
            if others and np.any(coords[g][:, others] != coords[g[0]][others]):
                return None
        return axes


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", text)]


def _iota(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    a = np.arange(math.prod(reshape)).reshape(tuple(reshape))
    if perm:
        a = a.transpose(tuple(perm))
    return a.reshape(tuple(dims))


def _tile_array(spec: str) -> np.ndarray:
    """`[d0,d1]<=[r0,r1]T(1,0)` or `[d0,d1]0,1,2,3` -> the device array of shape [d0, d1]."""
    m = re.match(r"\s*\[([\d,\s]*)\]\s*(.*)$", spec, re.S)
    if not m:
        raise ValueError(f"tile assignment {spec!r}")
    dims = _ints(m.group(1))
    rest = m.group(2).strip()
    if rest.startswith("<="):
        m2 = re.match(r"<=\s*\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?", rest)
        if not m2:
            raise ValueError(f"iota tile assignment {spec!r}")
        return _iota(dims, _ints(m2.group(1)), _ints(m2.group(2)) if m2.group(2) else None)
    ids = _ints(rest.split(" ")[0] if rest else "")
    if len(ids) != math.prod(dims):
        raise ValueError(f"tile assignment {spec!r} lists {len(ids)} devices")
    return np.array(ids).reshape(dims)


def parse_replica_groups(ins: Instr, num_partitions: int) -> np.ndarray | None:
    """[ngroups, group_size] partition ids of a collective; None if not over partitions."""
    rg = ins.attrs.get("replica_groups")
    if "channel_id" not in ins.attrs:
        return None  # cross-replica only: not a partitioner collective
    if rg is None or rg.strip() in ("{}", "{{}}"):
        return np.arange(num_partitions).reshape(1, -1)
    rg = rg.strip()
    try:
        if rg.startswith("mesh"):
            return _mesh_groups(rg, ins.attrs.get("device_ids", ""))
        if rg.startswith("["):
            m = re.match(r"\[([\d,\s]*)\]\s*(.*)$", rg)
            assert m
            dims = _ints(m.group(1))
            return _tile_array(rg).reshape(dims[0], -1)
        groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", rg)]
        if not groups or len({len(g) for g in groups}) != 1:
            return None
        return np.array(groups)
    except (ValueError, AssertionError, IndexError):
        log.debug("extract: could not read replica groups %r", rg)
        return None


def _mesh_groups(rg: str, device_ids: str) -> np.ndarray:
    """`mesh['a'=4,'b'=2] {'a'}` (and `device_ids=([2,4]T(1,0)) {'a'}`; sub-axes `'a':(1)2`)."""
    m = re.match(r"mesh\[(.*?)\]\s*(.*)$", rg, re.S)
    if not m:
        raise ValueError(rg)
    axes = [(n, int(s)) for n, s in re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))]
    names = [a for a, _ in axes]
    sizes = [s for _, s in axes]
    text = m.group(2) + " " + device_ids
    group_part = text[text.rfind("{"):] if "{" in text else "{}"
    ids_part = text[: text.rfind("{")] if "{" in text else text
    m_ids = re.search(r"\((.*)\)", ids_part, re.S)
    if m_ids and m_ids.group(1).strip():
        inner = m_ids.group(1).strip()
        if inner.startswith("["):
            m2 = re.match(r"\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?", inner)
            assert m2
            reshape = _ints(m2.group(1))
            devices = _iota(sizes, reshape, _ints(m2.group(2)) if m2.group(2) else None)
        else:
            devices = np.array(_ints(inner)).reshape(sizes)
    else:
        devices = np.arange(math.prod(sizes)).reshape(sizes)
    refs = re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", group_part.strip("{} "))
    # expand sub-axes: axis of size n split into [pre, size, n / (pre * size)]
    exp_sizes: list[int] = []
    index_of: dict[tuple[str, int | None], int] = {}
    subs = {n: (int(p), int(s)) for n, p, s in refs if p}
    for n, s in zip(names, sizes, strict=True):
        if n in subs:
            pre, size = subs[n]
            if s % (pre * size):
                raise ValueError(rg)
            index_of[(n, 1)] = len(exp_sizes) + 1
            exp_sizes += [pre, size, s // (pre * size)]
        else:
            index_of[(n, None)] = len(exp_sizes)
            exp_sizes.append(s)
    grouped = [index_of[(n, 1 if p else None)] for n, p, _s in refs if n]
    devices = devices.reshape(exp_sizes)
    rest = [i for i in range(len(exp_sizes)) if i not in grouped]
    gsize = math.prod(exp_sizes[i] for i in grouped) if grouped else 1
    return devices.transpose(rest + grouped).reshape(-1, gsize)


@dataclass(frozen=True)
class Tiling:
    tiles: np.ndarray        # device ids, shape [t_0 .. t_{r-1}, (replication dims)]
    rank: int
    manual: bool = False


def parse_sharding(text: str | None, rank: int, num_partitions: int) -> Tiling | None:
    """An HloSharding attribute as a Tiling (replicated = all tiles 1); None if unreadable."""
    if text is None:
        return None
    t = text.strip()
    if t.startswith("{"):
        t = t[1:-1].strip() if t.endswith("}") else t[1:]
    t = re.sub(r"\s*metadata=\{.*\}\s*$", "", t, flags=re.S)
    if t.startswith("{"):
        return None  # tuple sharding
    if t.startswith("replicated") or t == "":
        return Tiling(np.arange(num_partitions).reshape([1] * rank + [num_partitions]), rank)
    if t.startswith("manual"):
        return Tiling(np.zeros([1] * rank, dtype=int), rank, manual=True)
    if not t.startswith("devices="):
        return None  # maximal, unknown, shardy-only forms
    body = t[len("devices="):]
    try:
        m = re.match(r"(\[[\d,\s]*\]\s*(?:<=\s*\[[\d,\s]*\]\s*(?:T\([\d,\s]*\))?|[\d,\s]*))(.*)$", body, re.S)
        if not m:
            return None
        tiles = _tile_array(m.group(1).strip().rstrip(","))
        extra = m.group(2)
    except ValueError:
        return None
    manual, n_extra = False, 0
    if "last_tile_dims" in extra:
        kinds = re.search(r"last_tile_dims=\{([^}]*)\}", extra)
        manual = bool(kinds and "manual" in kinds.group(1))
        n_extra = len(kinds.group(1).split(",")) if kinds else 0
    elif "last_tile_dim_replicate" in extra:
        n_extra = 1
    if tiles.ndim != rank + n_extra:
        return None
    return Tiling(tiles, rank, manual=manual)


def tiling_spec(tiling: Tiling, mesh: MeshInfo) -> tuple[Entry, ...] | None:
    """The PartitionSpec-like entries of a tiling over the mesh axes; None if not expressible."""
    if tiling.manual:
        return None
    tiles = tiling.tiles
    if tiles.size != mesh.size:
        return None
    idx = np.indices(tiles.shape).reshape(tiles.ndim, -1)
    dev = tiles.reshape(-1)
    spec: list[Entry] = []
    used: set[str] = set()
    for d in range(tiling.rank):
        count = tiles.shape[d]
        index = np.empty(mesh.size, dtype=int)
        index[dev] = idx[d]
        axes = mesh.axes_for(index, count)
        if axes is None or used & set(axes):
            return None
        used |= set(axes)
        spec.append(axes)
    return tuple(spec)
