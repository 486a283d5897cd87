"""The config cache shared by both fronts: round trip, opt-in autotuning, bad files, concurrency."""
from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from triton_kernels import config_cache as cc
from triton_kernels.config_cache import CacheKey, ConfigCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = CacheKey("cpu|test", "softmax", 1, {"x": {"shape": [4, 128], "dtype": "float32"}})
HEURISTIC = {"BLOCK": 128, "num_warps": 4}
CANDIDATES = [{"BLOCK": 64, "num_warps": 2}, {"BLOCK": 128, "num_warps": 4}, {"BLOCK": 256, "num_warps": 8}]


@pytest.fixture
def cache(tmp_path):
    return ConfigCache(tmp_path / "configs.json")


def fake_bench(times):
    calls = []

    def bench(config):
        calls.append(config)
        t = times[config["BLOCK"]]
        if isinstance(t, Exception):
            raise t
        return t

    bench.calls = calls
    return bench


def test_round_trip(cache):
    assert cache.lookup(KEY) is None
    stored = cache.store(KEY, {"BLOCK": 64, "shape": (1, 2)}, source="test")
    assert stored == {"BLOCK": 64, "shape": [1, 2]}  # what JSON gives back, also in this process
    fresh = ConfigCache(cache.path)  # another process's view
    assert fresh.lookup(KEY) == stored
    doc = json.loads(cache.path.read_text())
    assert doc["format"] == "ejkernel-config-cache" and doc["version"] == 1
    (entry,) = doc["entries"].values()
    assert entry["config"] == stored and entry["source"] == "test"
    other_shape = CacheKey(KEY.device, KEY.op, KEY.version, {"x": {"shape": [4, 256], "dtype": "float32"}})
    other_version = CacheKey(KEY.device, KEY.op, 2, KEY.shapes)
    other_device = CacheKey("cuda|H100|sm90|132sm", KEY.op, KEY.version, KEY.shapes)
    assert all(fresh.lookup(k) is None for k in (other_shape, other_version, other_device))


def test_reads_see_other_writers(cache):
    assert cache.lookup(KEY) is None
    ConfigCache(cache.path).store(KEY, {"BLOCK": 32})
    assert cache.lookup(KEY) == {"BLOCK": 32}


