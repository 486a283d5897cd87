"""Where does ``jax_to_torch``'s forward+backward time go? (issue #6)

On an H200 the jax calls of one forward+backward of ``x * y + z`` (64x64 fp32) cost ~490 us
when called directly, but ~1510 us inside a minimal ``torch.autograd.Function``; on CPU the
same wrapper costs only ~60 us. For CUDA tensors torch's autograd engine runs backward on a
per-device worker thread (a C++ thread holding a persistent Python thread state); on CPU it
runs on the caller. This probe separates the candidate causes:

* ``main:*`` / ``thr:*``  -- the same jax primitives (DLPack import/export, the jitted forward,
  jax.vjp forward, pullback) timed on the main thread vs *inside* a persistent Python worker
  thread (no hand-off in the timing): is jax itself slower off the main thread?
* ``handoff:*``           -- the same work submitted to that worker through a queue and waited
  for (what a thread switch + GIL hand-off adds);
* ``ag:*``                -- minimal autograd.Function variants: normal engine, engine with
  ``torch.autograd.set_multithreading_enabled(False)`` (CUDA backward on the *calling*
  thread), backward run from a worker thread (CPU emulation of the CUDA engine), with a
  1 us GIL switch interval, and ``torch.autograd.grad`` (no .grad accumulation);
* ``bridge:*``            -- ``jax_to_torch`` itself, normal and single-threaded engine;
* ``pin1:*``              -- a few of the above with *every* thread of the process pinned to
  one core: hand-offs become same-core context switches (no cross-core wake-up / idle-core
  C-state exit), which tells wake-up latency apart from work;
* an instrumented autograd.Function that timestamps the engine: forward body, engine ->
  backward start, the backward's import / pullback / export, backward end -> ``backward()``
  returning, and the final sync; the backward's jax work repeated on the (now warm) backward
  thread vs on the main thread; which thread ran backward, whether its Python thread-local
  state persists between calls, and how many jitted calls missed jax's C++ fast path (went
  through ``pjit._infer_params``) per call, per context.

Every timed call ends with ``torch.cuda.synchronize()`` on CUDA; jax-only primitives also
``block_until_ready`` (jax dispatch is asynchronous, on CPU too). ~5 s on CPU, well under a
minute on a GPU. A section that fails is reported in ``errors`` and the rest still runs.

    python scripts/probe_grad_overhead.py                 # cuda if available, else cpu
    python scripts/probe_grad_overhead.py --device cuda --out probe-h200.json
    python scripts/probe_grad_overhead.py --device cpu --jax-cpu-sync-dispatch

Prints a table and, last, one line ``PROBE_JSON {...}`` with everything.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.interop import fn, minimal_function, setup  # noqa: E402
from ejkernel_torch import interop  # noqa: E402
from ejkernel_torch._interop import _convert as cv  # noqa: E402

clock = time.perf_counter_ns


# -- jax fast-path miss counter ------------------------------------------------------------

class _MissCounter:
    """Counts jitted calls that left jax's C++ fast path (each goes through pjit._infer_params)."""

    def __init__(self):
        self.n = 0
        self.ok = False
        try:
            from jax._src import pjit

            orig = pjit._infer_params

            def counted(*a, **k):
                self.n += 1
                return orig(*a, **k)

            pjit._infer_params = counted
            jax.jit(lambda v: v * 3 + 1)(np.float32(1.0))  # a first call must miss: self-check
            self.ok = self.n > 0
        except Exception:  # jax moved it: report "unknown" (None), never a false 0
            pass

    def per_call(self, run, n):
        if not self.ok:
            return None
        before = self.n
        for _ in range(n):
            run()
        return (self.n - before) / n


# -- a persistent worker thread -----------------------------------------------------------

