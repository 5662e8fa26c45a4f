"""The compiled kernel cache: Triton's own compiled artifacts, shipped beside the tables, loaded without compiling.

Layout, beside a GPU's tables (``<root>/<gpu>/``, ``root`` as for tables: ``$LIGER_GEN_TUNED_DIR``, the user
tables folder, the package's ``tuned/``)::

    <root>/<gpu>/compiled/triton-<version>-<backend>-<arch>/   e.g. triton-3.6.0-cuda-sm90
        manifest.json                  what is here, for which Triton and GPU, and the SHA-256 of every file
        <TRITON CACHE KEY>/<file>      Triton cache entries, in Triton's cache layout

An entry holds what Triton's own cache holds for a compiled kernel, minus the intermediate IRs: the metadata
``<kernel>.json`` and the binary (``.cubin``); and the host modules Triton builds with the system C compiler (its
``cuda_utils`` driver module and, on Triton versions that have them, one launcher per kernel signature). The
manifest indexes each kernel by (rendered module, kernel name, launch key; see ``liger_gen.codegen.launch``).

Loading: ``lookup`` (the launch layer's ``STORE`` hook) builds Triton's ``CompiledKernel`` straight from a
verified entry, so neither the Triton compiler nor its cache-key computation (which hashes Triton's 400 MB
library) runs. The host modules are served to Triton through its cache-manager hook (``triton.knobs.cache.
manager_class``): ``CompiledCacheManager`` answers for the keys in a usable store and hands every other key to
the cache manager that was configured before (Triton's ``FileCacheManager`` by default), so Triton's own cache
and everything else that compiles Triton kernels in the process work as before.

Trust: compiled kernels are code. A store inside the installed package is trusted like the package. A store
under a user folder (``$LIGER_GEN_TUNED_DIR``, the user tables folder) is used only where nobody but you and root
can change it or any folder on its path, checked on its real path (``untrusted_reason``, ``open_store``):

- The tables folder is resolved once (``real_root``): symbolic links in its path (an image's /opt/tuned ->
  /opt/tuned-v3) are followed, and the store is then checked and read under the real folders. Below the tables
  folder, ``<gpu>/``, ``compiled/``, the store and everything in it must be real folders and regular files.
- The store, and every folder and file in it, belongs to you or to root (an image's files) and is not writable
  by group or others.
- Every folder above the store up to the filesystem root (``compiled/``, ``<gpu>/``, the tables folder and all
  above them) belongs to you or to root, and is not writable by group or others unless it has the sticky bit
  (as /tmp, mode 1777): in a sticky folder only an entry's owner, the folder's owner and root may rename or
  remove the entry, and the entry on the store's path is itself checked, so no one else can swap it. This is
  ssh's StrictModes rule for the folders above ``~/.ssh``, taken to the filesystem root, with that exception.

A manifest must have every field of the expected type (``manifest_problem``); every file's SHA-256 is checked
against the manifest before Triton is given it. A store that breaks a rule, or was built for another Triton
version, GPU architecture or set of Triton's cache-invalidating environment variables, is not used; an entry
whose file is missing, truncated or altered is not used. Each of these gives one ``CompiledKernelWarning`` per
store and the kernel is compiled as without the cache.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import stat
import sysconfig
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from liger_gen._version import __version__
from liger_gen.files import not_private, write_atomic

SCHEMA = "liger-gen/compiled-kernels/1"
FOLDER = "compiled"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 * 2 ** 20
MAX_FILE_BYTES = 2 ** 30  # one compiled kernel file (cubins and host modules are kilobytes to a few MB)
ENV_DISABLE = "LIGER_GEN_COMPILED_KERNELS"  # "0": never load compiled kernels (always compile)
KEPT_SUFFIXES = (".json", ".cubin", ".hsaco", ".so")


class CompiledKernelWarning(UserWarning):
    """A compiled kernel cache (or one of its entries) cannot be used; its kernels are compiled instead."""


# ------------------------------------------------------------------------------------------ identity


def store_name(triton_version: str, backend: str, arch: int | str) -> str:
    """Folder name of a store: ``triton-3.6.0-cuda-sm90``."""
    return f"triton-{triton_version}-{backend}-sm{arch}" if backend == "cuda" else \
        f"triton-{triton_version}-{backend}-{arch}"


def base32_key(hex_key: str) -> str:
    """Triton's cache folder name for a hex cache key."""
    return base64.b32encode(bytes.fromhex(hex_key)).decode("utf-8").rstrip("=")


