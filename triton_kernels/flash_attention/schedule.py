"""How the persistent Gluon kernels spread their tiles over the SMs: (grid, PAIRS).

A persistent kernel runs a program an SM, at most one a schedule unit, and each program walks
units in a static round robin (``gluon_forward._slot_tile``). Under a causal mask a unit pairs
a heavy tile with a light one, so that units weigh the same. That balances well when there are
many units an SM, but with few, a last partial round leaves SMs idle: 1.5 units an SM take as
long as 2. A program a tile lets the hardware balance the tiles instead (it starts the next
program wherever one ends), at the price of a program's start and end for every tile.
``persistent_schedule`` estimates both and takes the shorter.

The query-tile kernels (forward, dq) walk pairs only up to the last full round; the heads left
over go out tile by tile (``query_walk``, the Python mirror of ``gluon_forward._tail_slot_tile``),
which evens out the last round; where ``claims_tiles`` says so, the forward's programs claim the
tiles in that order from a counter instead. dk/dv keeps the plain round robin (``pair_walk``).

Work is counted in blocks: a 128-row tile against 128 rows of the other side, for one head.
"""
from __future__ import annotations

import heapq

from ..plan import cdiv

# From this many units an SM the round robin's last round costs at most an eighth: it stays.
ROUND_ROBIN_ALWAYS = 8
# A program's start and end (barriers, descriptors, the first loads, the epilogue), in blocks at
# head_dim 128: on an H100 a program a tile took 1.25x the persistent forward's time at seq 1024
# (8 blocks a tile), probe_flash_gluon_fwd-nvidia-h100-80gb-hbm3.json. At head_dim 64 a block
# takes half as long, so a start counts twice as many.
PROGRAM_START_BLOCKS = 2.0


def persistent_schedule(tile_work: list[float], rows: int, causal: bool, num_sms: int,
                        head_dim: int, tail: bool = False) -> tuple[tuple[int], bool]:
    """(grid, PAIRS) for ``rows`` (batch rows x heads) rows of tiles, tile i of a row weighing
    ``tile_work[i]`` blocks. PAIRS where a causal row has two tiles or more, unless a program
    a tile is estimated faster; then the grid is a program a tile and PAIRS false. ``tail``: the
    kernel walks ``query_walk``, not ``pair_walk`` (the query-tile kernels)."""
    n = len(tile_work)
    # Pairs only where a row has two tiles (Triton 3.6 fails to compile their code where seq_q is the constant 1).
    if not causal or n < 2:
        return (min(rows * n, num_sms),), False
    units = rows * cdiv(n, 2)  # a unit: tiles n - 1 - p and p of a row
    if units >= ROUND_ROBIN_ALWAYS * num_sms:
        return (num_sms,), True
    start = PROGRAM_START_BLOCKS * 128 / head_dim
    programs = min(units, num_sms)
    walk = query_walk if tail else pair_walk
    busiest = max(sum(tile_work[t] for _, t in walk(g, programs, rows, n)) for g in range(programs))
    if busiest + start <= _program_a_tile_time(tile_work, rows, start, num_sms):
        return (programs,), True
    return (rows * n,), False


def pair_walk(program: int, programs: int, rows: int, n_tiles: int,
              units_to: int | None = None) -> list[tuple[int, int]]:
    """(row, tile) in the order ``program`` of ``programs`` walks them under PAIRS
    (``gluon_forward._slot_tile``): units ``program``, ``program + G``, ... of the rows' units, a
    unit being tiles ``n_tiles - 1 - p`` and ``p`` of a row (the middle tile of an odd count alone).
    ``units_to``: only the units before it (``query_walk``'s pairs)."""
    per_head = cdiv(n_tiles, 2)
    end = rows * per_head if units_to is None else units_to
    walk = []
    for unit in range(program, end, programs):
        row, p = divmod(unit, per_head)
        walk.append((row, n_tiles - 1 - p))
        if 2 * p + 1 < n_tiles:
            walk.append((row, p))
    return walk


