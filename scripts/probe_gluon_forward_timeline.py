"""Where a persistent Gluon forward tile's time goes: clock stamps per tile, on a Hopper GPU.

    python scripts/probe_gluon_forward_timeline.py [--kernel FILE] [--shapes B,SQ,SK,H,D,causal ...] [--out PATH]

Builds an instrumented copy of ``triton_kernels/flash_attention/gluon_forward.py`` (or of
``--kernel``, a variant with the same consumer loop): consumer warpgroup 0 reads the SM's
``%clock`` before it waits for a tile's query rows, after that wait, after the tile's last PV and
after its epilogue, and stores the four stamps with the tile's key-block counts. The ninth
feature input (``seed_ptr``, which the Gluon forward does not read) carries the buffer. The
instrumentation is text edits at fixed places of the source; a source that moved them fails
loudly here rather than timing something else. Each program also records the global timer
(nanoseconds) at its entry, before its warp-specialized region and at its exit, and ``%clock`` at
entry and exit: that places the tiles inside the launch (``launch`` in each row: programs' start
spread, setup, clock rate, the time before the first tile and after the last, the slowest
program's lead over the median, and the gap from one launch's last program to the next launch's
first, for two launches queued back to back; the last programs to end, with their SMs' ids, say
whether the slow ones share SMs or work).

Prints, per shape, the medians over all tiles of each phase in cycles, by (key blocks, masked
blocks): ``first_wait`` (the query rows' arrival), ``loop`` (QK^T of the first block to the last
PV), ``epilogue`` (normalise, store), and ``to_next`` (from one tile's epilogue to the next
tile's first stamp: the loop's bookkeeping, and whatever the epilogue left in flight). The
stamps order with the instructions around them only as issued, not as completed: a cost can
show up in the phase after the one that caused it. The instrumented kernel is not the plan's
kernel (its code is larger), so compare shapes and variants with each other, not its times with
the benchmark's.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = ["16,1024,1024,16,128,true", "16,1024,512,16,128,false", "16,1024,1024,16,128,false",
          "16,1024,1024,32,64,true", "16,1024,512,32,64,false", "4,4096,4096,16,128,true"]
MAX_TILES = 64  # stamped tiles a program (later ones are not recorded)
FIELDS = 8  # t0, t1, t2, t3, key blocks, first masked block, first row, written
# After a program's tiles: the global timer (ns, low 32 bits) at its entry, before the
# warp-specialized region and after it; %clock at entry and exit; its SM; written.
PROGRAM_FIELDS = 7
SLOWEST = 8  # programs listed by name in a launch's summary
STRIDE = MAX_TILES * FIELDS + PROGRAM_FIELDS  # int32 entries a program

_CLOCK = '''    @gluon.jit
    def _clock():
        return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _globaltimer():
        return gl.inline_asm_elementwise("mov.u32 $0, %globaltimer_lo;", "=r", [], dtype=gl.int32, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _smid():
        return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _mask('''

_RECORD = '''        t3 = _clock()
        if WG == 0:
            if tiles < {max_tiles}:
                rec = dbg + tiles * {fields}
                gl.store(rec, t0)
                gl.store(rec + 1, t1)
                gl.store(rec + 2, t2)
                gl.store(rec + 3, t3)
                gl.store(rec + 4, n_blocks)
                gl.store(rec + 5, first_masked)
                gl.store(rec + 6, m0)
                gl.store(rec + 7, 1)
'''

_EXIT = '''        exit_ns = _globaltimer()
        exit_clk = _clock()
        rec = seed_ptr + gl.program_id(0) * {stride} + {tiles}
        gl.store(rec, entry_ns)
        gl.store(rec + 1, setup_ns)
        gl.store(rec + 2, exit_ns)
        gl.store(rec + 3, entry_clk)
        gl.store(rec + 4, exit_clk)
        gl.store(rec + 5, _smid())
        gl.store(rec + 6, 1)
'''

# (text in the kernel's source, what replaces it[, how often it occurs]): once unless said. The
# consumer stamps t0 before it waits for a tile's query rows (either walk, static or claimed) and
# hands it to _consume_tile, which stamps the rest and records them.
_STAGE = ("            _stage_rows(o_desc, lse_ptr, o_rows, acc, m_i, l_i, row0, seq_q, b, h * HEAD_DIM, lse_base, "
          "BLOCK_N)\n")
_REGION_END = "            ], [4, 1], [232, 24])\n"  # the two-consumer warp_specialize call
_NEXT_WAIT = "mbarrier.wait(q_ready.index(tiles % 2), (tiles // 2) & 1)\n"
EDITS = [
    ("    @gluon.jit\n    def _mask(", _CLOCK),
    ("logit_scale, seq_q, seq_k, n_m, per_head, n_units) = state\n",  # in _consumer and _consume_tile
     "logit_scale, seq_q, seq_k, n_m, per_head, n_units, dbg_ptr) = state\n"
     f"        dbg = dbg_ptr + gl.program_id(0) * {STRIDE}\n", 2),
    ("            mbarrier.wait(q_ready.index(0), 0)\n",
     "            t0 = _clock()\n            mbarrier.wait(q_ready.index(0), 0)\n"),
    ("                tiles += 1\n                " + _NEXT_WAIT,  # the claimed walk's next tile
     "                tiles += 1\n                t0 = _clock()\n                " + _NEXT_WAIT),
    ("CAUSAL)\n                    " + _NEXT_WAIT,  # the static walk's
     "CAUSAL)\n                    t0 = _clock()\n                    " + _NEXT_WAIT),
    ("_consume_tile(state, o_desc,", "_consume_tile(t0, state, o_desc,", 3),  # the definition and both calls
    ("        buf = tiles % 2\n        if not CAUSAL:",
     "        t1 = _clock()\n        buf = tiles % 2\n        if not CAUSAL:"),
    # (a tile's work sits in the branch of parts before seq_q, so 12 spaces in)
    ("            lse_base = (b.to(gl.int64) * HEADS_Q + h) * seq_q\n",
     "            t2 = _clock()\n            lse_base = (b.to(gl.int64) * HEADS_Q + h) * seq_q\n"),
    (_STAGE, _STAGE + textwrap.indent(_RECORD.format(max_tiles=MAX_TILES, fields=FIELDS), "    ")),
    ("logit_scale, seq_q, seq_k, n_m, per_head, n_units)\n        if CONSUMERS == 3:",
     "logit_scale, seq_q, seq_k, n_m, per_head, n_units, seed_ptr)\n"
     "        setup_ns = _globaltimer()\n        if CONSUMERS == 3:"),
    ("        ROWS: gl.constexpr = 64\n        TILE_M: gl.constexpr = CONSUMERS * ROWS\n",
     "        entry_ns = _globaltimer()\n        entry_clk = _clock()\n"
     "        ROWS: gl.constexpr = 64\n        TILE_M: gl.constexpr = CONSUMERS * ROWS\n"),
    (_REGION_END, _REGION_END + _EXIT.format(tiles=MAX_TILES * FIELDS, stride=STRIDE)),
]


def instrument(source: str) -> str:
    """The kernel source with the clock stamps of ``EDITS``."""
    for old, new, *times in EDITS:
        want = times[0] if times else 1
        if source.count(old) != want:
            raise SystemExit(f"instrumentation point found {source.count(old)} times, not {want}:\n{old}")
        source = source.replace(old, new)
    return source


def _load(path: str):
    """The instrumented copy of the kernel file at ``path``, as a module."""
    from benchmarks.common import load_kernel_copy

    return load_kernel_copy(path, "gluon_timeline", instrument)[1]


def _stamps(module, b, sq, sk, h, d, causal):
    """Two back-to-back launches' records (``_records``), and the CUDA-event time a call over 20
    back-to-back calls."""
    import torch

    from ejkernel_torch.launch import device_facts, launch
    from ejkernel_torch.ops.flash_attention import _features
    from triton_kernels import flash_attention as fa
    from triton_kernels.flash_attention.plan import gluon_forward_plan

    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    spec = fa.dense_spec(q.shape, k.shape, v.shape, ("bfloat16",) * 3, causal=causal)
    plan = gluon_forward_plan(spec, device_facts(q.device), module.forward_consumers(d, causal, sq, sk))
    plan = dataclasses.replace(plan, kernel=module.flash_fwd_gluon_kernel)
    arrays = _features(q, k, v, None, None, None, None, None, None)
    buffers = [torch.zeros(plan.grid[0] * STRIDE, dtype=torch.int32, device="cuda") for _ in range(2)]
    arrays[8] = buffers[0]
    for _ in range(5):  # compile, warm up
        launch(plan, *arrays)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        launch(plan, *arrays)
    end.record()
    for buffer in buffers:
        buffer.zero_()
    torch.cuda.synchronize()
    per_call_us = start.elapsed_time(end) * 1000 / 20
    for buffer in buffers:  # queued together: the second starts as the first ends
        arrays[8] = buffer
        launch(plan, *arrays)
    torch.cuda.synchronize()
    return [_records(buffer.view(plan.grid[0], STRIDE).cpu().tolist()) for buffer in buffers], per_call_us


def _records(rows):
    """Per program: (stamped tiles (t0, t1, t2, t3, n_blocks, first_masked, m0), program record
    (entry_ns, setup_ns, exit_ns, entry_clock, exit_clock, sm))."""
    out = []
    for row in rows:
        tiles = [row[i:i + FIELDS] for i in range(0, MAX_TILES * FIELDS, FIELDS)]
        program = row[MAX_TILES * FIELDS:]
        if program[6] != 1:
            raise RuntimeError("a program did not write its record: the instrumented kernel did not finish")
        out.append(([t[:7] for t in tiles if t[7] == 1], program[:6]))
    return out


def summarize(programs) -> dict:
    """Median cycles of each phase by (key blocks, masked blocks), and the programs' spans."""
    phases = collections.defaultdict(lambda: collections.defaultdict(list))
    spans, to_next = [], []
    wrap = lambda a, b: (b - a) % 2**32  # noqa: E731 (32-bit clock differences)
    for tiles in programs:
        if not tiles:
            continue
        spans.append(wrap(tiles[0][0], tiles[-1][3]))
        for i, (t0, t1, t2, t3, n, first_masked, _) in enumerate(tiles):
            cell = phases[(n, n - first_masked)]
            cell["first_wait"].append(wrap(t0, t1))
            cell["loop"].append(wrap(t1, t2))
            cell["epilogue"].append(wrap(t2, t3))
            if i + 1 < len(tiles):
                to_next.append(wrap(t3, tiles[i + 1][0]))
    return {"program_span_cycles": {"median": statistics.median(spans), "max": max(spans)},
            "to_next_cycles_median": statistics.median(to_next) if to_next else None,
            "by_blocks": {f"{n} blocks, {masked} masked":
                          {name: round(statistics.median(v)) for name, v in cell.items()} | {"tiles": len(cell["loop"])}
                          for (n, masked), cell in sorted(phases.items())}}