def test_reads_see_a_rewrite_in_place_that_keeps_size_and_mtime(cache):
    """``cp -p``, ``rsync -t --inplace``, ``touch -r``: same inode, same size, the old mtime."""
    cache.store(KEY, {"BLOCK": 32})
    before = os.stat(cache.path)
    assert cache.lookup(KEY) == {"BLOCK": 32}
    time.sleep(0.01)  # past a coarse clock's tick, so that only the mtime could hide the change
    with open(cache.path, "r+", encoding="utf-8") as f:
        text = f.read().replace('"BLOCK": 32', '"BLOCK": 64')
        f.seek(0)
        f.write(text)
    os.utime(cache.path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(cache.path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert cache.lookup(KEY) == {"BLOCK": 64}


def test_heuristic_by_default_and_never_stored(cache, monkeypatch):
    monkeypatch.delenv(cc.AUTOTUNE_ENV, raising=False)
    bench = fake_bench({64: 1.0, 128: 2.0, 256: 3.0})
    assert cc.select_config(KEY, HEURISTIC, CANDIDATES, bench, cache=cache) == HEURISTIC
    assert cc.get_config(KEY, lambda: HEURISTIC, cache=cache) == HEURISTIC
    assert bench.calls == [] and not cache.path.exists()


@pytest.mark.parametrize("how", ["argument", "env"])
def test_autotune_opt_in(cache, monkeypatch, how):
    monkeypatch.delenv(cc.AUTOTUNE_ENV, raising=False)
    kwargs = {"autotune": True} if how == "argument" else {}
    if how == "env":
        monkeypatch.setenv(cc.AUTOTUNE_ENV, "1")
    bench = fake_bench({64: 3.0, 128: 1.0, 256: RuntimeError("out of resources: shared memory")})
    assert cc.select_config(KEY, HEURISTIC, CANDIDATES, bench, cache=cache, **kwargs) == CANDIDATES[1]
    assert len(bench.calls) == 3
    # from now on every caller gets the tuned config without timing anything
    assert cc.select_config(KEY, {"BLOCK": 1}, CANDIDATES, bench, cache=cache, **kwargs) == CANDIDATES[1]
    assert cc.get_config(KEY, {"BLOCK": 1}, cache=ConfigCache(cache.path)) == CANDIDATES[1]
    assert len(bench.calls) == 3


def test_autotune_flag_parsing(monkeypatch):
    for value, expected in [("1", True), ("true", True), ("ON", True), (" yes ", True), ("0", False), ("", False),
                            ("false", False), ("No", False), ("off", False)]:
        monkeypatch.setenv(cc.AUTOTUNE_ENV, value)
        assert cc.autotune_enabled() is expected
    assert cc.autotune_enabled(False) is False
    for value in ("2", "enabled", "y", "-1"):  # were read as off, silently
        monkeypatch.setenv(cc.AUTOTUNE_ENV, value)
        with pytest.raises(ValueError, match=f"EJKERNEL_AUTOTUNE must be one of 1/true/yes/on .*got '{value}'"):
            cc.autotune_enabled()
        assert cc.autotune_enabled(True) is True  # the argument does not read the variable


@pytest.mark.parametrize("value", ["no", "", 1, 0, 1.0])
def test_autotune_must_be_a_bool_or_none(cache, monkeypatch, value):
    monkeypatch.setenv(cc.AUTOTUNE_ENV, "0")
    bench = fake_bench({64: 1.0, 128: 2.0, 256: 3.0})
    with pytest.raises(TypeError, match="autotune must be True, False or None"):
        cc.autotune_enabled(value)
    with pytest.raises(TypeError, match="autotune must be"):
        cc.select_config(KEY, HEURISTIC, CANDIDATES, bench, cache=cache, autotune=value)
    assert bench.calls == [] and not cache.path.exists()


def test_keys_are_equal_only_when_their_text_is():
    true, one = cc.make_key("cpu|x", "op", 1, causal=True), cc.make_key("cpu|x", "op", 1, causal=1)
    assert true.text != one.text and true != one  # True == 1 in Python, not in the file
    assert true == cc.make_key("cpu|x", "op", 1, causal=True) and len({true, one}) == 2
    assert cc.make_key("cpu|x", "op", 1) != cc.make_key("cpu|x", "op", "1")
    with pytest.raises(TypeError, match="mapping keys must be str"):  # {1: 5} would read as {"1": 5}
        cc.make_key("cpu|x", "op", 1, x={1: 5})


def test_tune_details(cache):
    bench = fake_bench({64: 2.0, 128: 2.0, 256: float("nan")})
    assert cc.tune(KEY, CANDIDATES, bench, cache=cache) == CANDIDATES[0]  # tie: earlier wins
    assert cc.tune(KEY, CANDIDATES, fake_bench({64: 9.0, 128: 1.0, 256: 9.0}), cache=cache) == CANDIDATES[0]
    assert cc.tune(KEY, CANDIDATES, fake_bench({64: 9.0, 128: 1.0, 256: 9.0}), cache=cache,
                   force=True) == CANDIDATES[1]
    assert ConfigCache(cache.path).lookup(KEY) == CANDIDATES[1]
    with pytest.raises(RuntimeError, match="no candidate ran.*boom"):
        cc.tune(CacheKey("d", "op", 1), CANDIDATES, fake_bench({b: ValueError("boom") for b in (64, 128, 256)}),
                cache=cache)


def test_first_stored_config_wins(cache):
    assert cache.store(KEY, {"BLOCK": 64}) == {"BLOCK": 64}
    assert ConfigCache(cache.path).store(KEY, {"BLOCK": 128}) == {"BLOCK": 64}
    assert cache.store(KEY, {"BLOCK": 128}, overwrite=True) == {"BLOCK": 128}


def test_both_frameworks_share_the_tuned_entry(cache, torch_fw, jax_fw):
    import numpy as np

    from ejkernel_jax.utils import config_key as jax_key
    from ejkernel_torch.utils import config_key as torch_key

    x = np.zeros((4, 128), np.float32)
    tuned = cc.tune(torch_key("softmax", 1, x=torch_fw.asarray(x, "bfloat16")), CANDIDATES,
                    fake_bench({64: 3.0, 128: 2.0, 256: 1.0}), cache=cache)
    assert tuned == CANDIDATES[2]
    assert cc.get_config(jax_key("softmax", 1, x=jax_fw.asarray(x, "bfloat16")), HEURISTIC, cache=cache) == tuned
    assert cc.get_config(jax_key("softmax", 1, x=jax_fw.asarray(x, "float16")), HEURISTIC, cache=cache) == HEURISTIC


@pytest.mark.parametrize("content, why", [
    ("{not json", "not valid JSON"),
    ('{"some": "other tool"}', "not an ejkernel config cache"),
    ('{"format": "ejkernel-config-cache", "version": 99, "entries": {}}', "format version 99"),
    ("\udcff", "not UTF-8"),
    ("[" * 100_000, "not valid JSON"),  # json raised RecursionError: every op and store crashed
])
def test_corrupt_or_foreign_file_is_ignored(cache, content, why):
    cache.path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.warns(UserWarning, match=why):
        assert cache.lookup(KEY) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per version of the file, not per lookup
        assert cc.get_config(KEY, HEURISTIC, cache=cache) == HEURISTIC
    with pytest.warns(UserWarning, match="moved it to"):
        cache.store(KEY, {"BLOCK": 8})
    assert cache.path.with_name("configs.json.bad").read_bytes() == content.encode("utf-8", "surrogateescape")
    assert ConfigCache(cache.path).lookup(KEY) == {"BLOCK": 8}


def test_malformed_entries_are_dropped(cache):
    cache.store(KEY, {"BLOCK": 16})
    doc = json.loads(cache.path.read_text())
    doc["entries"]["junk"] = "not an entry"
    cache.path.write_text(json.dumps(doc))
    before = cache.path.read_text()
    with pytest.warns(UserWarning, match="1 malformed entries; ignoring those"):  # the good one is used
        assert ConfigCache(cache.path).lookup(KEY) == {"BLOCK": 16}
    other = cc.make_key("dev", "other", 1)
    with pytest.warns(UserWarning, match="1 malformed entries; dropping them"):
        ConfigCache(cache.path).store(other, {"BLOCK": 8})
    assert cache.path.with_name("configs.json.bad").read_text() == before  # what the rewrite dropped is kept
    assert "junk" not in json.loads(cache.path.read_text())["entries"]
    assert ConfigCache(cache.path).lookup(KEY) == {"BLOCK": 16}


def _store_kept_in_memory(cache: ConfigCache, key, config) -> None:
    """``cache.store`` while a file stands where the cache's folder goes; the folder is back after."""
    folder = cache.path.parent
    shutil.rmtree(folder, ignore_errors=True)
    folder.write_text("")
    with pytest.warns(UserWarning, match="could not write"):
        cache.store(key, config)
    folder.unlink()
    folder.mkdir()


def test_a_config_kept_in_memory_gives_way_to_the_file(tmp_path):
    """A store that could not write keeps its entry in memory; once the file holds an entry for
    the key, this process reads that one, as every other process does."""
    cache = ConfigCache(tmp_path / "d" / "configs.json")
    _store_kept_in_memory(cache, KEY, {"BLOCK": 16})
    assert cache.store(KEY, {"BLOCK": 64}, overwrite=True) == {"BLOCK": 64}
    assert cache.lookup(KEY) == ConfigCache(cache.path).lookup(KEY) == {"BLOCK": 64}

    _store_kept_in_memory(cache, KEY, {"BLOCK": 16})
    ConfigCache(cache.path).store(KEY, {"BLOCK": 32})  # another process stores first
    assert cache.store(KEY, {"BLOCK": 4}) == {"BLOCK": 32}  # not overwritten: the file's entry
    assert cache.lookup(KEY) == {"BLOCK": 32}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_no_lock_file_beside_a_path_that_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "configs.json"
    os.mkfifo(fifo)
    with pytest.warns(UserWarning, match="could not write.*not a regular file"):
        assert ConfigCache(fifo).store(KEY, {"BLOCK": 16}) == {"BLOCK": 16}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs.json"]


def test_unwritable_location_warns_and_keeps_config_in_memory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cache = ConfigCache(blocker / "configs.json")  # its folder cannot be created
    with pytest.warns(UserWarning, match="could not write"):
        assert cache.store(KEY, {"BLOCK": 4}) == {"BLOCK": 4}
    assert cache.lookup(KEY) == {"BLOCK": 4}


def test_a_folder_holds_the_cache_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "_caches", {})
    monkeypatch.setattr(cc, "_caches_by_env", {})
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    new_folder = str(tmp_path / "new") + os.sep  # a trailing separator names a folder to create
    monkeypatch.setenv(cc.CACHE_ENV, str(folder))
    assert cc.get_cache(folder) is cc.get_cache(folder / "configs.json") is cc.get_cache()
    for cache in (cc.get_cache(folder), ConfigCache(folder), ConfigCache(str(folder)), ConfigCache(new_folder)):
        assert cache.path.name == "configs.json" and cache.path.parent in (folder, tmp_path / "new")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cache.store(KEY, {"BLOCK": 16}) == {"BLOCK": 16}
    assert (folder / "keep.txt").read_text() == "mine" and not list(tmp_path.glob("*.bad"))
    assert ConfigCache(folder / "configs.json").lookup(KEY) == {"BLOCK": 16}
    assert ConfigCache(tmp_path / "new" / "configs.json").lookup(KEY) == {"BLOCK": 16}


def test_only_a_regular_file_with_bad_content_is_moved_aside(tmp_path):
    cache = ConfigCache(tmp_path / "configs.json")
    cache.path.mkdir()  # a folder appears where the file was named
    (cache.path / "keep.txt").write_text("mine")
    with pytest.warns(UserWarning, match="could not write.*not a regular file"):
        assert cache.store(KEY, {"BLOCK": 16}) == {"BLOCK": 16}
    assert (cache.path / "keep.txt").read_text() == "mine" and not list(tmp_path.glob("*.bad"))
    with pytest.warns(UserWarning, match="not a regular file.*ignoring it"):
        assert cache.lookup(KEY) == {"BLOCK": 16}  # kept for this process


def test_a_read_error_never_moves_the_file_aside(cache, monkeypatch):
    cache.store(KEY, {"BLOCK": 16})
    before = cache.path.read_bytes()
    real_open = pathlib.Path.open

    def failing_open(self, *args, **kwargs):  # a transient EIO, EMFILE, permission error...
        if self == cache.path:
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", failing_open)
    other = ConfigCache(cache.path)
    other_key = CacheKey(KEY.device, "other", 1)
    with pytest.warns(UserWarning, match="could not write.*could not be read.*Input/output error"):
        assert other.store(other_key, {"BLOCK": 32}) == {"BLOCK": 32}
    monkeypatch.undo()
    assert cache.path.read_bytes() == before and not list(cache.path.parent.glob("*.bad"))
    assert ConfigCache(cache.path).lookup(KEY) == {"BLOCK": 16}


def test_stores_keep_the_file_readable_and_its_mode(cache):
    """The file was written through mkstemp: every store left it 0600, whatever its mode was, and
    a cache shared with other users (or groups) became unreadable to them."""
    umask = os.umask(0o022)
    os.umask(umask)
    cache.store(KEY, {"BLOCK": 16})
    assert stat.S_IMODE(cache.path.stat().st_mode) == 0o666 & ~umask  # as open() creates files
    cache.path.chmod(0o664)
    cache.store(CacheKey(KEY.device, "other", 1), {"BLOCK": 32})
    assert stat.S_IMODE(cache.path.stat().st_mode) == 0o664
    assert ConfigCache(cache.path).lookup(KEY) == {"BLOCK": 16}


def test_the_lock_file_can_be_shared(cache, monkeypatch):
    """The lock file was created 0644 whatever the umask: in a cache folder shared by a group
    (umask 002), the next user could not open it for writing, and every store of theirs failed."""
    umask = os.umask(0o002)
    try:
        cache.store(KEY, {"BLOCK": 16})
    finally:
        os.umask(umask)
    lock = cache.path.with_name(cache.path.name + ".lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o664 == stat.S_IMODE(cache.path.stat().st_mode)
    # Another user's lock file that is not writable to us: flock needs no write access.
    real_open = os.open

    def refuse_writing_the_lock(path, flags, *args):
        if str(path).endswith(".lock") and flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_writing_the_lock)
    other = CacheKey(KEY.device, "other", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a store that fell back to memory would warn
        assert cache.store(other, {"BLOCK": 32}) == {"BLOCK": 32}
    assert ConfigCache(cache.path).lookup(other) == {"BLOCK": 32}


def test_a_symlinked_cache_file_is_written_through(tmp_path):
    """A store replaced the link itself with a regular file: the file it named (a shared cache,
    say) never got the entry, and later stores went to the copy."""
    shared = ConfigCache(tmp_path / "shared" / "configs.json")
    shared.store(KEY, {"BLOCK": 16})
    (tmp_path / "mine").mkdir()
    link = tmp_path / "mine" / "configs.json"
    link.symlink_to(shared.path)
    other = CacheKey(KEY.device, "other", 1)
    assert ConfigCache(link).store(other, {"BLOCK": 32}) == {"BLOCK": 32}
    assert link.is_symlink() and ConfigCache(shared.path).lookup(other) == {"BLOCK": 32}
    assert ConfigCache(link).lookup(KEY) == {"BLOCK": 16}
    assert sorted(p.name for p in link.parent.iterdir()) == ["configs.json"]  # no lock or temp file left here


def test_location_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path / "mine.json"))
    assert cc.default_cache_path() == tmp_path / "mine.json"
    assert cc.get_cache() is cc.get_cache(tmp_path / "mine.json")
    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path))
    assert cc.default_cache_path() == tmp_path / "configs.json"
    monkeypatch.delenv(cc.CACHE_ENV)
    assert cc.default_cache_path().parts[-3:] == (".cache", "ejkernel", "configs.json")