class Worker:
    """One persistent Python thread; ``call(f)`` runs f there and waits (queue hand-off)."""

    def __init__(self, device: str):
        self.cuda_index = torch.cuda.current_device() if device == "cuda" else None
        self.q_in: queue.SimpleQueue = queue.SimpleQueue()
        self.q_out: queue.SimpleQueue = queue.SimpleQueue()
        self.device = device
        self.thread = threading.Thread(target=self._loop, name="probe-worker", daemon=True)
        self.thread.start()

    def _loop(self):
        if self.cuda_index is not None:
            torch.cuda.set_device(self.cuda_index)
        while True:
            f = self.q_in.get()
            if f is None:
                return
            try:
                self.q_out.put((True, f()))
            except BaseException as err:  # report, keep the thread alive
                self.q_out.put((False, err))

    def call(self, f):
        self.q_in.put(f)
        ok, value = self.q_out.get()
        if not ok:
            raise value
        return value

    def close(self):
        self.q_in.put(None)
        self.thread.join(timeout=5)


# -- timing ------------------------------------------------------------------------------

def _stats(samples_ns):
    v = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {
        "median_us": float(np.median(v)),
        "p10_us": float(np.percentile(v, 10)),
        "p90_us": float(np.percentile(v, 90)),
        "n": int(v.size),
    }


def time_interleaved(variants: dict, rounds: int, per_round: int, warmup: int) -> dict:
    """Median timings, variants interleaved in rounds so machine drift hits them alike."""
    for f in variants.values():
        for _ in range(warmup):
            f()
    samples = {k: [] for k in variants}
    for _ in range(rounds):
        for name, f in variants.items():
            buf = samples[name]
            for _ in range(per_round):
                t0 = clock()
                f()
                buf.append(clock() - t0)
    return {k: _stats(v) for k, v in samples.items()}


def time_inside(worker: Worker, variants: dict, rounds: int, per_round: int, warmup: int) -> dict:
    """The same, with the whole timing loop running inside the worker thread."""
    return worker.call(lambda: time_interleaved(variants, rounds, per_round, warmup))


# -- the probe ---------------------------------------------------------------------------

def build(device: str, shape):
    env = setup(device, shape)
    xs, xs_g, ct, sync, jfn, jfwd, jbwd = env.xs, env.xs_g, env.ct, env.sync, env.jfn, env.jfwd, env.jbwd

    to_jax, to_torch = cv.tensor_to_jax, cv.array_to_torch
    a_fixed = [to_jax(t, None) for t in xs]
    out_fixed, pb_fixed = jfwd(*a_fixed)
    ct_j = to_jax(ct, None)
    sync()

    ready = jax.block_until_ready  # jax dispatch is asynchronous (on CPU too): wait for the result

    prim = {
        "import_1": lambda: (ready(to_jax(xs[0], None)), sync()),
        "export_1": lambda: (to_torch(out_fixed, None), sync()),
        "jit_fwd_nograd": lambda: (ready(jfn(*a_fixed)), sync()),
        "jit_fwd_nograd_dispatch": lambda: jfn(*a_fixed),  # no wait: the dispatch alone
        "jit_vjp_fwd": lambda: (ready(jfwd(*a_fixed)), sync()),
        "jit_pullback": lambda: (ready(jbwd(pb_fixed, ct_j)), sync()),
    }

    def raw_fwd():
        a = [to_jax(t, None) for t in xs]
        to_torch(jfn(*a), None)
        sync()

    def raw_bwd_only():
        grads = jbwd(pb_fixed, to_jax(ct, None))
        [to_torch(g, None) for g in grads]
        sync()

    def raw_grad():
        a = [to_jax(t, None) for t in xs_g]
        out, pullback = jfwd(*a)
        to_torch(out, None)
        grads = jbwd(pullback, to_jax(ct, None))
        [to_torch(g, None) for g in grads]
        sync()

    prim.update({"raw_fwd": raw_fwd, "raw_bwd_only": raw_bwd_only, "raw_grad": raw_grad})

    Minimal = minimal_function(jfwd, jbwd)

    return dict(xs=xs, xs_g=xs_g, ct=ct, sync=sync, jfn=jfn, jfwd=jfwd, jbwd=jbwd,
                a_fixed=a_fixed, pb_fixed=pb_fixed, ct_j=ct_j, prim=prim, Minimal=Minimal)


# torch >= 2.0. Careful: constructing set_multithreading_enabled(False) already flips the
# (thread-local) state -- it is also a function -- so only ever construct it in a ``with``.
_HAS_1THREAD = hasattr(torch.autograd, "set_multithreading_enabled")