def query_walk(program: int, programs: int, rows: int, n_tiles: int) -> list[tuple[int, int]]:
    """(row, tile) in the order ``program`` of ``programs`` walks them in the causal forward and dq,
    mirroring ``gluon_forward._tail_slots`` and ``_tail_slot_tile`` step for step: pairs of whole
    rows up to the last full round, then the other rows' tiles one by one, largest (last) first,
    dealt in snake order: program G-1 to 0, then 0 to G-1, ..."""
    per_head = cdiv(n_tiles, 2)
    units = rows * per_head
    paired = units // programs * programs // per_head * per_head
    walk = pair_walk(program, programs, rows, n_tiles, units_to=paired)
    first_row = paired // per_head
    tail_rows = rows - first_row
    tail_tiles = tail_rows * n_tiles
    last = tail_tiles // programs  # the last, partial snake round
    lane = programs - 1 - program if last % 2 == 0 else program
    for s in range(last + (lane < tail_tiles % programs)):
        i = s * programs + (programs - 1 - program if s % 2 == 0 else program)
        walk.append((first_row + i % tail_rows, n_tiles - 1 - i // tail_rows))
    return walk


def claim_order(programs: int, rows: int, n_tiles: int, pairs: bool) -> list[tuple[int, int]]:
    """(row, tile) of claim 0, 1, ... of the forward's dynamic schedule, mirroring
    ``gluon_forward._claimable`` and ``_claimed_tile`` (the middle tile of an odd count, which
    does not exist as a second tile, left out): ``query_walk``'s tiles in the order the programs
    take them, without saying which program takes which."""
    if not pairs:
        return [(row, tile) for row in range(rows) for tile in range(n_tiles)]
    per_head = cdiv(n_tiles, 2)
    units = rows * per_head
    paired = units // programs * programs // per_head * per_head
    order = []
    for claim in range(2 * paired):
        row, p = divmod(claim // 2, per_head)
        if claim % 2 == 0:
            order.append((row, n_tiles - 1 - p))
        elif 2 * p + 1 < n_tiles:
            order.append((row, p))
    first_row = paired // per_head
    tail_rows = rows - first_row
    order += [(first_row + i % tail_rows, n_tiles - 1 - i // tail_rows) for i in range(tail_rows * n_tiles)]
    return order


def claims_tiles(tile_work: list[float], rows: int, causal: bool, head_dim: int, grid: int, pairs: bool) -> bool:
    """Whether the persistent forward claims its tiles from a counter (``gluon_forward._claimed_tile``,
    ``query_walk``'s order without the programs) instead of walking them statically: a program
    whose SM runs ahead then takes more tiles, so programs end together. Clock stamps had programs
    with equal work end up to 12 us apart under the static walk (8% of a causal call at seq 1024).

    Side by side with the static walk on an H100 (bf16, 16k tokens a batch; seq 1024 / 2048 /
    4096; benchmarks/results/ab_dynamic-static-vs-claimed-*.json and, for the kernel before it
    was a plan's choice, probe_gluon_forward_variants-dynamic-*.json), the static walk's time
    over the claiming kernel's was:

    - causal head_dim 128: 1.036-1.041 / 1.000-1.005 / 0.988-0.992;
    - causal head_dim 64: 1.007-1.010 / 1.007-1.014 / 0.996-1.000;
    - head_dim 64 without a mask: 1.03-1.04 / 1.05 / 1.06;
    - head_dim 128 without a mask: 0.97-0.98 (the static walk stays).

    Under a causal mask it pays in short calls only: up to ``CLAIM_MAX_BLOCKS`` key blocks a program
    (a head_dim 64 block counts half), 70 at seq 1024 and 132 at 2048 in those runs, 256 at 4096."""
    if not (pairs or grid < rows * len(tile_work)):  # a program a tile: nothing to balance
        return False
    if not causal:
        return head_dim == 64
    return sum(tile_work) * rows * head_dim / 128 / grid <= CLAIM_MAX_BLOCKS


# Blocks a program (head_dim 128) up to which a causal forward claims its tiles (``claims_tiles``).
CLAIM_MAX_BLOCKS = 192


def _program_a_tile_time(tile_work: list[float], rows: int, start: float, num_sms: int) -> float:
    """When the last SM finishes if each tile, in launch order, goes to the SM that frees first."""
    free_at = [0.0] * num_sms
    for _ in range(rows):
        for work in tile_work:
            heapq.heappush(free_at, heapq.heappop(free_at) + start + work)
    return max(free_at)