def summarize_launch(first, second, per_call_us: float) -> dict:
    """A launch's shape in time from its programs' records (``_records``) of two back-to-back
    launches: when programs start and end, their clock rate, the time before their first tile
    and after their last, the gap to the next launch's first program, and the last programs to
    end (program id, SM, tiles, key blocks, how long after the median program). Microseconds."""
    wrap = lambda a, b: (b - a) % 2**32  # noqa: E731 (32-bit timer and clock differences)
    t_ref = min(p[0] for _, p in first)  # earliest entry; timestamps below are ns after it
    entry = [wrap(t_ref, p[0]) for _, p in first]
    exit_ = [wrap(t_ref, p[2]) for _, p in first]
    mhz = statistics.median(wrap(p[3], p[4]) / max(wrap(p[0], p[2]), 1) * 1e3 for _, p in first)
    before = [wrap(p[3], tiles[0][0]) for tiles, p in first if tiles]
    after = [wrap(tiles[-1][3], p[4]) for tiles, p in first if tiles]
    us = lambda ns: round(ns / 1e3, 2)  # noqa: E731
    return {"events_us_per_call": round(per_call_us, 2),
            "launch_span_us": us(max(exit_)),
            "entry_spread_us": us(max(entry)),
            "setup_us_median": us(statistics.median(wrap(p[0], p[1]) for _, p in first)),
            "program_us_median": us(statistics.median(x - e for e, x in zip(entry, exit_))),
            "tail_us": us(max(exit_) - statistics.median(exit_)),
            "clock_mhz_median": round(mhz),
            "before_first_tile_us_median": round(statistics.median(before) / mhz, 2) if before else None,
            "after_last_tile_us_median": round(statistics.median(after) / mhz, 2) if after else None,
            "gap_to_next_launch_us": us(min(wrap(t_ref, p[0]) for _, p in second) - max(exit_)),
            "slowest": [{"program": i, "sm": first[i][1][5], "tiles": len(first[i][0]),
                         "key_blocks": sum(t[4] for t in first[i][0]),
                         "after_median_us": us(exit_[i] - statistics.median(exit_))}
                        for i in sorted(range(len(first)), key=lambda i: -exit_[i])[:SLOWEST]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default=os.path.join(os.path.dirname(__file__), "..", "triton_kernels",
                                                         "flash_attention", "gluon_forward.py"))
    parser.add_argument("--shapes", nargs="*", default=SHAPES, help="batch,seq_q,seq_k,heads,head_dim,causal")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    module = _load(args.kernel)
    rows = []
    for text in args.shapes:
        *dims, causal = text.split(",")
        b, sq, sk, h, d = (int(x) for x in dims)
        (first, second), per_call_us = _stamps(module, b, sq, sk, h, d, causal == "true")
        row = {"shape": [b, sq, sk, h, d], "causal": causal == "true",
               "launch": summarize_launch(first, second, per_call_us),
               **summarize([tiles for tiles, _ in first])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from benchmarks.common import write_run

        write_run(args.out, rows, triton=triton.__version__, kernel=os.path.relpath(args.kernel))


if __name__ == "__main__":
    main()