def _single_thread_engine():
    return torch.autograd.set_multithreading_enabled(False)


def _multithreading_enabled():
    get = getattr(torch._C, "_is_multithreading_enabled", None)
    return bool(get()) if get is not None else None


class _SwitchInterval:
    def __init__(self, seconds):
        self.seconds = seconds

    def __enter__(self):
        self.old = sys.getswitchinterval()
        sys.setswitchinterval(self.seconds)

    def __exit__(self, *exc):
        sys.setswitchinterval(self.old)


def autograd_variants(b, worker: Worker, bridged):
    Minimal, xs_g, ct, sync = b["Minimal"], b["xs_g"], b["ct"], b["sync"]
    v = {}

    def torch_native_grad():
        fn(*xs_g).backward(ct)
        sync()

    def ag_min():
        Minimal.apply(*xs_g).backward(ct)
        sync()

    def ag_min_fwd_only():
        Minimal.apply(*xs_g)
        sync()

    def ag_min_autograd_grad():
        torch.autograd.grad(Minimal.apply(*xs_g), xs_g, ct)
        sync()

    def ag_min_bwd_in_worker():  # forward here, backward from another thread: CUDA-engine emulation
        out = Minimal.apply(*xs_g)
        worker.call(lambda: out.backward(ct))
        sync()

    def ag_min_switch_1us():
        with _SwitchInterval(1e-6):
            Minimal.apply(*xs_g).backward(ct)
            sync()

    def bridge_grad():
        bridged(*xs_g).backward(ct)
        sync()

    def bridge_grad_fwd_only():
        bridged(*xs_g)
        sync()

    v["torch_native_grad"] = torch_native_grad
    v["ag:min"] = ag_min
    v["ag:min_fwd_only"] = ag_min_fwd_only
    v["ag:min_autograd_grad"] = ag_min_autograd_grad
    v["ag:min_bwd_in_worker"] = ag_min_bwd_in_worker
    v["ag:min_switch_1us"] = ag_min_switch_1us
    v["bridge:grad"] = bridge_grad
    v["bridge:grad_fwd_only"] = bridge_grad_fwd_only
    if _HAS_1THREAD:
        def single(f):
            def run():
                with _single_thread_engine():
                    f()
            return run

        v["torch_native_grad_1thread"] = single(torch_native_grad)
        v["ag:min_1thread"] = single(ag_min)
        v["bridge:grad_1thread"] = single(bridge_grad)
    return v


class _PinAll:
    """Pin every thread of this process (torch's autograd workers and XLA's pools included) to
    ``cpus`` for the duration: thread hand-offs then stay on one core (no cross-core wake-up,
    no idle-core C-state exit). A diagnostic, not a recommendation."""

    def __init__(self, cpus):
        self.cpus = set(cpus)
        self.saved = {}

    def __enter__(self):
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            try:
                self.saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, self.cpus)
            except OSError:  # thread gone, or not permitted
                pass
        return self

    def __exit__(self, *exc):
        for tid, mask in self.saved.items():
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:
                pass


def pinned_variants(v: dict, prim: dict, worker: Worker):
    keep = ["torch_native_grad", "ag:min", "ag:min_1thread", "bridge:grad", "bridge:grad_1thread"]
    out = {"raw_grad": prim["raw_grad"], "handoff:noop": lambda: worker.call(lambda: None)}
    out.update({k: v[k] for k in keep if k in v})
    return {f"pin1:{k}": f for k, f in out.items()}


