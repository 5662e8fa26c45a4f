"""Write rendered kernel modules to a content-addressed cache and import them.

A variant's module lives at ``<cache>/<op>_<sha256 of its source>.py``. The file is written atomically (a
temporary file in the same directory, then ``os.replace``), so two processes that render the same variant at
once both end up importing one complete file. Before a cached file is imported its bytes are compared with what
the renderer produces now; a file that does not match is re-written, never imported. The cache directory must
belong to the current user and must not be writable by others.

Cache directory: ``$LIGER_GEN_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/liger_gen/kernels`` (default
``~/.cache/liger_gen/kernels``). Where it cannot be used (a read-only ``$HOME`` in a container, a folder another user
owns or others may write), one ``KernelCacheWarning`` names the folder, the reason and ``LIGER_GEN_CACHE_DIR``, and
the process renders its kernel modules in memory only: they are compiled from the rendered text either way (Triton
reads a kernel's source through ``linecache``, which is served the same text), so nothing else changes.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from liger_gen.codegen.launch import wrap_module_kernels
from liger_gen.codegen.render import render, source_hash
from liger_gen.files import not_private, write_atomic

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_warned_dirs: set[str] = set()
ENV_CACHE_DIR = "LIGER_GEN_CACHE_DIR"
IN_MEMORY = Path("<liger_gen in-memory kernels>")  # the file name rendered modules get without a usable cache


class KernelCacheWarning(UserWarning):
    """The kernel cache folder cannot be used; kernel modules are rendered in memory for this process."""


def cache_dir() -> Path:
    """The kernel cache directory (created with mode 0700 if missing)."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        root = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME")
        if not base:
            try:
                base = Path.home() / ".cache"
            except RuntimeError as exc:  # no $HOME and no passwd entry (a container run as an arbitrary uid)
                raise FileNotFoundError(f"no home directory for the default kernel cache ({exc})") from exc
        root = Path(base) / "liger_gen" / "kernels"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_owner(root)
    return root


def _check_owner(path: Path) -> None:
    """Refuse a cache directory that another user owns or that others may write: its files get imported."""
    reason = not_private(path.stat())
    if reason:
        raise PermissionError(f"kernel cache {path} is {reason}")


def materialize(op: str, params: Mapping[str, Any]) -> tuple[Path, str]:
    """Render the variant and make sure its file exists in the cache with exactly that content.

    Returns the path and the rendered source.
    """
    source = render(op, params)
    name = f"{op}_{source_hash(source)}.py"
    try:
        path = cache_dir() / name
        try:
            current = path.read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            current = None
        if current != source:
            write_atomic(path, source, mode=None, fsync=True)
    except OSError as exc:  # unwritable, foreign-owned, group-writable, a file in the way, disk full
        _warn_cache_unusable(exc)
        return IN_MEMORY / name, source
    return path, source


def _warn_cache_unusable(exc: OSError) -> None:
    where = os.environ.get(ENV_CACHE_DIR) or "the default kernel cache"
    with _lock:
        if where in _warned_dirs:
            return
        _warned_dirs.add(where)
    warnings.warn(f"liger-gen: cannot use {where} as the kernel cache ({type(exc).__name__}: {exc}); kernel modules "
                  f"are rendered in memory for this process. Set {ENV_CACHE_DIR} to a folder you own that others "
                  f"cannot write to use a cache.", KernelCacheWarning, stacklevel=3)


def _check_interpreter_set_at_import() -> None:
    """Raise RuntimeError when ``TRITON_INTERPRET=1`` was set after Triton was imported: Triton decides whether its
    own library functions (``tl.sum``, ``tl.max``, ...) are interpreted when it is imported, and a kernel defined
    later in the interpreter fails inside them with "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    import triton.language.standard as standard

    if type(getattr(standard, "sum", None)).__name__ == "JITFunction":
        raise RuntimeError(
            "liger_gen: TRITON_INTERPRET=1 was set after Triton was imported (`import liger_gen` imports it), and "
            "Triton reads it at import: set it in the environment before Python starts (`TRITON_INTERPRET=1 "
            "python train.py`), or leave it unset to run CPU tensors on the plain-PyTorch path.")


def load_variant(op: str, params: Mapping[str, Any]) -> ModuleType:
    """Render, cache and import one variant of ``op``; returns the module (kernels and launchers).

    The module is executed from the source text just rendered, compiled in memory: no bytecode cache is read
    or written, so nothing in the cache directory but the verified ``.py`` file (which Triton reads back for
    its source) takes part. Its ``<name>_kernel`` JIT functions are wrapped for lean CUDA launches
    (``liger_gen.codegen.launch``). Modules are memoised per process by content hash. Raises jinja2.UndefinedError
    for missing params and SyntaxError if the rendered text is broken; Triton compile errors surface at the
    first launch.
    """
    path, source = materialize(op, params)
    # triton.jit decides at decoration time whether a kernel is interpreted: one module per mode
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    name = f"liger_gen_kernels.{path.stem}" + ("_interpreted" if interpreted else "")
    with _lock:
        module = _modules.get(name)
        if module is not None:
            return module
        if interpreted:
            _check_interpreter_set_at_import()
        code = compile(source, str(path), "exec", dont_inherit=True)
        module = ModuleType(name)
        module.__file__ = str(path)
        # triton.jit reads the kernel source through inspect/linecache: serve it the verified text
        linecache.cache[str(path)] = (len(source), None, source.splitlines(keepends=True), str(path))
        sys.modules[name] = module
        try:
            exec(code, module.__dict__)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        wrap_module_kernels(module, path.stem)  # CUDA launches skip Triton's per-call argument processing
        _modules[name] = module
        return module