def cache_env() -> dict[str, str]:
    """Triton's cache-invalidating environment variables as it reads them now (part of every compile key)."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
    except ImportError:  # pragma: no cover - a Triton without it
        return {}
    return {str(k): str(v) for k, v in sorted(get_cache_invalidating_env_vars().items())}


def host_identity() -> dict[str, str]:
    """What the host modules (.so) depend on: the Python extension suffix and Triton's platform key."""
    try:
        from triton.runtime.build import platform_key
        platform = platform_key()
    except ImportError:  # pragma: no cover
        platform = ""
    return {"ext_suffix": sysconfig.get_config_var("EXT_SUFFIX") or "", "platform": platform}


def device_target(device_index: int) -> dict[str, Any]:
    """{"backend", "arch", "warp_size"} of a CUDA device from torch (Triton's driver is not touched: it may
    have to be built first, and that is what the store serves)."""
    import torch

    if torch.version.hip:
        name = torch.cuda.get_device_properties(device_index).gcnArchName.split(":")[0]
        return {"backend": "hip", "arch": name, "warp_size": 64}
    major, minor = torch.cuda.get_device_capability(device_index)
    return {"backend": "cuda", "arch": major * 10 + minor, "warp_size": 32}


# ------------------------------------------------------------------------------------------ stores