WRITER = textwrap.dedent("""
    import json, sys, time
    from triton_kernels.config_cache import CacheKey, ConfigCache
    path, who, n, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    cache = ConfigCache(path)
    while time.time() < start:  # both writers begin together
        time.sleep(0.001)
    won = cache.store(CacheKey("dev", "race", 1), {"writer": who})
    for i in range(n):
        cache.store(CacheKey("dev", f"op-{who}", 1, {"i": i}), {"i": i, "writer": who})
    print(json.dumps(won))
""")


def test_two_processes_writing_at_once(tmp_path):
    path = tmp_path / "configs.json"
    n, start = 40, time.time() + 1.0
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, str(n), str(start)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT})
             for who in ("a", "b")]
    reads = 0
    while any(p.poll() is None for p in procs):  # a reader never sees a half-written file
        if path.exists():
            doc = json.loads(path.read_text())
            assert doc["format"] == "ejkernel-config-cache"
            reads += 1
        time.sleep(0.002)
    results = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert reads > 0
    entries = ConfigCache(path).entries()
    assert len(entries) == 2 * n + 1  # nobody lost anybody's entries
    for who in ("a", "b"):
        for i in range(n):
            assert ConfigCache(path).lookup(CacheKey("dev", f"op-{who}", 1, {"i": i})) == {"i": i, "writer": who}
    # both processes ended up with the same config for the key they raced on
    won = {out.strip() for out, _ in results}
    assert len(won) == 1 and json.loads(won.pop()) == ConfigCache(path).lookup(CacheKey("dev", "race", 1))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