def instrumented(b, worker: Worker, n: int, misses: _MissCounter):
    """Timestamps inside a minimal autograd.Function, per engine mode."""
    xs_g, ct, sync, jfwd, jbwd = b["xs_g"], b["ct"], b["sync"], b["jfwd"], b["jbwd"]
    to_jax, to_torch = cv.tensor_to_jax, cv.array_to_torch
    main_ident = threading.get_ident()
    tls = threading.local()
    rec: dict = {}

    def stream_ptr():
        return torch.cuda.current_stream().cuda_stream if xs_g[0].is_cuda else None

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            rec["fwd_start"] = clock()
            a = [to_jax(t, None) for t in ts]
            out, ctx.pullback = jfwd(*a)
            o = to_torch(out, None)
            rec["fwd_stream"] = stream_ptr()
            rec["fwd_end"] = clock()
            return o

        @staticmethod
        def backward(ctx, g):
            rec["bwd_start"] = clock()
            rec["bwd_thread_is_main"] = threading.get_ident() == main_ident
            rec["bwd_thread_name"] = threading.current_thread().name
            rec["tls_persisted"] = getattr(tls, "mark", None) is not None
            tls.mark = 1
            rec["bwd_stream"] = stream_ptr()
            m0 = misses.n
            gj = to_jax(g, None)
            rec["bwd_imported"] = clock()
            grads = jbwd(ctx.pullback, gj)
            rec["bwd_pulled"] = clock()
            res = tuple(to_torch(x, None) for x in grads)
            rec["bwd_misses"] = misses.n - m0
            rec["bwd_end"] = clock()
            if rec.get("repeat"):  # the same jax work again, on this (now warm) thread
                reps = []
                for _ in range(rec["repeat"]):
                    t = clock()
                    [to_torch(x, None) for x in jbwd(ctx.pullback, to_jax(g, None))]
                    reps.append(clock() - t)
                rec["bwd_repeat_min"] = min(reps)
                rec["bwd_end_after_repeat"] = clock()
            return res

    def main_repeat(k):
        """The backward's jax work (import g, pullback, export), k times on the main thread."""
        out_j, pb = jfwd(*[to_jax(t, None) for t in xs_g])
        reps = []
        for _ in range(k):
            t = clock()
            [to_torch(x, None) for x in jbwd(pb, to_jax(ct, None))]
            reps.append(clock() - t)
        sync()
        return min(reps)

    def once(mode):
        t0 = clock()
        out = Timed.apply(*xs_g)
        t1 = clock()
        if mode == "engine":
            out.backward(ct)
        elif mode == "engine_1thread":
            with _single_thread_engine():
                out.backward(ct)
        elif mode == "bwd_in_worker":
            worker.call(lambda: out.backward(ct))
        t2 = clock()
        sync()
        t3 = clock()
        return {
            "apply_to_fwd_body": rec["fwd_start"] - t0,
            "fwd_body": rec["fwd_end"] - rec["fwd_start"],
            "fwd_body_to_apply_return": t1 - rec["fwd_end"],
            "backward_call_to_bwd_body": rec["bwd_start"] - t1,
            "bwd_import": rec["bwd_imported"] - rec["bwd_start"],
            "bwd_pullback": rec["bwd_pulled"] - rec["bwd_imported"],
            "bwd_export": rec["bwd_end"] - rec["bwd_pulled"],
            "bwd_body_to_backward_return": t2 - rec["bwd_end"],
            "final_sync": t3 - t2,
            "total": t3 - t0,
        }

    modes = ["engine", "bwd_in_worker"]
    if _HAS_1THREAD:
        modes.insert(1, "engine_1thread")
    result = {}
    for mode in modes:
        for _ in range(max(20, n // 5)):
            once(mode)
        rows = [once(mode) for _ in range(n)]
        seg = {k: float(np.median([r[k] for r in rows])) / 1e3 for k in rows[0]}
        m0 = misses.n
        for _ in range(50):
            once(mode)
        fp_rate = (misses.n - m0) / 50 if misses.ok else None
        # Warm-thread cost of the backward's jax work: repeated inside backward (bwd_repeat)
        # vs on the main thread (main_repeat); a gap here is jax on that thread, not hand-off.
        rec["repeat"] = 4
        reps = []
        for _ in range(max(10, n // 6)):
            once(mode)
            reps.append(rec["bwd_repeat_min"])
        rec["repeat"] = 0
        main_reps = [main_repeat(4) for _ in range(max(10, n // 6))]
        result[mode] = {
            "bwd_jax_work_repeat_min_us": float(np.median(reps)) / 1e3,
            "main_jax_work_repeat_min_us": float(np.median(main_reps)) / 1e3,
            "segments_median_us": seg,
            "bwd_thread_is_main": rec["bwd_thread_is_main"],
            "bwd_thread_name": rec["bwd_thread_name"],
            "bwd_thread_local_persists": rec["tls_persisted"],
            "same_stream_fwd_bwd": rec["fwd_stream"] == rec["bwd_stream"],
            "stream_ptrs": [rec["fwd_stream"], rec["bwd_stream"]],
            "fastpath_misses_per_call": fp_rate,
        }
    return result


def fastpath_misses(b, worker: Worker, misses: _MissCounter, n=50):
    jfn, jbwd, a, pb, ctj = b["jfn"], b["jbwd"], b["a_fixed"], b["pb_fixed"], b["ct_j"]
    out = {
        "main:jit_fwd": misses.per_call(lambda: jfn(*a), n),
        "main:pullback": misses.per_call(lambda: jbwd(pb, ctj), n),
    }
    out["thr:jit_fwd"] = worker.call(lambda: misses.per_call(lambda: jfn(*a), n))
    out["thr:pullback"] = worker.call(lambda: misses.per_call(lambda: jbwd(pb, ctj), n))
    return out


def read_results(med, derived, inst) -> list[str]:
    """A first reading of the numbers against the hypotheses (simple thresholds)."""
    out = []
    raw = med.get("main:raw_grad(ag_round)")
    ag, ag1 = med.get("ag:min"), med.get("ag:min_1thread")
    if raw and ag:
        out.append(f"autograd wrapper: {ag:.0f} us vs raw {raw:.0f} us ({ag / raw:.2f}x)"
                   + (f"; single-threaded engine {ag1:.0f} us ({ag1 / raw:.2f}x)" if ag1 else ""))
        if ag1 and ag - ag1 > 0.25 * raw:
            out.append("the engine's device worker thread costs "
                       f"{ag - ag1:.0f} us per backward: backward under "
                       "torch.autograd.set_multithreading_enabled(False) avoids it")
        elif ag1:
            out.append("the single-threaded engine does not help: the cost is not the worker thread")
    tp = derived.get("thread_penalty_raw_grad_x")
    if tp is not None:
        out.append(f"(a) jax work timed inside a Python worker thread vs main: {tp:.2f}x"
                   + (" -> jax is slower off the main thread" if tp > 1.25 else " -> no thread penalty"))
    eng = inst.get("engine", {})
    if eng:
        w, m = eng.get("bwd_jax_work_repeat_min_us"), eng.get("main_jax_work_repeat_min_us")
        if w and m:
            out.append(f"(a') backward's jax work repeated on the engine's thread {w:.0f} us vs main {m:.0f} us"
                       + (" -> jax is slower on torch's autograd thread" if w > 1.25 * m else " -> same"))
        seg = eng.get("segments_median_us", {})
        seg1 = inst.get("engine_1thread", {}).get("segments_median_us", {})
        if seg and seg1:
            hand = seg["backward_call_to_bwd_body"] + seg["bwd_body_to_backward_return"]
            hand1 = seg1["backward_call_to_bwd_body"] + seg1["bwd_body_to_backward_return"]
            body = seg["bwd_import"] + seg["bwd_pullback"] + seg["bwd_export"]
            body1 = seg1["bwd_import"] + seg1["bwd_pullback"] + seg1["bwd_export"]
            out.append(f"engine entry+exit {hand:.0f} us (1-thread {hand1:.0f}); backward body "
                       f"{body:.0f} us (1-thread {body1:.0f}); final sync {seg['final_sync']:.0f} us "
                       f"(1-thread {seg1['final_sync']:.0f})")
    tn, tn1 = med.get("torch_native_grad"), med.get("torch_native_grad_1thread")
    if tn and tn1:
        out.append(f"pure torch fwd+bwd: {tn:.0f} us, single-threaded engine {tn1:.0f} us "
                   "(the engine's own thread hand-offs)")
    sw = med.get("ag:min_switch_1us")
    if sw and ag:
        out.append(f"(b) 1 us GIL switch interval: {sw:.0f} us vs {ag:.0f} us"
                   + (" -> GIL hand-off matters" if sw < 0.8 * ag else " -> not the GIL switch interval"))
    h = med.get("handoff:noop")
    if h is not None:
        out.append(f"thread hand-off round trip (queue no-op): {h:.0f} us"
                   + (f"; pinned to one core {med['pin1:handoff:noop']:.0f} us" if "pin1:handoff:noop" in med else ""))
    pr = derived.get("pinned_autograd_over_raw_x")
    if pr is not None and raw and ag:
        out.append(f"(c) all threads pinned to one core: autograd/raw {pr:.2f}x (unpinned {ag / raw:.2f}x)"
                   + (" -> cross-core wake-up latency is a large part" if pr < 0.8 * ag / raw else ""))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if torch sees a GPU, else cpu")
    p.add_argument("--shape", type=int, nargs="+", default=[64, 64])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--per-round", type=int, default=75)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--no-pin", action="store_true", help="skip the pinned-to-one-core section")
    p.add_argument("--jax-cpu-sync-dispatch", action="store_true",
                   help="jax_cpu_enable_async_dispatch=False (CPU backend runs computations inline, "
                        "no hand-off to its worker thread per call)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA build of torch and a GPU")
    if args.jax_cpu_sync_dispatch:
        jax.config.update("jax_cpu_enable_async_dispatch", False)  # before the backend starts
    if device == "cuda":
        try:
            jax.devices("gpu")
        except RuntimeError as err:
            p.error(f"--device cuda needs a CUDA build of jax: {err}")
    t_start = time.time()
    mt_start = _multithreading_enabled()
    shape = tuple(args.shape)
    misses = _MissCounter()
    b = build(device, shape)
    worker = Worker(device)
    bridged = interop.jax_to_torch(fn)
    R, P, W = args.rounds, args.per_round, args.warmup
    errors: dict[str, str] = {}

    def section(name, run, default):
        try:
            return run()
        except Exception as err:  # keep going: one broken section must not lose the rest
            errors[name] = f"{type(err).__name__}: {err}"
            print(f"[probe] section {name} failed: {errors[name]}", file=sys.stderr)
            return default

    # Sanity: the minimal Function and the bridge compute torch's gradients.
    xs_g, ct = b["xs_g"], b["ct"]
    ref = [t.detach().clone().requires_grad_(True) for t in xs_g]
    fn(*ref).backward(ct)
    for f in (b["Minimal"].apply, bridged):
        for t in xs_g:
            t.grad = None
        f(*xs_g).backward(ct)
        for t, r in zip(xs_g, ref):
            torch.testing.assert_close(t.grad, r.grad)
    for t in xs_g:
        t.grad = None

    prim = b["prim"]
    timings: dict = {}
    # 1. jax primitives on the main thread vs inside the worker thread.
    timings.update(section("main", lambda: time_interleaved(
        {f"main:{k}": f for k, f in prim.items()}, R, P, W), {}))
    timings.update(section("thr", lambda: time_inside(
        worker, {f"thr:{k}": f for k, f in prim.items()}, R, P, W), {}))
    # 2. hand-off through the queue.
    timings.update(section("handoff", lambda: time_interleaved({
        "handoff:noop": lambda: worker.call(lambda: None),
        "handoff:raw_bwd_only": lambda: worker.call(prim["raw_bwd_only"]),
        "handoff:raw_grad": lambda: worker.call(prim["raw_grad"]),
    }, R, P, W), {}))
    # 3. autograd variants (interleaved with the raw round trip as the reference).
    ag = section("autograd", lambda: time_interleaved(
        {"main:raw_grad": prim["raw_grad"], **autograd_variants(b, worker, bridged)}, R, P, W), {})
    if "main:raw_grad" in ag:
        ag["main:raw_grad(ag_round)"] = ag.pop("main:raw_grad")
    timings.update(ag)

    # 3b. the same with every thread pinned to one core.
    def pinned():
        with _PinAll({min(os.sched_getaffinity(0))}):
            return time_interleaved(pinned_variants(autograd_variants(b, worker, bridged), prim, worker), R, P, W)

    if hasattr(os, "sched_setaffinity") and not args.no_pin:
        timings.update(section("pinned", pinned, {}))
    # 4. instrumentation.
    inst = section("instrumented", lambda: instrumented(b, worker, n=max(60, R * P // 3), misses=misses), {})
    fp = section("fastpath", lambda: fastpath_misses(b, worker, misses), {})
    worker.close()

    med = {k: v["median_us"] for k, v in timings.items()}

    def ratio(a, c):
        return med[a] / med[c] if a in med and c in med and med[c] > 0 else None

    def diff(a, c):
        return med[a] - med[c] if a in med and c in med else None

    raw = "main:raw_grad(ag_round)"
    derived = {
        "thread_penalty_raw_grad_x": ratio("thr:raw_grad", "main:raw_grad"),
        "thread_penalty_pullback_x": ratio("thr:jit_pullback", "main:jit_pullback"),
        "handoff_noop_us": med.get("handoff:noop"),
        "autograd_over_raw_x": ratio("ag:min", raw),
        "autograd_1thread_over_raw_x": ratio("ag:min_1thread", raw),
        "bridge_over_raw_x": ratio("bridge:grad", raw),
        "bridge_1thread_over_raw_x": ratio("bridge:grad_1thread", raw),
        "autograd_gap_us": diff("ag:min", raw),
        "autograd_1thread_gap_us": diff("ag:min_1thread", raw),
        "pinned_autograd_over_raw_x": ratio("pin1:ag:min", "pin1:raw_grad"),
        "pinned_bridge_over_raw_x": ratio("pin1:bridge:grad", "pin1:raw_grad"),
        "pinned_handoff_noop_us": med.get("pin1:handoff:noop"),
        "engine_gap_torch_native_us": diff("torch_native_grad", "torch_native_grad_1thread"),
    }
    verdict = section("verdict", lambda: read_results(med, derived, inst), [])

    result = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "switchinterval_s": sys.getswitchinterval(),
        "autograd_multithreading_enabled": [mt_start, _multithreading_enabled()],  # start, end
        "shape": list(shape),
        "timings": timings,
        "derived": derived,
        "instrumented": inst,
        "fastpath_misses_per_call": fp,
        "verdict": verdict,
        "jax_cpu_async_dispatch": not args.jax_cpu_sync_dispatch,
        "errors": errors,
        "elapsed_s": round(time.time() - t_start, 2),
    }

    # -- table --
    print(f"probe_grad_overhead: device={device} ({result['device_name']}), torch {torch.__version__}, "
          f"jax {jax.__version__}, python {result['python']}, shape {list(shape)}")
    print(f"{'variant':34s} {'median us':>10s} {'p10':>9s} {'p90':>9s}")
    for k, v in timings.items():
        print(f"{k:34s} {v['median_us']:10.1f} {v['p10_us']:9.1f} {v['p90_us']:9.1f}")
    print("\nderived:")
    for k, v in derived.items():
        print(f"  {k:34s} {v if v is None else round(v, 3)}")
    modes = list(inst)
    if modes:
        print("\ninstrumented minimal autograd.Function (median us per segment):")
        print(f"  {'segment':30s}" + "".join(f"{m:>16s}" for m in modes))
        for seg in inst[modes[0]]["segments_median_us"]:
            print(f"  {seg:30s}" + "".join(f"{inst[m]['segments_median_us'][seg]:16.1f}" for m in modes))
        for key in ("bwd_jax_work_repeat_min_us", "main_jax_work_repeat_min_us", "bwd_thread_is_main",
                    "bwd_thread_name", "bwd_thread_local_persists", "same_stream_fwd_bwd",
                    "fastpath_misses_per_call"):
            vals = [inst[m][key] for m in modes]
            print(f"  {key:30s}" + "".join(
                f"{v:16.1f}" if isinstance(v, float) else f"{str(v):>16s}" for v in vals))
    print(f"\njax C++ fast-path misses per call: {fp}")
    print("\nreading (thresholds, not proof):")
    for line in verdict:
        print("  - " + line)
    if errors:
        print(f"errors: {errors}")
    print(f"elapsed {result['elapsed_s']} s")
    line = json.dumps(result, separators=(",", ":"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("PROBE_JSON " + line)
    return result


if __name__ == "__main__":
    main()
