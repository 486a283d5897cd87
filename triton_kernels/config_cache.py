"""One persistent cache of chosen kernel configs, shared by the torch and the jax front.

An entry is keyed by (device fingerprint, op, op version, shape/dtype key) and holds a plain
JSON config (block sizes, warps, stages). Both fronts build the same key for the same inputs on
the same device (the fingerprint and ``stable_json`` are framework-neutral), so once either
framework has tuned a config, both launch it and bitwise torch-vs-jax parity still holds.

By default nothing is tuned: ``get_config`` returns a cached entry or the op's heuristic.
Autotuning is opt-in, per call (``autotune=True``) or per process (``EJKERNEL_AUTOTUNE=1``).
The ops reach this module through ``triton_kernels.tuning`` (keys, candidates, memoized lookups).

The file (``EJKERNEL_CONFIG_CACHE``, default ``~/.cache/ejkernel/configs.json``, or
``<temp dir>/ejkernel-<uid>/configs.json`` where there is no home directory) is only ever
replaced whole (temp file in the same folder + ``os.replace``, keeping the file's permissions;
through a symlink, the file it names), so readers never see half a file; writers take an
exclusive ``flock`` on a side lock file around read-merge-write, so two processes storing at
once keep each other's entries. A corrupt or foreign file is ignored with
a warning, and moved aside (``<name>.bad``) before the next write; it never raises. A file that
could not be read (permissions, I/O errors) or is not a regular file is never moved or replaced:
stores then keep their entry in memory only. A folder given as the location (the variable, or
``get_cache``/``ConfigCache``'s path) holds ``configs.json``.

Standard library only: both fronts import this module.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import platform
import secrets
import shutil
import stat
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .params import stable_json

try:  # POSIX only; elsewhere writes are still atomic, but a race may drop one writer's entry
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

CACHE_ENV = "EJKERNEL_CONFIG_CACHE"
AUTOTUNE_ENV = "EJKERNEL_AUTOTUNE"
FORMAT = "ejkernel-config-cache"
FORMAT_VERSION = 1

Config = dict[str, Any]

# --------------------------------------------------------------------------------------------
# Host and device identity (formatting shared by both fronts, so their fingerprints agree)
# --------------------------------------------------------------------------------------------


@functools.cache
def cpu_fingerprint() -> str:
    """``cpu|<arch>|<model>``: what the Triton interpreter's speed depends on (read once)."""
    model = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    model = line.split(":", 1)[1].strip()
                    break
    return f"cpu|{platform.machine()}|{model or platform.processor()}"


def gpu_fingerprint(vendor: str, name: str, capability: tuple[int, int] | str, num_sms: int) -> str:
    """``cuda|NVIDIA H100 80GB HBM3|sm90|132sm`` from properties both frameworks expose."""
    if isinstance(capability, str):  # jax reports "9.0"
        capability = tuple(int(p) for p in capability.split(".")[:2])
    major, minor = capability
    return f"{vendor}|{name.strip()}|sm{major}{minor}|{int(num_sms)}sm"


def host_memory_usage() -> dict[str, int]:
    """Resident memory of this process and the machine's total, in bytes (Linux; 0 if unknown)."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    rss = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
    total = 0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        total = os.sysconf("SC_PHYS_PAGES") * page
    return {"allocated": rss, "reserved": rss, "limit": total}


# --------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheKey:
    """Where one chosen config lives. ``shapes`` may hold arrays and dtypes: it is kept as plain
    data (arrays as shape + dtype), so keys built by either front compare and hash equal."""

    device: str
    op: str
    version: int | str
    shapes: Any = None

    def __post_init__(self):
        object.__setattr__(self, "shapes", json.loads(stable_json(self.shapes)))

    def __eq__(self, other) -> bool:
        # By text, as stored: field equality would find causal=True equal to causal=1, two keys
        # with different hashes and different entries.
        return isinstance(other, CacheKey) and self.text == other.text

    def __hash__(self) -> int:
        return hash(self.text)

    @property
    def text(self) -> str:
        return stable_json([self.device, self.op, self.version, self.shapes])


def make_key(device: str, op: str, version: int | str, **shapes: Any) -> CacheKey:
    """``make_key(fp, "flash_attention_fwd", 1, q=q, k=k, causal=True)``."""
    return CacheKey(device, op, version, dict(shapes))


# --------------------------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------------------------


def cache_file(path: str | os.PathLike) -> Path:
    """The cache file at ``path``: a folder (one that exists, or a name ending in a separator)
    holds ``configs.json``. Every way of naming a location goes through here."""
    text = os.fsdecode(path)
    resolved = Path(text).expanduser()
    return resolved / "configs.json" if text.endswith(("/", os.sep)) or resolved.is_dir() else resolved


def default_cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return cache_file(env)
    try:
        return Path.home() / ".cache" / "ejkernel" / "configs.json"
    except (RuntimeError, KeyError):
        # No HOME and no passwd entry (a container run as an unnamed uid): every op call raised
        # "Could not determine home directory". A folder of this user's in the temp dir instead.
        user = os.getuid() if hasattr(os, "getuid") else "user"
        return Path(tempfile.gettempdir()) / f"ejkernel-{user}" / "configs.json"


def _normalize_config(config: Mapping[str, Any]) -> Config:
    """The config as it will read back from JSON (tuples become lists, etc.)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"a config must be a dict, got {type(config).__name__}")
    return json.loads(stable_json(dict(config)))