@dataclass
class Store:
    """One compiled kernel store on disk, after its manifest was read and its identity and trust checked."""

    path: Path
    label: str  # "packaged" or "user"
    manifest: dict
    verified: dict[str, bool] = field(default_factory=dict)  # relative file path -> hash matched
    warned: bool = False

    @property
    def kernels(self) -> dict[str, dict]:
        return self.manifest.get("kernels", {})

    @property
    def files(self) -> dict[str, dict]:
        return self.manifest.get("files", {})

    def check_file(self, rel: str) -> Path | None:
        """The path of ``rel`` if it is listed and its bytes match the manifest's SHA-256 and size, else None
        (one warning per store)."""
        if rel not in self.files:  # not an entry of this store (e.g. a host module for another Python)
            return None
        ok = self.verified.get(rel)
        if ok is None:
            ok = self._hash_matches(rel)
            self.verified[rel] = ok
            if not ok:
                self.warn(f"its file {rel} is missing or does not match the SHA-256 in {MANIFEST}")
        return self.path / rel if ok else None

    def _hash_matches(self, rel: str) -> bool:
        """Whether the regular file ``rel`` has the manifest's size and SHA-256 (read without blocking, at most its
        listed size plus one byte: a FIFO or device named like an entry is refused, not read)."""
        info = self.files.get(rel)
        if not isinstance(info, dict) or not valid_rel(rel):
            return False
        try:
            fd = os.open(self.path / rel, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
        except (OSError, ValueError):
            return False
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size != info["size"]:
                return False
            data = f.read(info["size"] + 1)
        return len(data) == info["size"] and hashlib.sha256(data).hexdigest() == info["sha256"]

    def group(self, directory: str, names: Iterable[str]) -> dict[str, str] | None:
        """{file name: path} of one Triton cache entry, every file verified, or None."""
        out = {}
        for name in names:
            path = self.check_file(f"{directory}/{name}")
            if path is None:
                return None
            out[name] = str(path)
        return out

    def warn(self, why: str) -> None:
        with _lock:
            if self.warned:
                return
            self.warned = True
        warnings.warn(f"liger-gen: not loading compiled kernels from {self.path}: {why}; the kernels it would "
                      f"serve are compiled instead", CompiledKernelWarning, stacklevel=4)


def read_manifest(path: Path) -> dict:
    """The parsed manifest at ``path``; ValueError (with the path and the reason) if it is not a readable manifest
    of this schema (``manifest_problem``): what reads a manifest from here on may index it without guarding."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ValueError(f"{path} has {st.st_size:,} bytes, more than a manifest may have")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a compiled kernel manifest (schema {SCHEMA})")
    problem = manifest_problem(data)
    if problem:
        raise ValueError(f"{path}: {problem} (rebuild the store with `liger-gen build`, or remove it)")
    return data


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(x, str) for x in v.values())


def _pairs(v: Any, first, second) -> bool:
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and first(p[0]) and second(p[1]) for p in v)


def _arg_path(v: Any) -> bool:  # Triton's key of a constant or attribute: the argument's index path
    return isinstance(v, list) and all(type(i) is int for i in v)


def _json_leaf(v: Any) -> bool:  # what ``_json_value`` writes: scalars and lists, never objects
    return not isinstance(v, dict)


def _target(v: Any) -> bool:
    return (isinstance(v, dict) and isinstance(v.get("backend"), str) and type(v.get("arch")) in (int, str)
            and type(v.get("warp_size", 0)) is int)


# the manifest's schema, one (field, required, check, what it must be) per field; write_store writes every field
_FIELDS = (
    ("triton", True, _is_str, "a string (the Triton version)"),
    ("target", True, _target, 'an object with a string "backend", an int or string "arch" and an int "warp_size"'),
    ("kernels", True, lambda v: isinstance(v, dict), "an object"),
    ("files", True, lambda v: isinstance(v, dict), "an object"),
    ("env", False, _str_map, "an object of strings"),
    ("host", False, _str_map, "an object of strings"),
    ("gpu", False, _is_str, "a string"),
    ("created", False, _is_str, "a string"),
    ("liger_gen", False, lambda v: v is None or isinstance(v, str), "a string or null"),
    ("built_for", False, lambda v: isinstance(v, list) and all(isinstance(b, dict) for b in v), "a list of objects"),
    ("skipped", False, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
)
_KERNEL_FIELDS = (
    ("dir", True, _is_str, "a string (its Triton cache folder)"),
    ("files", True, lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v), "a list of file names"),
    ("hash", True, _is_str, "a string"),
    ("signature", True, lambda v: _pairs(v, _is_str, _is_str), "a list of [name, type] pairs"),
    ("constants", True, lambda v: _pairs(v, _arg_path, _json_leaf), "a list of [[index, ...], value] pairs"),
    ("attrs", False, lambda v: _pairs(v, _arg_path, _json_leaf), "a list of [[index, ...], value] pairs"),
)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _got(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field_problem(record: dict, fields, where: str) -> str | None:
    for key, required, ok, what in fields:
        if key in record:
            if not ok(record[key]):
                return f"{where}'{key}' must be {what}, not {_got(record[key])}"
        elif required:
            return f"{where}'{key}' must be {what}, and is missing"
    return None


def manifest_problem(data: dict) -> str | None:
    """Why the parsed manifest ``data`` (an object of this ``SCHEMA``) is not well formed, or None: the one check
    of the type of every field, of every file entry and of every kernel record."""
    problem = _field_problem(data, _FIELDS, "")
    if problem:
        return problem
    for rel, info in data["files"].items():
        if not valid_rel(rel) or not isinstance(info, dict) or type(info.get("size")) is not int \
                or not 0 <= info["size"] <= MAX_FILE_BYTES or not isinstance(info.get("sha256"), str) \
                or not _SHA256.fullmatch(info["sha256"]):
            return (f"file entry {rel!r} must be '<KEY>/<name>' with an int size from 0 to {MAX_FILE_BYTES:,} bytes "
                    f"and a sha256 (64 hex digits)")
    for name, rec in data["kernels"].items():
        if not isinstance(rec, dict):
            return f"kernel {name!r} must be an object, not {_got(rec)}"
        problem = _field_problem(rec, _KERNEL_FIELDS, f"kernel {name!r}: ")
        if problem:
            return problem
        if not all(f"{rec['dir']}/{f}" in data["files"] for f in rec["files"]):
            return f"kernel {name!r} must name a folder and files the manifest lists"
    return None


_REL = re.compile(r"[A-Za-z0-9_.+-]+/[A-Za-z0-9_.+-]+")


def valid_rel(rel: Any) -> bool:
    """``<Triton cache key>/<file name>``: two plain names (no '..', no other separators)."""
    return isinstance(rel, str) and _REL.fullmatch(rel) is not None and ".." not in rel.split("/")


#: What a user store must be, after the reason one is not (the module docstring has the rules and why).
TRUST_RULE = ("a compiled kernel store, everything in it and every folder above it must belong to you or to root "
              "and not be writable by group or others (a folder above it may be if it has the sticky bit, as "
              "/tmp): chown or chmod go-w that folder, or move the store")


def untrusted_reason(folder: Path, ancestors: bool = True) -> str | None:
    """Why the user store at ``folder`` cannot be trusted, or None (the rules are in the module docstring): it, or
    a folder or file in it, belongs to another user (root excepted: an image's files), is writable by group or
    others, or is a symbolic link or not a regular file or folder; or (``ancestors``) a folder above it, up to
    the filesystem root, is a symbolic link, belongs to another user (root excepted), or is writable by group or
    others without the sticky bit. ``folder`` is read as given: resolve the tables folder first (``real_root``)."""
    folder = Path(folder).absolute()
    above = list(folder.parents) if ancestors else []
    for path in [*above, folder, *sorted(folder.rglob("*"))]:
        try:
            st = path.lstat()
        except OSError as exc:
            return f"{path} cannot be read ({exc})"
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            return f"{path} is not a regular file or folder"
        reason = not_private(st, allow_root=True, allow_sticky=path in above)
        if reason:
            return f"{path} is {reason}"
    return None


def real_root(root: str | os.PathLike) -> Path:
    """The tables folder ``root`` with every symbolic link in its path resolved, once: the folders whose trust is
    checked are then those the store is read from (an image's /opt/tuned -> /opt/tuned-v3 is /opt/tuned-v3)."""
    try:
        return Path(root).resolve()
    except (OSError, RuntimeError):  # a loop of links (RuntimeError before Python 3.13): checked as it is
        return Path(root).absolute()


def store_folders(root: str | os.PathLike, gpu: str) -> list[Path]:
    """The store folders (``triton-*`` holding a manifest) of ``gpu`` under the tables folder ``root``, sorted,
    on their real path (``real_root``); none when there is no such folder or it cannot be listed."""
    folder = real_root(root) / gpu / FOLDER
    try:
        return sorted(p for p in folder.iterdir() if p.name.startswith("triton-") and (p / MANIFEST).is_file())
    except OSError:  # no such folder (or unreadable): no store here
        return []


def open_store(path: Path, label: str) -> dict:
    """The manifest of the store folder ``path`` (from ``store_folders``) when a store of this label may be read
    from it: a user store must pass the trust rules (``untrusted_reason``), and the manifest must be valid
    (``read_manifest``). ValueError with the reason otherwise. The one gate of the runtime and ``verify``."""
    if label != "packaged":
        reason = untrusted_reason(path)
        if reason:
            raise ValueError(f"{reason}: {TRUST_RULE}")
    return read_manifest(path / MANIFEST)


def mismatch(manifest: dict, triton_version: str, target: dict, env: dict) -> str | None:
    """Why a manifest is not for this Triton, GPU architecture and Triton environment, or None."""
    if manifest.get("triton") != triton_version:
        return f"it was built by Triton {manifest.get('triton')}, and this is Triton {triton_version}"
    got = manifest.get("target", {})
    if (got.get("backend"), got.get("arch")) != (target["backend"], target["arch"]):
        return (f"it was built for {got.get('backend')} architecture {got.get('arch')}, and this GPU is "
                f"{target['backend']} {target['arch']}")
    if manifest.get("env", {}) != env:
        return f"Triton's cache-invalidating environment differs ({manifest.get('env')} against {env})"
    return None


def find_stores(gpu: str, triton_version: str, target: dict, env: dict,
                roots: list[tuple[str, Path]] | None = None) -> tuple[list[Store], list[str]]:
    """(usable stores in lookup order, one reason per store found but not usable) for ``gpu``."""
    from liger_gen.runtime import tables

    usable, refused = [], []
    for label, root in (tables.table_roots() if roots is None else roots):
        for path in store_folders(root, gpu):
            try:
                manifest = open_store(path, label)
                reason = mismatch(manifest, triton_version, target, env)
                if reason:
                    raise ValueError(reason)
            except ValueError as exc:
                refused.append(f"{path}: {exc}")
                continue
            usable.append(Store(path, label, manifest))
    return usable, refused


# ------------------------------------------------------------------------------------------ process state


_lock = threading.RLock()


@dataclass
class _State:
    stores: list[Store]
    kernels: dict[str, tuple[Store, dict]]  # "<stem>:<kernel>:<key>" -> (store, record)
    dirs: dict[str, Store]  # Triton cache folder name -> store holding it


_states: dict[int, _State | None] = {}
_refusal_warned: list[bool] = []
_previous_manager: list = []  # the cache manager class configured before ours (None: Triton's default)


def disabled() -> bool:
    """True when ``$LIGER_GEN_COMPILED_KERNELS`` is 0/false/no/off, or Triton is asked to dump, override, always
    compile or instrument kernels (then its own path must run)."""
    if os.environ.get(ENV_DISABLE, "").strip().lower() in ("0", "false", "no", "off"):
        return True
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover
        return True
    from liger_gen.codegen.launch import _instrumented

    c = knobs.compilation
    return bool(c.always_compile or c.override or c.dump_ir or _instrumented(knobs))


def state(device_index: int) -> _State | None:
    """The usable stores for the GPU at ``device_index`` (discovered once per process and device)."""
    with _lock:
        if device_index in _states:
            return _states[device_index]
        _states[device_index] = None
        if disabled():
            return None
        import triton

        from liger_gen.runtime.devices import current_gpu

        gpu = current_gpu(device_index)
        if gpu is None:
            return None
        try:
            stores, refused = find_stores(gpu[0], triton.__version__, device_target(device_index), cache_env())
        except Exception as exc:  # noqa: BLE001 - discovery must never stop training
            stores, refused = [], [f"the stores could not be read ({type(exc).__name__}: {exc})"]
        if refused and not stores and not _refusal_warned:
            _refusal_warned.append(True)  # once per process, whichever device asks first
            warnings.warn("liger-gen: no compiled kernel cache can be used here, so kernels are compiled at first "
                          "use: " + "; ".join(refused), CompiledKernelWarning, stacklevel=4)
        if not stores:
            return None
        kernels, dirs = {}, {}
        for store in stores:
            for name, rec in store.kernels.items():
                if isinstance(rec, dict) and name not in kernels:
                    kernels[name] = (store, rec)
            for rel in store.files:
                dirs.setdefault(rel.split("/", 1)[0], store)
        st = _State(stores, kernels, dirs)
        _states[device_index] = st
        install_cache_manager()
        return st


def clear() -> None:
    """Forget discovered stores (after building one or changing the tables folders)."""
    with _lock:
        _states.clear()
        _refusal_warned.clear()


def _restore_keys(pairs) -> dict:
    return {tuple(k): (tuple(v) if isinstance(v, list) else v) for k, v in pairs}


def lookup(module_stem: str, kernel_name: str, key_text: str, fn, device: int) -> Any:
    """Triton's ``CompiledKernel`` for a launch key from a usable store, loaded on the current device (index
    ``device``), or None."""
    st = state(device)
    if st is None:
        return None
    found = st.kernels.get(f"{module_stem}:{kernel_name}:{key_text}")
    if found is None:
        return None
    store, rec = found
    try:
        group = store.group(rec["dir"], rec["files"])
        if group is None:
            return None
        from triton.compiler import ASTSource, CompiledKernel

        signature = rec["signature"]
        if not isinstance(signature, list) or [name for name, _ in signature] != list(fn.arg_names):
            raise ValueError("its signature does not list the kernel's parameters in order")
        src = ASTSource(fn, {name: kind for name, kind in signature}, _restore_keys(rec["constants"]),
                        {tuple(k): v for k, v in rec.get("attrs", [])})
        compiled = CompiledKernel(src, group, rec["hash"])
        compiled.run  # noqa: B018 - loads the binary and its launcher now, so a failure falls back here
        return compiled
    except Exception as exc:  # noqa: BLE001 - a damaged entry must never stop training
        store.warn(f"its kernel {kernel_name} of {module_stem} could not be loaded ({type(exc).__name__}: {exc})")
        return None


def launch_failed(module_stem: str, kernel_name: str, key_text: str) -> None:
    """A kernel from a store could not be launched: warn (once per store) and forget the entry."""
    for st in list(_states.values()):
        found = st.kernels.pop(f"{module_stem}:{kernel_name}:{key_text}", None) if st is not None else None
        if found is not None:
            found[0].warn(f"its kernel {kernel_name} of {module_stem} could not be launched")


# ------------------------------------------------------------------------------------------ Triton's cache hook


def _fallback_manager():
    prev = _previous_manager[0] if _previous_manager else None
    if prev is None:
        from triton.runtime.cache import FileCacheManager

        return FileCacheManager
    return prev


def _make_manager_class():
    from triton.runtime.cache import CacheManager

    class CompiledCacheManager(CacheManager):
        """Serves the Triton cache keys of liger-gen's usable compiled kernel stores (files checked against their
        manifest); every other key, and every write, goes to the cache manager configured before."""

        def __init__(self, key, override=False, dump=False):
            self.key = key
            self._args = (key, override, dump)
            self._store = None if (override or dump) else _store_for_dir(key)
            self._inner = None if self._store is not None else _fallback_manager()(key, override, dump)

        @property
        def inner(self):
            if self._inner is None:
                self._inner = _fallback_manager()(*self._args)
            return self._inner

        def get_file(self, filename):
            if self._store is not None:
                path = self._store.check_file(f"{self.key}/{filename}")
                if path is not None:
                    return str(path)
            return self.inner.get_file(filename)

        def get_group(self, filename):
            if self._store is not None:
                names = sorted(rel.split("/", 1)[1] for rel in self._store.files
                               if rel.split("/", 1)[0] == self.key)
                if filename in names:
                    group = self._store.group(self.key, names)
                    if group is not None:
                        return group
            return self.inner.get_group(filename)

        def put(self, data, filename, binary=True):
            return self.inner.put(data, filename, binary=binary)

        def put_group(self, filename, group):
            return self.inner.put_group(filename, group)

        def __getattr__(self, name):  # cache_dir, has_file, ... of the manager configured before
            if name.startswith("_"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    return CompiledCacheManager


_manager_class: list = []


def _store_for_dir(key: str) -> Store | None:
    for st in list(_states.values()):
        if st is not None and key in st.dirs:
            return st.dirs[key]
    return None


def install_cache_manager() -> None:
    """Put ``CompiledCacheManager`` in Triton's cache-manager knob (once), keeping the configured one as fallback."""
    from triton import knobs

    with _lock:
        if _manager_class:  # installed once per process: a manager set since then may be delegating to ours
            return
        _manager_class.append(_make_manager_class())
        _previous_manager[:] = [knobs.cache.manager_class]
        knobs.cache.manager_class = _manager_class[0]


# ------------------------------------------------------------------------------------------ building a store


class Recorder:
    """Collects every kernel Triton compiles through the launch layer (``liger_gen.codegen.launch.RECORDERS``)."""

    def __init__(self):
        self.kernels: dict[str, Any] = {}

    def __call__(self, module_stem: str, kernel_name: str, key_text: str, compiled) -> None:
        if compiled is not None and getattr(compiled, "metadata_group", None):
            self.kernels.setdefault(f"{module_stem}:{kernel_name}:{key_text}", compiled)

    def __enter__(self):
        from liger_gen.codegen import launch

        launch.RECORDERS.append(self)
        return self

    def __exit__(self, *exc):
        from liger_gen.codegen import launch

        launch.RECORDERS.remove(self)


def _json_value(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    raise TypeError(f"{type(v).__name__} is not stored")


def kernel_record(compiled) -> tuple[dict, dict[str, str]]:
    """(manifest record, {file name: source path}) of one compiled kernel; TypeError if it cannot be stored."""
    src = compiled.src
    files = {name: path for name, path in compiled.metadata_group.items()
             if name.endswith(KEPT_SUFFIXES) and not name.startswith("__grp__")}
    if not any(name.endswith(".json") for name in files) or len(files) < 2:
        raise TypeError("no metadata or binary in its cache group")
    directory = base32_key(compiled.hash)
    rec = {"hash": compiled.hash, "dir": directory, "files": sorted(files),
           "signature": [[str(k), str(v)] for k, v in src.signature.items()],  # parameter order
           "constants": [[list(k), _json_value(v)] for k, v in sorted(src.constants.items())],
           "attrs": [[list(k), _json_value(v)] for k, v in sorted(getattr(src, "attrs", {}).items())]}
    return rec, files


def _mergeable(final: Path, triton_version: str, target: dict) -> dict:
    """The manifest of the existing store at ``final`` if its entries may be carried into a new one: readable,
    for this Triton, target and environment, private to you (or root), and every file matching its hash.
    Anything else is not merged (the new store starts afresh): a rebuild never vouches for files it did not
    check."""
    if not (final / MANIFEST).is_file():
        return {}
    try:
        old = read_manifest(final / MANIFEST)
    except ValueError:
        return {}
    if mismatch(old, triton_version, target, cache_env()) or untrusted_reason(final, ancestors=False):
        return {}
    store = Store(final, "user", old)
    return old if all(store._hash_matches(rel) for rel in old["files"]) else {}


def write_store(out_root: Path, gpu: str, recorder: Recorder, triton_cache_dir: Path, target: dict,
                built_for: dict | None = None, merge: bool = True) -> Path:
    """Write the kernels ``recorder`` collected, and the host modules under ``triton_cache_dir``, as the store for
    this Triton and ``target`` under ``<out_root>/<gpu>/compiled/``. With ``merge`` the entries of a store of the
    same name are kept when every one of its files checks out (several models share one store); otherwise it is
    replaced. Writers of one folder take turns (an exclusive lock on it); the store is built beside and renamed
    into place, so readers see the old store or the new one. Returns the store folder."""
    import triton

    from liger_gen.runtime import tables

    name = store_name(triton.__version__, target["backend"], target["arch"])
    parent = Path(out_root) / gpu / FOLDER
    for folder in (Path(out_root), Path(out_root) / gpu, parent):
        folder.mkdir(exist_ok=True, mode=0o755)
    final = parent / name
    with tables.locked(final):
        old = _mergeable(final, triton.__version__, target) if merge else {}
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}."))
        try:
            kernels = dict(old.get("kernels", {}))
            copies = {rel: final / rel for rel in old.get("files", {})}
            skipped = []
            for key, compiled in sorted(recorder.kernels.items()):
                try:
                    rec, files = kernel_record(compiled)
                except TypeError as exc:
                    skipped.append(f"{key}: {exc}")
                    continue
                kernels[key] = rec
                for fname, src_path in files.items():
                    copies[f"{rec['dir']}/{fname}"] = Path(src_path)
            for so in sorted(Path(triton_cache_dir).glob("*/*.so")):
                copies[f"{so.parent.name}/{so.name}"] = so
            manifest_files = {}
            for rel, src_path in sorted(copies.items()):
                dest = tmp / rel
                dest.parent.mkdir(exist_ok=True, mode=0o755)
                shutil.copyfile(src_path, dest, follow_symlinks=False)
                os.chmod(dest, 0o644)
                data = dest.read_bytes()
                manifest_files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            manifest = {
                "schema": SCHEMA, "gpu": gpu, "triton": triton.__version__, "target": dict(target),
                "env": cache_env(), "host": host_identity(), "liger_gen": __version__,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "built_for": [*old.get("built_for", []), *([built_for] if built_for else [])],
                "kernels": kernels, "files": manifest_files, "skipped": skipped,
            }
            write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            os.chmod(tmp, 0o755)
            if final.exists():
                retired = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.old."))
                final.rename(retired / name)
                tmp.rename(final)
                shutil.rmtree(retired, ignore_errors=True)
            else:
                tmp.rename(final)
            return final
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def store_summary(path: Path) -> dict[str, Any]:
    """Kernels, files and bytes of a store folder (for reports); ValueError if its manifest is not valid."""
    manifest = read_manifest(Path(path) / MANIFEST)
    return {"path": str(path), "triton": manifest.get("triton"), "target": manifest.get("target"),
            "kernels": len(manifest["kernels"]), "files": len(manifest["files"]),
            "bytes": sum(f["size"] for f in manifest["files"].values())}