def _parse(text: str) -> tuple[dict[str, dict], str | None]:
    """Entries of a cache file's text, and why (part of) it was ignored, if it was."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        return {}, f"is not valid JSON ({e})"
    except RecursionError:  # "[[[[..." deeper than the parser recurses: garbage, not a crash of every op
        return {}, "is not valid JSON (nested too deeply)"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return {}, "is not an ejkernel config cache"
    if doc.get("version") != FORMAT_VERSION:
        return {}, f"has format version {doc.get('version')!r}, this library reads {FORMAT_VERSION}"
    raw = doc.get("entries")
    if not isinstance(raw, dict):
        return {}, "has no entries table"
    entries = {k: v for k, v in raw.items() if isinstance(v, dict) and isinstance(v.get("config"), dict)}
    problem = f"has {len(raw) - len(entries)} malformed entries" if len(entries) != len(raw) else None
    return entries, problem


# Generations are drawn from one counter for all ConfigCache objects: a memo keyed by the file
# (tuning.resolve) then never takes one object's generation for another's.
_generations = itertools.count(1)


class ConfigCache:
    """A view of one cache file. Reads are cheap (re-parsed only when the file changes)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = cache_file(path) if path is not None else default_cache_path()
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._entries: dict[str, dict] = {}
        self._local: dict[str, dict] = {}  # stored but not persisted (unwritable location)
        self._generation = next(_generations)

    # -- reading ------------------------------------------------------------------------------
    def _file_stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        # ctime too: a rewrite in place that keeps the size and restores the mtime (cp -p, rsync -t
        # --inplace, touch -r, tar) changes nothing else here, and the old entries were kept
        return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size

    def _read_file(self) -> tuple[dict[str, dict], str | None, bool]:
        """(entries, problem, whether the content is bad: the file may be moved aside).
        A file that could not be read is a problem but not bad content: it may be valid."""
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                return {}, "could not be read (not a regular file)", False
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}, None, False
        except OSError as e:
            return {}, f"could not be read ({e})", False
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            return {}, f"is not UTF-8 text ({e})", True
        entries, problem = _parse(text)
        return entries, problem, problem is not None and not entries

    def _refresh(self) -> None:
        """Re-read the file if it changed since the last read (one ``stat`` when it did not).
        Call with ``self._lock`` held."""
        stamp = self._file_stamp()
        if stamp != self._stamp:
            entries, problem, _ = self._read_file()
            if problem:  # once per version of the file, not on every lookup
                what = "ignoring those" if entries else "ignoring it"  # some entries may be good
                warnings.warn(f"config cache {self.path} {problem}; {what}", stacklevel=4)
            self._entries, self._stamp = entries, stamp
            self._generation = next(_generations)

    def generation(self) -> int:
        """A number that changes whenever the entries may have changed (the file was replaced,
        or an entry was kept in memory). Memos of lookups stay valid while it stays the same."""
        with self._lock:
            self._refresh()
            return self._generation

    def entries(self) -> dict[str, dict]:
        """All entries, keyed by ``CacheKey.text``."""
        with self._lock:
            self._refresh()
            return {**self._entries, **self._local}

    def lookup(self, key: CacheKey) -> Config | None:
        text = key.text
        with self._lock:
            self._refresh()
            entry = self._local.get(text) or self._entries.get(text)
        return dict(entry["config"]) if entry is not None else None

    # -- writing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _file_lock(self, target: Path):
        lock_path = target.with_name(target.name + ".lock")
        try:  # 0666 less the umask, like the cache file: a group sharing the folder shares the lock
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # another user's lock file: flock needs no write access
            fd = os.open(lock_path, os.O_RDONLY)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock; the lock file stays (deleting it races)

    def _temp_file(self, target: Path) -> tuple[int, str]:
        """A new file beside the cache file, with its permissions: those of the file it replaces,
        else 0666 less the umask, as ``open`` gives (mkstemp's 0600 took a shared cache away
        from its other readers, and undid any ``chmod`` at every store)."""
        tmp = str(target.with_name(f"{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(os.stat(self.path).st_mode))
        return fd, tmp

    def _replace(self, entries: dict[str, dict], target: Path) -> None:
        doc = {"format": FORMAT, "version": FORMAT_VERSION, "entries": entries}
        fd, tmp = self._temp_file(target)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def store(self, key: CacheKey, config: Mapping[str, Any], *, overwrite: bool = False,
              **meta: Any) -> Config:
        """Record ``config`` for ``key`` and return the config now on file for it.

        Unless ``overwrite``, an entry another process stored first is kept and returned: every
        process then converges on one config per key, which is what keeps torch and jax runs
        launching the same binary. An unwritable location warns and keeps the entry in memory.
        """
        config = _normalize_config(config)
        entry = {"config": config, "written": time.time(), **json.loads(stable_json(meta))}
        try:
            # A symlink's file, not the link: replacing the link cut it off from the file it names.
            target = Path(os.path.realpath(self.path))
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() and not target.is_file():  # no lock file beside /dev/null or a folder
                raise OSError("not a regular file")
            with self._file_lock(target):
                current, problem, bad = self._read_file()
                backup = target.with_name(target.name + ".bad")
                if bad:
                    os.replace(target, backup)
                    warnings.warn(f"config cache {self.path} {problem}; moved it to {backup}", stacklevel=2)
                elif problem and not current:  # unreadable: writing now would drop its entries
                    raise OSError(problem)
                old = current.get(key.text)
                if old is not None and not overwrite:
                    self._forget_local(key)
                    return dict(old["config"])
                if problem and not bad:  # malformed entries, which the rewrite drops: keep the file as it was
                    shutil.copyfile(target, backup)
                    warnings.warn(f"config cache {self.path} {problem}; dropping them (the file as it was is "
                                  f"in {backup})", stacklevel=2)
                current[key.text] = entry
                self._replace(current, target)
                with self._lock:  # this process sees its own write at once, whatever the clock's grain
                    self._entries, self._stamp = current, self._file_stamp()
                    self._local.pop(key.text, None)  # kept in memory when the location failed; on file now
                    self._generation = next(_generations)
        except OSError as e:
            warnings.warn(f"could not write config cache {self.path} ({e}); "
                          "the config is kept for this process only", stacklevel=2)
            with self._lock:
                self._local[key.text] = entry
                self._generation = next(_generations)
        return dict(config)

    def _forget_local(self, key: CacheKey) -> None:
        """Drop the in-memory entry for ``key``, if an earlier store kept one: the file's wins now."""
        with self._lock:
            if self._local.pop(key.text, None) is not None:
                self._generation = next(_generations)


_caches: dict[Path, ConfigCache] = {}
_caches_by_env: dict[str | None, ConfigCache] = {}  # hot path: no path arithmetic per call
_caches_lock = threading.Lock()


def get_cache(path: str | os.PathLike | None = None) -> ConfigCache:
    """The process-wide view of the cache at ``path`` (default: from ``EJKERNEL_CONFIG_CACHE``,
    which is read on every call, so changing the variable switches caches)."""
    if path is None:
        env = os.environ.get(CACHE_ENV) or None
        cache = _caches_by_env.get(env)
        if cache is None:
            cache = _caches_by_env[env] = get_cache(default_cache_path())
        return cache
    resolved = cache_file(path)
    with _caches_lock:
        if resolved not in _caches:
            _caches[resolved] = ConfigCache(resolved)
        return _caches[resolved]


# --------------------------------------------------------------------------------------------
# What ops call
# --------------------------------------------------------------------------------------------


def _is_bool(value: Any) -> bool:
    """A bool, numpy's too, without importing numpy here (this module stays framework-free):
    a numpy bool exists only once numpy is loaded."""
    np = sys.modules.get("numpy")
    return isinstance(value, bool) or (np is not None and isinstance(value, np.bool_))


def check_autotune(autotune: Any) -> None:
    """``autotune=`` must be True, False or None: ``bool("no")`` would turn tuning on."""
    if autotune is not None and not _is_bool(autotune):
        raise TypeError(f"autotune must be True, False or None, got {autotune!r}")


_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def autotune_enabled(autotune: bool | None = None) -> bool:
    """The explicit argument if given, else ``EJKERNEL_AUTOTUNE`` (1/true/yes/on; unset, empty or
    0/false/no/off: off). Other values raise: "2" or "enabled" silently left tuning off."""
    check_autotune(autotune)
    if autotune is not None:
        return bool(autotune)
    env = os.environ.get(AUTOTUNE_ENV, "")
    value = env.strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"{AUTOTUNE_ENV} must be one of {'/'.join(_ON)} (on) or {'/'.join(_OFF[1:])} "
                         f"or empty (off), got {env!r}")
    return value in _ON


def get_config(key: CacheKey, heuristic: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
               *, cache: ConfigCache | None = None) -> Config:
    """The cached config for ``key`` if one was tuned, else the heuristic's (not stored)."""
    hit = (cache or get_cache()).lookup(key)
    if hit is not None:
        return hit
    return _normalize_config(heuristic() if callable(heuristic) else heuristic)


def tune(key: CacheKey, candidates: Iterable[Mapping[str, Any]],
         bench_fn: Callable[[Config], float], *, cache: ConfigCache | None = None,
         force: bool = False, meta: Mapping[str, Any] | None = None) -> Config:
    """Time every candidate with ``bench_fn(config) -> seconds or ms``, store and return the best.

    A cached entry is returned without timing unless ``force``. Candidates that raise (e.g.
    out of shared memory) or time as non-finite are skipped; ties go to the earlier candidate,
    so the choice is deterministic given the timings. ``meta`` is stored beside the config
    (e.g. which framework tuned it).
    """
    cache = cache or get_cache()
    if not force:
        hit = cache.lookup(key)
        if hit is not None:
            return hit
    best, best_time, failures = None, math.inf, []
    for candidate in candidates:
        config = _normalize_config(candidate)
        try:
            t = float(bench_fn(dict(config)))
        except Exception as e:  # a config the device cannot run is just not a candidate
            failures.append(f"{config}: {type(e).__name__}: {e}")
            continue
        if math.isfinite(t) and t < best_time:
            best, best_time = config, t
    if best is None:
        detail = "; ".join(failures) or "no candidates given"
        raise RuntimeError(f"autotuning {key.op}: no candidate ran ({detail})")
    return cache.store(key, best, overwrite=force, **{**dict(meta or {}), "source": "autotune",
                                                      "time": best_time, "failed": len(failures)})


def select_config(key: CacheKey, heuristic: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
                  candidates: Iterable[Mapping[str, Any]] | None = None,
                  bench_fn: Callable[[Config], float] | None = None, *,
                  autotune: bool | None = None, cache: ConfigCache | None = None) -> Config:
    """The one call an op makes: cached config, else tuned (if enabled), else heuristic."""
    cache = cache or get_cache()
    hit = cache.lookup(key)
    if hit is not None:
        return hit
    if autotune_enabled(autotune) and candidates is not None and bench_fn is not None:
        return tune(key, candidates, bench_fn, cache=cache)
    return get_config(key, heuristic, cache=cache)


__all__ = [
    "AUTOTUNE_ENV", "CACHE_ENV", "CacheKey", "ConfigCache", "autotune_enabled", "cache_file", "check_autotune",
    "cpu_fingerprint",
    "default_cache_path", "get_cache", "get_config", "gpu_fingerprint", "host_memory_usage",
    "make_key", "select_config", "tune",
]
