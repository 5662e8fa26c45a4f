"""Lean kernel launches (``liger_gen.codegen.launch``) and the compiled kernel cache (``liger_gen.runtime.compiled``).

No GPU is needed: launches go through fake JIT functions and compiled kernels that record their calls, and the
stores are folders built by hand (or by ``write_store`` from fake compiled kernels) in temporary folders.
"""

import hashlib
import importlib.util
import inspect
import json
import os
import types
import warnings
from pathlib import Path

import pytest
import torch

from liger_gen.codegen import launch
from liger_gen.codegen.launch import LeanKernel, LeanLaunch, arg_key, key_text, wrap_module_kernels
from liger_gen.runtime import compiled
from liger_gen.runtime.compiled import CompiledKernelWarning, Store, base32_key

from conftest import seeded

# ------------------------------------------------------------------------------------------ arg_key, key_text


def _aligned(n, dtype=torch.float32):
    return torch.empty(n, dtype=dtype)


def _misaligned():
    t = torch.empty(17, dtype=torch.uint8)[1:]
    assert t.data_ptr() % 16 != 0
    return t


def test_arg_key_of_tensors_is_dtype_and_16_byte_alignment():
    a, b = _aligned(8), torch.randn(100, generator=seeded("arg_key"))
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    assert arg_key(a) == arg_key(b) == (torch.float32, True)
    assert arg_key(_aligned(8, torch.bfloat16)) == (torch.bfloat16, True)
    assert arg_key(_aligned(8, torch.bfloat16)) != arg_key(a)
    u8 = _aligned(32, torch.uint8)
    assert arg_key(u8) == (torch.uint8, True)
    assert arg_key(_misaligned()) == (torch.uint8, False)
    by8 = torch.empty(4, dtype=torch.float64)[1:]  # 8-byte aligned, not 16
    assert by8.data_ptr() % 16 == 8 and arg_key(by8) == (torch.float64, False)


def test_arg_key_of_ints_is_one_divisibility_and_width():
    keys = {v: arg_key(v) for v in (1, 16, 17, 32, 2 ** 31, 2 ** 31 - 1, -2 ** 31, 2 ** 63, 2 ** 63 - 1, 0)}
    assert keys[1] == ("i", True, False, 32)
    assert keys[16] == ("i", False, True, 32)
    assert keys[17] == ("i", False, False, 32)
    assert keys[32] == keys[16]  # Triton specializes 16 and 32 alike
    assert keys[0] == ("i", False, True, 32)
    assert keys[2 ** 31 - 1] == ("i", False, False, 32) and keys[-2 ** 31] == ("i", False, True, 32)
    assert keys[2 ** 31] == ("i", False, True, 64)
    assert keys[2 ** 63 - 1] == ("i", False, False, 64)
    assert keys[2 ** 63] == ("i", False, True, "u64")  # uint64
    assert len({keys[v] for v in (1, 16, 17, 2 ** 31, 2 ** 63)}) == 5


def test_arg_key_of_bools_floats_none_and_other_kinds():
    assert arg_key(True) == ("b", True) and arg_key(False) == ("b", False)
    assert arg_key(True) != arg_key(1) and arg_key(False) != arg_key(0)
    assert arg_key(0.5) == arg_key(3.0) == ("f",)
    assert arg_key(1.0) != arg_key(1)
    assert arg_key(None) == ("n",)
    for other in ("text", b"x", [1], (1,), torch.float32, 1 + 0j):
        with pytest.raises(TypeError, match="no launch key"):
            arg_key(other)


def test_key_text_is_stable_json_without_the_device():
    key = (0, (torch.float16, True), ("i", False, True, 32), ("f",), ("n",), ("BLOCK", 64), ("ACT", "gelu"))
    text = key_text(key)
    assert text == '[["float16",true],["i",false,true,32],["f"],["n"],["BLOCK",64],["ACT","gelu"]]'
    assert json.loads(text)[0] == ["float16", True]
    assert key_text((3, *key[1:])) == text  # the device is not part of it
    assert key_text((0, (torch.bfloat16, True), *key[2:])) != text
    assert key_text((0, ("DT", torch.float32))) == '[["DT","float32"]]'


# ------------------------------------------------------------------------------------------ LeanKernel


def _signature(X, Y, n, BLOCK: int = 64, ACT: str = "relu"):
    """adds"""


class FakeCompiled:
    """What LeanKernel uses of Triton's CompiledKernel: ``run`` (a property giving the launcher), ``function``,
    ``packed_metadata``, ``metadata_group``."""

    def __init__(self, tag, fail=False):
        self.tag = tag
        self.fail = fail
        self.calls = []
        self.run_accesses = 0
        self.function = f"function-{tag}"
        self.packed_metadata = f"packed-{tag}"
        self.metadata_group = {"k.json": "/nowhere/k.json"}

    @property
    def run(self):
        self.run_accesses += 1

        def launcher(*args):
            self.calls.append(args)
            if self.fail:
                raise RuntimeError("cannot launch this binary")

        return launcher


class FakeJIT:
    """A JITFunction-like object: ``run`` compiles (a new FakeCompiled) and launches (recorded)."""

    def __init__(self, make=FakeCompiled):
        self.__name__ = "add_kernel"
        self.__doc__ = "adds"
        self.arg_names = ["X", "Y", "n", "BLOCK", "ACT"]
        self.params = [types.SimpleNamespace(is_constexpr=name in ("BLOCK", "ACT")) for name in self.arg_names]
        self.signature = inspect.signature(_signature)
        self.runs = []
        self.made = []
        self.make = make

    def run(self, *args, grid, warmup, **kwargs):
        self.runs.append((args, grid, warmup, kwargs))
        c = self.make(len(self.runs))
        self.made.append(c)
        return c


STREAM = 0x5EED


def _hooks(**runtime):
    fields = {"debug": False, "launch_enter_hook": types.SimpleNamespace(calls=[]),
              "launch_exit_hook": types.SimpleNamespace(calls=[]), **runtime}
    return types.SimpleNamespace(runtime=types.SimpleNamespace(**fields))


@pytest.fixture
def hooks(monkeypatch):
    """Empty STORE / RECORDERS / STORE_FAILED lists (the real store lookup needs CUDA)."""
    h = types.SimpleNamespace(store=[], recorders=[], failed=[])
    monkeypatch.setattr(launch, "STORE", h.store)
    monkeypatch.setattr(launch, "RECORDERS", h.recorders)
    monkeypatch.setattr(launch, "STORE_FAILED", h.failed)
    return h


def _lean(fn=None, device=0):
    fn = fn or FakeJIT()
    lk = LeanKernel(fn, "add_0123abcd")
    lk._lean_device = lambda: device
    lk._lean_stream = lambda d: STREAM + d
    lk._lean_knobs = _hooks()
    return lk, fn


def _launch_args(c, grid, *args):
    return (*grid, STREAM, c.function, c.packed_metadata, None, None, None, *args)


def test_lean_kernel_keeps_the_name_doc_parameters_and_defaults(hooks):
    lk, fn = _lean()
    assert lk.__name__ == lk._lean_name == "add_kernel" and lk.__doc__ == "adds" and lk.fn is fn
    assert lk._lean_params == ("X", "Y", "n", "BLOCK", "ACT")
    assert lk._lean_defaults == {"BLOCK": 64, "ACT": "relu"}
    assert repr(lk) == "LeanKernel(add_0123abcd:add_kernel)"


def test_first_call_compiles_through_triton_later_calls_launch_the_compiled_kernel(hooks):
    lk, fn = _lean()
    x, y = _aligned(64), _aligned(64)
    out = lk[(4,)](x, y, 17, ACT="gelu")
    assert len(fn.runs) == 1
    assert fn.runs[0] == ((x, y, 17), (4,), False, {"ACT": "gelu"})
    c = fn.made[0]
    assert out is c and c.calls == []  # Triton launched it
    x2, y2 = _aligned(128), _aligned(128)
    assert lk[(4,)](x2, y2, 33, ACT="gelu") is None  # same key: 33 is like 17 (not 1, not %16, int32)
    assert len(fn.runs) == 1
    assert c.calls == [_launch_args(c, (4, 1, 1), x2, y2, 33, 64, "gelu")]
    lk[(4, 5)](x, y, 17, ACT="gelu")
    lk[(4, 5, 6)](x, y, 17, ACT="gelu")
    assert c.calls[1:] == [_launch_args(c, (4, 5, 1), x, y, 17, 64, "gelu"),
                           _launch_args(c, (4, 5, 6), x, y, 17, 64, "gelu")]
    assert len(fn.runs) == 1 and c.run_accesses == 1  # the launcher is taken once


def test_call_shapes_are_indexed_by_value_and_the_index_is_bounded(hooks, monkeypatch):
    """Each distinct int is its own entry of the per-shape index, all sharing the one compiled kernel of their
    Triton specialization; past MAX_ENTRIES the index starts over and later calls still launch directly."""
    from liger_gen.codegen import launch

    monkeypatch.setattr(launch, "MAX_ENTRIES", 2)
    lk, fn = _lean()
    x, y = _aligned(64), _aligned(64)
    for n in (17, 33, 49, 17, 65):  # one specialization: not 1, not a multiple of 16, int32
        lk[(4,)](x, y, n, ACT="gelu")
    c = fn.made[0]
    assert len(fn.runs) == 1 and len(lk._lean_entries) == 1 and len(lk._lean_fast) <= 2
    assert [call[-3] for call in c.calls] == [33, 49, 17, 65]  # every later call launched the compiled kernel
    lk[(4,)](x, y, 16, ACT="gelu")  # another specialization (16 divides it): Triton's own path compiles it
    assert len(fn.runs) == 2 and len(lk._lean_entries) == 2


def test_keyword_values_that_compare_equal_but_differ_in_type_are_other_kernels(hooks):
    """BLOCK=64, 64.0 and (for 1) True hash and compare equal, but Triton compiles each (its key is the value's
    text): each gets its own entry; a value that never equals itself (NaN) does not grow the indexes unboundedly."""
    from liger_gen.codegen import launch

    lk, fn = _lean()
    x, y = _aligned(64), _aligned(64)
    for block in (1, True, 1.0, 1):
        lk[(4,)](x, y, 17, ACT="gelu", BLOCK=block)
    assert len(fn.runs) == 3 and len(lk._lean_entries) == 3
    for _ in range(launch.MAX_ENTRIES + 3):
        lk[(4,)](x, y, 17, ACT="gelu", BLOCK=float("nan"))
    assert len(lk._lean_entries) <= launch.MAX_ENTRIES and len(lk._lean_fast) <= launch.MAX_ENTRIES


def test_the_constexpr_tail_comes_from_kwargs_or_defaults_in_parameter_order_without_launch_options(hooks):
    lk, fn = _lean()
    x, y = _aligned(8), _aligned(8)
    lk[(2,)](x, y, 5, ACT="silu", num_warps=8, BLOCK=128)
    lk[(2,)](x, y, 5, ACT="silu", num_warps=8, BLOCK=128)
    c = fn.made[0]
    assert c.calls == [_launch_args(c, (2, 1, 1), x, y, 5, 128, "silu")]
    lk[(2,)](x, y, 5, num_stages=3)
    lk[(2,)](x, y, 5, num_stages=3)
    c2 = fn.made[1]
    assert c2.calls == [_launch_args(c2, (2, 1, 1), x, y, 5, 64, "relu")]
    # a constexpr passed positionally cannot be keyed by its kind: Triton's own path, every call
    lk[(2,)](x, y, 5, 32)
    lk[(2,)](x, y, 5, 32)
    assert len(fn.runs) == 4 and all(c3.calls == [] for c3 in fn.made[2:])


def test_a_constexpr_passed_positionally_is_keyed_by_its_value(hooks):
    lk, fn = _lean()
    x, y = _aligned(8), _aligned(8)
    lk[(2,)](x, y, 5, 32)
    lk[(2,)](x, y, 5, 64)
    assert len(fn.runs) == 2 and fn.made[0].calls == []


@pytest.mark.parametrize("change", ["dtype", "misaligned", "int_one", "int_16", "int64", "float_for_int",
                                    "kwarg_value", "launch_option", "default_made_explicit", "device"])
def test_a_different_key_goes_through_triton_again(hooks, change):
    lk, fn = _lean()
    x, y = _aligned(32, torch.uint8), _aligned(32, torch.uint8)
    args, kwargs = [x, y, 17], {"ACT": "gelu"}
    lk[(3,)](*args, **kwargs)
    lk[(3,)](*args, **kwargs)
    assert len(fn.runs) == 1 and len(fn.made[0].calls) == 1
    args2, kwargs2 = list(args), dict(kwargs)
    if change == "dtype":
        args2[0] = _aligned(32, torch.int8)
    elif change == "misaligned":
        args2[0] = _misaligned()
    elif change == "int_one":
        args2[2] = 1
    elif change == "int_16":
        args2[2] = 48
    elif change == "int64":
        args2[2] = 2 ** 40 + 1
    elif change == "float_for_int":
        args2[2] = 17.0
    elif change == "kwarg_value":
        kwargs2["ACT"] = "silu"
    elif change == "launch_option":
        kwargs2["num_warps"] = 8
    elif change == "default_made_explicit":
        kwargs2["BLOCK"] = 64
    elif change == "device":
        lk._lean_device = lambda: 1
    lk[(3,)](*args2, **kwargs2)
    assert len(fn.runs) == 2
    assert fn.runs[1][0] == tuple(args2) and fn.runs[1][3] == kwargs2
    # both keys are memoised now, each with its own compiled kernel
    lk[(3,)](*args2, **kwargs2)
    assert len(fn.runs) == 2 and len(fn.made[1].calls) == 1
    assert fn.made[1].calls[0][3] == STREAM + (1 if change == "device" else 0)
    lk._lean_device = lambda: 0
    lk[(3,)](*args, **kwargs)
    assert len(fn.runs) == 2 and len(fn.made[0].calls) == 2


@pytest.mark.parametrize("case", ["callable_grid", "list_grid", "enter_hook", "exit_hook", "hook_without_calls",
                                  "debug", "no_knobs"])
def test_triton_own_path_when_the_lean_one_does_not_apply(hooks, case):
    lk, fn = _lean()
    grid = (2,)
    if case == "callable_grid":
        grid = lambda meta: (2,)  # noqa: E731
    elif case == "list_grid":
        grid = [2]
    elif case == "enter_hook":
        lk._lean_knobs.runtime.launch_enter_hook.calls.append(lambda *a: None)
    elif case == "exit_hook":
        lk._lean_knobs.runtime.launch_exit_hook.calls.append(lambda *a: None)
    elif case == "hook_without_calls":
        lk._lean_knobs.runtime.launch_enter_hook = lambda *a: None
    elif case == "debug":
        lk._lean_knobs.runtime.debug = True
    elif case == "no_knobs":
        lk._lean_knobs = None
    x, y = _aligned(8), _aligned(8)
    for _ in range(3):
        lk[grid](x, y, 17)
    assert len(fn.runs) == 3 and all(r[1] is grid for r in fn.runs)
    assert all(c.calls == [] for c in fn.made) and lk._lean_entries == {}


def test_hooks_set_to_none_count_as_idle(hooks):
    lk, fn = _lean()
    lk._lean_knobs = _hooks(launch_enter_hook=None, launch_exit_hook=None)
    x, y = _aligned(8), _aligned(8)
    lk[(2,)](x, y, 17)
    lk[(2,)](x, y, 17)
    assert len(fn.runs) == 1 and len(fn.made[0].calls) == 1


@pytest.mark.parametrize("case", ["str_arg", "unhashable_kwarg", "missing_parameter", "no_packed_metadata"])
def test_arguments_without_a_lean_launch_always_go_through_triton(hooks, case):
    class Bare(FakeCompiled):  # a compiled object without packed_metadata (another Triton)
        def __init__(self, tag):
            super().__init__(tag)
            del self.packed_metadata

    lk, fn = _lean(FakeJIT(make=Bare) if case == "no_packed_metadata" else None)
    x, y = _aligned(8), _aligned(8)
    args, kwargs = (x, y, 17), {}
    if case == "str_arg":
        args = (x, y, "seventeen")
    elif case == "unhashable_kwarg":
        kwargs = {"ACT": ["gelu"]}
    elif case == "missing_parameter":
        args = (x, y)
    for _ in range(3):
        assert lk[(2,)](*args, **kwargs) is fn.made[-1]
    assert len(fn.runs) == 3 and lk._lean_entries == {}
    assert all(c.calls == [] for c in fn.made)


def test_a_tensor_passed_by_keyword_goes_through_triton(hooks):
    lk, fn = _lean()
    x, y = _aligned(8), _aligned(8)
    lk[(2,)](x, n=17, Y=y)
    assert len(fn.runs) == 1 and fn.runs[0][3] == {"n": 17, "Y": y}


def test_a_store_hit_is_launched_without_triton_and_memoised(hooks):
    lk, fn = _lean()
    stored = FakeCompiled("store")
    asked = []

    def miss(*a):
        asked.append(("miss", a))
        return None

    def hit(*a):
        asked.append(("hit", a))
        return stored

    hooks.store[:] = [miss, hit]
    recorded = []
    hooks.recorders.append(lambda *a: recorded.append(a))
    x, y = _aligned(16, torch.float16), _aligned(16, torch.float16)
    assert lk[(7, 2)](x, y, 16, BLOCK=256) is stored
    text = key_text((0, arg_key(x), arg_key(y), arg_key(16), ("BLOCK", 256)))
    assert text == '[["float16",true],["float16",true],["i",false,true,32],["BLOCK",256]]'
    assert [kind for kind, _ in asked] == ["miss", "hit"]
    assert asked[1][1] == ("add_0123abcd", "add_kernel", text, fn, 0)
    assert fn.runs == [] and recorded == []
    assert stored.calls == [_launch_args(stored, (7, 2, 1), x, y, 16, 256, "relu")]
    lk[(7, 2)](x, y, 16, BLOCK=256)
    assert len(asked) == 2 and fn.runs == [] and len(stored.calls) == 2


def test_a_store_kernel_that_fails_to_launch_falls_back_to_triton(hooks):
    lk, fn = _lean()
    broken = FakeCompiled("store", fail=True)
    hooks.store.append(lambda *a: broken)
    failed = []
    hooks.failed.append(lambda *a: failed.append(a))
    x, y = _aligned(8), _aligned(8)
    out = lk[(2,)](x, y, 17)
    assert len(broken.calls) == 1  # it was tried
    assert len(fn.runs) == 1 and out is fn.made[0]
    text = key_text((0, arg_key(x), arg_key(y), arg_key(17)))
    assert failed == [("add_0123abcd", "add_kernel", text)]
    assert lk._lean_entries == {}  # the broken kernel is not memoised


def test_recorders_get_every_kernel_triton_compiled(hooks):
    lk, fn = _lean()
    recorded = []
    hooks.recorders.append(lambda *a: recorded.append(a))
    x, y = _aligned(8), _aligned(8)
    lk[(2,)](x, y, 17)
    lk[(2,)](x, y, 17)
    lk[(2,)](x, y, 1)
    text17 = key_text((0, arg_key(x), arg_key(y), arg_key(17)))
    text1 = key_text((0, arg_key(x), arg_key(y), arg_key(1)))
    assert recorded == [("add_0123abcd", "add_kernel", text17, fn.made[0]),
                        ("add_0123abcd", "add_kernel", text1, fn.made[1])]


# ------------------------------------------------------------------------------------------ record and replay


def _two_launches(lk, x, y, out, n):
    """A launch function as the templates write them: views of the tensors, two launches, scalars."""
    lk[(n // 4,)](x.view(-1), out, n, BLOCK=16)
    lk[(2, 3)](out, y, n + 1)


def _warm(lk, *args):
    _two_launches(lk, *args)  # first calls compile through (fake) Triton
    return lk._lean_fast and lk.fn.made[-1]


def test_a_replay_makes_the_recorded_launches_with_the_new_tensors(hooks):
    lk, fn = _lean()
    n = 64
    x, y, out = _aligned(n), _aligned(n), _aligned(n)
    _warm(lk, x, y, out, n)
    with launch.record() as rec:
        _two_launches(lk, x, y, out, n)
    assert [r[0] for r in rec.launches] == [lk, lk] and rec.other_work is None
    replay = launch.compile_replay(rec, (x, y, out))
    assert replay is not None
    x2, y2, out2 = _aligned(n), _aligned(n), _aligned(n)
    calls = {c.tag: len(c.calls) for c in fn.made}
    assert replay(x2, y2, out2) is True
    ptrs = lambda call: tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in call)  # noqa: E731
    got = [ptrs(a) for c in fn.made for a in c.calls[calls[c.tag]:]]
    # the lean path itself, given the same new tensors, launches exactly this
    before = {c.tag: len(c.calls) for c in fn.made}
    _two_launches(lk, x2, y2, out2, n)
    want = [ptrs(a) for c in fn.made for a in c.calls[before[c.tag]:]]
    assert got == want and len(got) == 2
    assert x2.data_ptr() in got[0] and y2.data_ptr() in got[1] and x.data_ptr() not in got[0]
    assert len(fn.runs) == 2  # nothing was compiled again


def test_a_replay_declines_when_the_recorded_kernels_would_not_be_tritons_choice(hooks):
    lk, fn = _lean()
    current = [0]
    lk._lean_device = lambda: current[0]
    n = 64
    x, y, out = _aligned(n), _aligned(n), _aligned(n)
    _warm(lk, x, y, out, n)
    with launch.record() as rec:
        _two_launches(lk, x, y, out, n)
    replay = launch.compile_replay(rec, (x, y, out))
    count = lambda: sum(len(c.calls) for c in fn.made)  # noqa: E731
    start = count()
    assert replay(_misaligned(), y, out) is False  # another alignment: another specialization
    current[0] = 1
    assert replay(x, y, out) is False  # another current device
    current[0] = 0
    lk._lean_knobs = _hooks(launch_enter_hook=types.SimpleNamespace(calls=[print]))
    assert replay(x, y, out) is False  # a launch hook (a profiler) must see Triton's own launches
    lk._lean_knobs = _hooks(debug=True)
    assert replay(x, y, out) is False
    assert count() == start
    lk._lean_knobs = _hooks()
    assert replay(x, y, out) is True and count() == start + 2


def test_an_unaligned_slot_replays_only_with_unaligned_tensors(hooks):
    lk, fn = _lean()
    x = _misaligned()
    y, out = _aligned(16), _aligned(16)
    def launch_fn(x, y, out):
        lk[(1,)](x, out, 16)
    launch_fn(x, y, out)
    with launch.record() as rec:
        launch_fn(x, y, out)
    replay = launch.compile_replay(rec, (x, y, out))
    assert replay(_aligned(16, torch.uint8), y, out) is False
    assert replay(_misaligned(), y, out) is True


@pytest.mark.parametrize("case", ["nothing", "triton_path", "torch_work", "temporary", "shared_address",
                                  "two_devices"])
def test_recordings_that_cannot_be_replayed(hooks, case):
    lk, fn = _lean()
    x, y, out = _aligned(64), _aligned(64), _aligned(64)
    slots = (x, y, out)

    def launch_fn():
        if case == "nothing":
            return
        if case == "triton_path":
            lk[lambda meta: (4,)](x, out, 64)  # a callable grid: Triton's own path
        elif case == "torch_work":
            lk[(4,)](x, out, 64)
            out.zero_()  # work a replay of the launches would leave out
        elif case == "temporary":
            lk[(4,)](x, torch.empty(64), 64)
        elif case == "shared_address":
            lk[(4,)](x, out, 64)
        elif case == "two_devices":
            lk[(4,)](x, out, 64)
            lk._lean_device = lambda: 1
            lk[(4,)](x, out, 64)
            lk._lean_device = lambda: 0

    launch_fn()
    with launch.record() as rec:
        launch_fn()
    if case == "shared_address":
        slots = (x, out, out)
    if case == "torch_work":
        assert rec.other_work is not None and "zero" in rec.other_work
    assert launch.compile_replay(rec, slots) is None


def test_views_are_not_other_work_and_recording_ends_with_the_block(hooks):
    lk, fn = _lean()
    x = _aligned(64)
    with launch.record() as rec:
        x.view(8, 8).transpose(0, 1)[:4].unsqueeze(0).detach()
        x.reshape(2, 32).t()
    assert rec.other_work is None and rec.launches == []
    assert launch._recordings == 0 and getattr(launch._tls, "recording", None) is None
    lk[(1,)](x, x, 1)
    assert rec.launches == []  # after the block nothing is recorded


def test_launches_record_once_replay_after_and_fall_back_when_declined(hooks, monkeypatch):
    from liger_gen.runtime import plans

    lk, fn = _lean()
    n = 64
    x, y, out = _aligned(n), _aligned(n), _aligned(n)
    seen = []

    def launch_fn(x, y, out):
        seen.append(1)
        _two_launches(lk, x, y, out, n)

    launches = plans.Launches()
    launches((x, y, out), launch_fn, x, y, out)  # compiles and records
    assert launches.replay is not None and len(seen) == 1
    launches((x, y, out), launch_fn, x, y, out)
    assert len(seen) == 1  # replayed: the launch function did not run
    m = _misaligned()
    launches((m, y, out), launch_fn, m, y, out)
    assert len(seen) == 2  # declined: the launch function ran


def test_launches_give_up_recording_after_a_few_tries_and_may_never_record(hooks):
    from liger_gen.runtime import plans

    seen = []
    launches = plans.Launches()
    for _ in range(plans.RECORD_TRIES + 3):
        launches((), lambda: seen.append(launch._recordings))
    assert launches.replay is None and launches.tries_left == 0
    assert seen == [1] * plans.RECORD_TRIES + [0] * 3  # recorded only while tries were left
    seen.clear()
    never = plans.Launches(record=False)
    for _ in range(2):
        never((), lambda: seen.append(launch._recordings))
    assert seen == [0, 0] and never.replay is None


def test_every_launch_in_a_template_is_of_a_lean_kernel():
    """Replays repeat only lean launches: a template must launch nothing else from Python."""
    import re

    import liger_gen

    found = 0
    for path in sorted((Path(liger_gen.__file__).parent / "templates").glob("*.jinja")):
        text = path.read_text()
        launched = set(re.findall(r"^\s+(\w+)\[[^\]\n]*\]\(", text, flags=re.M))
        found += len(launched)
        for name in launched:
            assert name.endswith("_kernel"), (path.name, name)
            assert not re.search(rf"(?<!def )(?<![\w.]){name}\(", text), (path.name, name)  # called by no kernel
    assert found >= 25  # the pattern finds the launches


# ------------------------------------------------------------------------------------------ wrap_module_kernels


MODULE_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def helper(x):
    return x + 1


@triton.jit
def called_kernel(X, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def via_helper_kernel(X, n):
    pass


@triton.jit
def uses_helper(X, n):
    via_helper_kernel(X, n)


@triton.jit
def outer_kernel(X, n, BLOCK: tl.constexpr = 16):
    called_kernel(X, n, BLOCK)
    helper(n)


@triton.jit
def add_kernel(X, Y, n, BLOCK: tl.constexpr = 32):
    """adds"""
    pass


def add(x, y):
    return x + y
'''


def _load_module(tmp_path, name):
    """A module of ``@triton.jit`` functions, loaded from a file (Triton reads the functions' source back)."""
    path = tmp_path / f"{name}.py"
    path.write_text(MODULE_SOURCE)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wrap_module_kernels_wraps_only_kernels_no_other_jit_function_calls(tmp_path, monkeypatch):
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read when @triton.jit decorates
    module = _load_module(tmp_path, "lean_wrap_compiled")
    before = dict(vars(module))
    assert all(isinstance(before[n], JITFunction) for n in ("helper", "called_kernel", "outer_kernel", "add_kernel",
                                                            "via_helper_kernel", "uses_helper"))
    wrap_module_kernels(module, "stem_0123")
    for name in ("add_kernel", "outer_kernel"):
        wrapped = getattr(module, name)
        # the same object, still a JITFunction, with the lean launch path mixed in
        assert wrapped is before[name] and isinstance(wrapped, LeanLaunch) and isinstance(wrapped, JITFunction)
        assert wrapped._lean_stem == "stem_0123" and wrapped.__name__ == name and wrapped._lean_fn is wrapped
    assert module.add_kernel.__doc__ == "adds"
    assert module.add_kernel._lean_params == ("X", "Y", "n", "BLOCK")
    assert module.add_kernel._lean_defaults == {"BLOCK": 32}
    for name in ("helper", "called_kernel", "via_helper_kernel", "uses_helper", "add"):
        assert getattr(module, name) is before[name] and not isinstance(getattr(module, name), LeanLaunch)


def test_a_wrapped_kernel_still_answers_for_its_jit_function(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    module = _load_module(tmp_path, "lean_wrap_attributes")
    from triton.compiler import ASTSource

    fn = module.add_kernel
    src, debug = fn.src, fn.debug
    wrap_module_kernels(module, "stem_0123")
    assert module.add_kernel is fn and isinstance(fn, LeanLaunch)
    assert fn.debug == debug and fn.src == src and callable(fn.fn)
    ASTSource(fn, {"X": "*fp32", "Y": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 32}).hash()


def test_wrap_module_kernels_leaves_interpreted_kernels_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = _load_module(tmp_path, "lean_wrap_interpreted")
    before = dict(vars(module))
    wrap_module_kernels(module, "stem_0123")
    assert vars(module) == before
    assert not any(isinstance(v, LeanLaunch) for v in vars(module).values())


# ------------------------------------------------------------------------------------------ stores on disk


GPU = "h200"
TRITON = "3.9.0"
TARGET = {"backend": "cuda", "arch": 90, "warp_size": 32}
HASH = "ab" * 32
DIR = base32_key(HASH)
SO_DIR = base32_key("cd" * 32)
KEY = f"add_0123:add_kernel:{key_text((0, (torch.float32, True), ('i', False, False, 32)))}"


def _files():
    return {f"{DIR}/add_kernel.json": json.dumps({"name": "add_kernel", "hash": HASH}).encode(),
            f"{DIR}/add_kernel.cubin": bytes(range(256)) * 3,
            f"{SO_DIR}/cuda_utils.cpython-311-x86_64-linux-gnu.so": b"\x7fELF" + bytes(500)}


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def _make_store(root, *, triton=TRITON, target=TARGET, env=None, files=None, listed=None, name=None):
    """``<root>/h200/compiled/<name>/`` with its files and manifest (folders 0755, files 0644)."""
    files = _files() if files is None else files
    folder = Path(root) / GPU / "compiled" / (name or compiled.store_name(triton, target["backend"], target["arch"]))
    folder.mkdir(parents=True)
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    manifest = {
        "schema": compiled.SCHEMA, "triton": triton, "target": dict(target), "env": env or {},
        "kernels": {KEY: {"hash": HASH, "dir": DIR, "files": ["add_kernel.cubin", "add_kernel.json"],
                          "signature": [["X", "*fp32"], ["n", "i32"]], "constants": [], "attrs": []}},
        "files": listed if listed is not None else {rel: {"sha256": _sha(d), "size": len(d)}
                                                     for rel, d in files.items()},
    }
    (folder / compiled.MANIFEST).write_text(json.dumps(manifest))
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return folder


def _store(folder, label="user"):
    return Store(folder, label, compiled.read_manifest(folder / compiled.MANIFEST))


class _Warnings:
    def __enter__(self):
        self._ctx = warnings.catch_warnings(record=True)
        self.caught = self._ctx.__enter__()
        warnings.simplefilter("always")  # a repeated warning is counted, not swallowed by the registry
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    @property
    def ours(self):
        return [w for w in self.caught if issubclass(w.category, CompiledKernelWarning)]


def test_a_good_file_verifies_without_a_warning(tmp_path):
    folder = _make_store(tmp_path)
    store = _store(folder)
    with _Warnings() as w:
        for rel in _files():
            assert store.check_file(rel) == folder / rel
        assert store.check_file(f"{DIR}/add_kernel.cubin") == folder / DIR / "add_kernel.cubin"
    assert w.caught == [] and not store.warned
    assert store.verified == {rel: True for rel in _files()}


def _damage(folder, how):
    cubin = folder / DIR / "add_kernel.cubin"
    data = cubin.read_bytes()
    if how == "corrupt":
        cubin.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif how == "truncated":
        cubin.write_bytes(data[:-1])
    elif how == "grown":
        cubin.write_bytes(data + b"\0")
    elif how == "missing":
        cubin.unlink()
    return f"{DIR}/add_kernel.cubin"


@pytest.mark.parametrize("how", ["corrupt", "truncated", "grown", "missing"])
def test_a_damaged_file_is_refused_with_one_warning_per_store(tmp_path, how):
    folder_a = _make_store(tmp_path / "a")
    folder_b = _make_store(tmp_path / "b")
    rel = _damage(folder_a, how)
    _damage(folder_b, how)
    a, b = _store(folder_a), _store(folder_b)
    with _Warnings() as w:
        assert a.check_file(rel) is None
        assert a.check_file(rel) is None
        assert a.group(DIR, ["add_kernel.json", "add_kernel.cubin"]) is None
        assert a.check_file(f"{DIR}/add_kernel.json") == folder_a / DIR / "add_kernel.json"  # the rest is fine
    assert len(w.ours) == 1 and str(folder_a) in str(w.ours[0].message) and rel in str(w.ours[0].message)
    with _Warnings() as w:
        assert b.check_file(rel) is None
        assert a.check_file(f"{SO_DIR}/missing.so") is None  # store a has warned already
    assert len(w.ours) == 1 and str(folder_b) in str(w.ours[0].message)


def test_paths_outside_the_store_or_not_listed_are_refused(tmp_path):
    files = _files()
    folder = _make_store(tmp_path / "s", files=files)
    outside = folder.parent / "outside.bin"  # what <DIR>/../../outside.bin names
    outside.write_bytes(b"payload")
    (folder / "loose.bin").write_bytes(b"payload")
    (folder / DIR / "unlisted.bin").write_bytes(b"payload")
    entry = {"sha256": _sha(b"payload"), "size": 7}
    manifest = json.loads((folder / compiled.MANIFEST).read_text())
    # listed with the right hash, so only the path rules can refuse them
    manifest["files"].update({f"{DIR}/../../outside.bin": entry, str(outside): entry, "loose.bin": entry})
    store = Store(folder, "user", manifest)
    assert (folder / DIR / "../../outside.bin").read_bytes() == b"payload"
    for rel in (f"{DIR}/../../outside.bin", str(outside), "loose.bin"):  # listed, so their refusal warns
        fresh = Store(folder, "user", manifest)
        with _Warnings() as w:
            assert fresh.check_file(rel) is None, rel
        assert len(w.ours) == 1
    with _Warnings() as w:  # not listed: not an entry of this store (a host module for another Python, say)
        assert Store(folder, "user", manifest).check_file(f"{DIR}/unlisted.bin") is None
    assert w.ours == []
    with _Warnings():
        assert store.check_file(f"{DIR}/add_kernel.json") == folder / DIR / "add_kernel.json"


def test_a_file_whose_listed_size_is_wrong_is_refused(tmp_path):
    folder = _make_store(tmp_path)
    manifest = compiled.read_manifest(folder / compiled.MANIFEST)
    manifest["files"][f"{DIR}/add_kernel.cubin"]["size"] += 1  # the SHA-256 still matches
    store = Store(folder, "user", manifest)
    with _Warnings() as w:
        assert store.check_file(f"{DIR}/add_kernel.cubin") is None
    assert len(w.ours) == 1


def test_group_gives_every_member_verified_or_none(tmp_path):
    folder = _make_store(tmp_path)
    store = _store(folder)
    with _Warnings() as w:
        assert store.group(DIR, ["add_kernel.json", "add_kernel.cubin"]) == {
            "add_kernel.json": str(folder / DIR / "add_kernel.json"),
            "add_kernel.cubin": str(folder / DIR / "add_kernel.cubin")}
    assert w.ours == []
    with _Warnings() as w:  # a member the store does not list: no group, and nothing is wrong with the store
        assert store.group(DIR, ["add_kernel.json", "add_kernel.ptx"]) is None
    assert w.ours == []
    (folder / DIR / "add_kernel.cubin").write_bytes(b"altered")
    with _Warnings() as w:  # a listed member that does not match: no group, one warning
        assert _store(folder).group(DIR, ["add_kernel.json", "add_kernel.cubin"]) is None
    assert len(w.ours) == 1


def test_read_manifest_refuses_what_is_not_a_manifest(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    with pytest.raises(ValueError, match="cannot read"):
        compiled.read_manifest(path)
    path.write_bytes(b"\xff\xfe not json")
    with pytest.raises(ValueError, match="cannot read"):
        compiled.read_manifest(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        compiled.read_manifest(path)
    good = {"schema": compiled.SCHEMA, "triton": TRITON, "kernels": {}, "files": {}, "target": TARGET}
    for bad, match in ([[1, 2], "not a compiled kernel manifest"], [{**good, "schema": "other/1"}, "schema"],
                       [{**good, "kernels": []}, "'kernels' must be an object"],
                       [{**good, "files": None}, "'files' must be an object"],
                       [{k: v for k, v in good.items() if k != "target"}, "'target' must be an object"]):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            compiled.read_manifest(path)
    path.write_text(json.dumps(good))
    assert compiled.read_manifest(path) == good
    monkeypatch.setattr(compiled, "MAX_MANIFEST_BYTES", 10)
    with pytest.raises(ValueError, match="more than a manifest may have"):
        compiled.read_manifest(path)


def test_mismatch_names_what_differs():
    manifest = {"triton": TRITON, "target": TARGET, "env": {"TRITON_X": "1"}}
    assert compiled.mismatch(manifest, TRITON, TARGET, {"TRITON_X": "1"}) is None
    assert compiled.mismatch(manifest, TRITON, {**TARGET, "warp_size": 64}, {"TRITON_X": "1"}) is None
    assert "Triton 3.8.1" in compiled.mismatch({**manifest, "triton": "3.8.1"}, TRITON, TARGET, {"TRITON_X": "1"})
    why = compiled.mismatch(manifest, TRITON, {**TARGET, "arch": 80}, {"TRITON_X": "1"})
    assert "architecture 90" in why and "cuda 80" in why
    assert "hip 90" in compiled.mismatch(manifest, TRITON, {**TARGET, "backend": "hip"}, {"TRITON_X": "1"})
    assert "environment" in compiled.mismatch(manifest, TRITON, TARGET, {})


def test_find_stores_uses_a_matching_store_and_ignores_folders_without_a_manifest(tmp_path):
    folder = _make_store(tmp_path / "user")
    (folder.parent / "not-a-store").mkdir()
    packaged = _make_store(tmp_path / "pkg")
    roots = [("user", tmp_path / "user"), ("user", tmp_path / "nowhere"), ("packaged", tmp_path / "pkg")]
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=roots)
    assert refused == []
    assert [(s.path, s.label) for s in usable] == [(folder, "user"), (packaged, "packaged")]
    assert usable[0].kernels[KEY]["dir"] == DIR and set(usable[0].files) == set(_files())
    assert compiled.find_stores("a100", TRITON, TARGET, {}, roots=roots) == ([], [])


@pytest.mark.parametrize("other", ["triton", "arch", "env"])
def test_find_stores_refuses_a_store_for_another_triton_gpu_or_environment(tmp_path, other):
    folder = _make_store(tmp_path, triton="3.8.0" if other == "triton" else TRITON,
                         target={**TARGET, "arch": 100} if other == "arch" else TARGET,
                         env={"TRITON_F32_DEFAULT": "ieee"} if other == "env" else {})
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", tmp_path)])
    assert usable == [] and len(refused) == 1
    assert refused[0].startswith(f"{folder}: ")
    assert {"triton": "Triton 3.8.0", "arch": "architecture 100", "env": "TRITON_F32_DEFAULT"}[other] in refused[0]


@pytest.mark.parametrize("how", ["group_writable_folder", "other_writable_file", "writable_subfolder",
                                 "symlink_file", "symlinked_store"])
def test_a_user_store_that_is_not_private_is_refused_but_a_packaged_one_is_not_checked(tmp_path, how):
    real = _make_store(tmp_path / "real")
    folder = real
    if how == "group_writable_folder":
        os.chmod(folder, 0o775)
    elif how == "other_writable_file":
        os.chmod(folder / DIR / "add_kernel.cubin", 0o666)
    elif how == "writable_subfolder":
        os.chmod(folder / SO_DIR, 0o777)
    elif how == "symlink_file":
        (folder / DIR / "extra.cubin").symlink_to(folder / DIR / "add_kernel.cubin")
    elif how == "symlinked_store":
        parent = tmp_path / "linked" / GPU / "compiled"
        parent.mkdir(parents=True)
        folder = parent / real.name
        folder.symlink_to(real)
    root = folder.parent.parent.parent
    assert compiled.untrusted_reason(folder) is not None
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", root)])
    assert usable == [] and len(refused) == 1
    want = "symbolic link" if how.startswith("symlink") else "writable by group or others"
    assert want in refused[0] and "must belong to you" in refused[0]
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("packaged", root)])
    assert refused == [] and [s.path for s in usable] == [folder]


def test_a_private_store_is_trusted(tmp_path):
    folder = _make_store(tmp_path)
    assert compiled.untrusted_reason(folder) is None


@pytest.mark.parametrize("label", ["user", "packaged"])
def test_find_stores_refuses_an_unreadable_manifest(tmp_path, label):
    folder = _make_store(tmp_path)
    (folder / compiled.MANIFEST).write_text('{"schema": "liger-gen/compiled-kernels/1", "kernels": ')
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[(label, tmp_path)])
    assert usable == [] and len(refused) == 1 and "cannot read" in refused[0] and str(folder) in refused[0]


# ------------------------------------------------------------------------------------------ Triton's cache hook


@pytest.fixture
def fallback(monkeypatch):
    """A fresh fallback cache manager class that records its instances and calls, configured as the previous one."""

    class Fallback:
        instances = []

        def __init__(self, key, override=False, dump=False):
            self.args = (key, override, dump)
            self.calls = []
            self.cache_dir = f"/fallback/{key}"
            Fallback.instances.append(self)

        def get_file(self, filename):
            self.calls.append(("get_file", filename))
            return f"/fallback/{self.args[0]}/{filename}"

        def get_group(self, filename):
            self.calls.append(("get_group", filename))
            return {"fallback": filename}

        def put(self, data, filename, binary=True):
            self.calls.append(("put", data, filename, binary))
            return f"/fallback/{self.args[0]}/{filename}"

        def put_group(self, filename, group):
            self.calls.append(("put_group", filename, group))
            return f"/fallback/{self.args[0]}/__grp__{filename}"

    monkeypatch.setattr(compiled, "_previous_manager", [Fallback])
    monkeypatch.setattr(compiled, "_states", {})
    return Fallback


def _register(monkeypatch, store, device=99):
    st = compiled._State(stores=[store], kernels={}, dirs={DIR: store, SO_DIR: store})
    monkeypatch.setitem(compiled._states, device, st)
    return st


def test_the_cache_manager_serves_verified_files_of_a_store(tmp_path, monkeypatch, fallback):
    from triton.runtime.cache import CacheManager

    folder = _make_store(tmp_path)
    _register(monkeypatch, _store(folder))
    monkeypatch.setitem(compiled._states, 98, None)  # a device without stores
    cls = compiled._make_manager_class()
    assert issubclass(cls, CacheManager)
    m = cls(DIR)
    with _Warnings() as w:
        assert m.get_file("add_kernel.cubin") == str(folder / DIR / "add_kernel.cubin")
        assert m.get_group("add_kernel.json") == {"add_kernel.json": str(folder / DIR / "add_kernel.json"),
                                                  "add_kernel.cubin": str(folder / DIR / "add_kernel.cubin")}
        so = cls(SO_DIR)
        assert so.get_file("cuda_utils.cpython-311-x86_64-linux-gnu.so") == str(
            folder / SO_DIR / "cuda_utils.cpython-311-x86_64-linux-gnu.so")
    assert w.caught == []
    assert fallback.instances == []  # served without touching the previous manager
    # a group the store does not hold, every write and other attributes go to the previous manager
    assert m.get_group("other.json") == {"fallback": "other.json"}
    assert m.put(b"ir", "add_kernel.ttir", binary=False) == f"/fallback/{DIR}/add_kernel.ttir"
    assert m.put_group("add_kernel.json", {"a": "b"}) == f"/fallback/{DIR}/__grp__add_kernel.json"
    assert m.cache_dir == f"/fallback/{DIR}"
    assert len(fallback.instances) == 1 and fallback.instances[0].args == (DIR, False, False)
    assert fallback.instances[0].calls == [("get_group", "other.json"), ("put", b"ir", "add_kernel.ttir", False),
                                           ("put_group", "add_kernel.json", {"a": "b"})]
    with pytest.raises(AttributeError):
        m._no_such_private_thing  # noqa: B018


def test_the_cache_manager_falls_back_for_damaged_files(tmp_path, monkeypatch, fallback):
    folder = _make_store(tmp_path)
    _damage(folder, "corrupt")
    _register(monkeypatch, _store(folder))
    m = compiled._make_manager_class()(DIR)
    with _Warnings() as w:
        assert m.get_file("add_kernel.cubin") == f"/fallback/{DIR}/add_kernel.cubin"
        assert m.get_group("add_kernel.json") == {"fallback": "add_kernel.json"}
        assert m.get_file("add_kernel.json") == str(folder / DIR / "add_kernel.json")
    assert len(w.ours) == 1
    assert fallback.instances[0].calls == [("get_file", "add_kernel.cubin"), ("get_group", "add_kernel.json")]


def test_the_cache_manager_hands_unknown_keys_and_override_or_dump_managers_to_the_previous_one(
        tmp_path, monkeypatch, fallback):
    folder = _make_store(tmp_path)
    _register(monkeypatch, _store(folder))
    cls = compiled._make_manager_class()
    for args, kwargs, want in ((("UNKNOWNKEY",), {}, ("UNKNOWNKEY", False, False)),
                               ((DIR,), {"override": True}, (DIR, True, False)),
                               ((DIR, False, True), {}, (DIR, False, True))):
        fallback.instances.clear()
        m = cls(*args, **kwargs)
        assert len(fallback.instances) == 1 and fallback.instances[0].args == want  # made at once
        key = want[0]
        assert m.get_file("add_kernel.cubin") == f"/fallback/{key}/add_kernel.cubin"
        assert m.get_group("add_kernel.json") == {"fallback": "add_kernel.json"}
        m.put(b"x", "add_kernel.cubin")
        assert fallback.instances[0].calls == [("get_file", "add_kernel.cubin"), ("get_group", "add_kernel.json"),
                                               ("put", b"x", "add_kernel.cubin", True)]


def test_without_a_previous_manager_the_fallback_is_tritons_file_cache(tmp_path, monkeypatch):
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setattr(compiled, "_previous_manager", [None])
    monkeypatch.setattr(compiled, "_states", {})
    m = compiled._make_manager_class()("SOMEKEY")
    assert type(m.inner) is FileCacheManager
    path = m.put(b"data", "x.bin")
    assert Path(path).read_bytes() == b"data" and Path(path).parent == tmp_path / "triton-cache" / "SOMEKEY"
    assert m.get_file("x.bin") == path


@pytest.fixture
def knob_manager(monkeypatch):
    """Restores Triton's cache-manager knob and the module's record of it."""
    from triton import knobs

    monkeypatch.setattr(compiled, "_manager_class", [])
    monkeypatch.setattr(compiled, "_previous_manager", [])
    monkeypatch.setattr(compiled, "_states", {})
    monkeypatch.setattr(compiled, "_refusal_warned", [])
    had = "manager_class" in vars(knobs.cache)
    old = knobs.cache.manager_class
    if had:  # a GPU run of other tests may have installed the real manager: start from Triton's default
        del knobs.cache.manager_class
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    yield knobs
    if had:
        knobs.cache.manager_class = old
    else:
        del knobs.cache.manager_class


def test_state_discovers_stores_once_and_installs_the_cache_manager(tmp_path, monkeypatch, knob_manager):
    from liger_gen.runtime import devices, tables

    monkeypatch.delenv(compiled.ENV_DISABLE, raising=False)
    folder = _make_store(tmp_path, triton=__import__("triton").__version__, env=compiled.cache_env())
    calls = []
    monkeypatch.setattr(devices, "current_gpu", lambda d: calls.append(d) or (GPU, "NVIDIA H200"))
    monkeypatch.setattr(compiled, "device_target", lambda d: dict(TARGET))
    monkeypatch.setattr(tables, "table_roots", lambda: [("user", tmp_path)])
    st = compiled.state(5)
    assert st is not None and [s.path for s in st.stores] == [folder]
    assert set(st.kernels) == {KEY} and st.kernels[KEY][0] is st.stores[0]
    assert st.dirs == {DIR: st.stores[0], SO_DIR: st.stores[0]}
    assert compiled.state(5) is st and calls == [5]  # once per process and device
    cls = knob_manager.cache.manager_class
    assert cls is compiled._manager_class[0] and compiled._previous_manager == [None]
    compiled.install_cache_manager()
    assert compiled._previous_manager == [None]  # not its own fallback
    assert compiled._store_for_dir(DIR) is st.stores[0] and compiled._store_for_dir("OTHER") is None
    with _Warnings() as w:
        assert compiled.lookup("add_0123", "add_kernel", "[]", None, 5) is None  # not in the store
    assert w.caught == []
    # an entry whose signature does not list the kernel's parameters is not loaded (one warning)
    fn = types.SimpleNamespace(arg_names=["X", "n", "BLOCK"])
    stem, name, text = KEY.split(":", 2)
    with _Warnings() as w:
        assert compiled.lookup(stem, name, text, fn, 5) is None
    assert len(w.ours) == 1 and "signature" in str(w.ours[0].message)
    # a kernel that failed to launch is forgotten
    compiled.launch_failed(stem, name, text)
    assert KEY not in st.kernels


def test_state_warns_when_every_store_found_is_refused(tmp_path, monkeypatch, knob_manager):
    from liger_gen.runtime import devices, tables

    monkeypatch.delenv(compiled.ENV_DISABLE, raising=False)
    folder = _make_store(tmp_path, triton="0.0.1")
    monkeypatch.setattr(devices, "current_gpu", lambda d: (GPU, "NVIDIA H200"))
    monkeypatch.setattr(compiled, "device_target", lambda d: dict(TARGET))
    monkeypatch.setattr(tables, "table_roots", lambda: [("user", tmp_path)])
    with _Warnings() as w:
        assert compiled.state(6) is None
        assert compiled.state(7) is None  # a second device: no second warning in this process
    assert len(w.ours) == 1 and "no compiled kernel cache can be used" in str(w.ours[0].message)
    assert str(folder) in str(w.ours[0].message) and "Triton 0.0.1" in str(w.ours[0].message)
    assert knob_manager.cache.manager_class is None  # nothing to serve: Triton's cache is left alone


def test_state_is_none_when_disabled_or_without_a_gpu(monkeypatch, knob_manager):
    from liger_gen.runtime import devices

    monkeypatch.setattr(devices, "current_gpu", lambda d: None)
    monkeypatch.delenv(compiled.ENV_DISABLE, raising=False)
    assert compiled.state(3) is None and compiled._states == {3: None}
    monkeypatch.setattr(devices, "current_gpu", lambda d: pytest.fail("disabled: no discovery"))
    monkeypatch.setenv(compiled.ENV_DISABLE, "0")
    assert compiled.state(4) is None
    assert knob_manager.cache.manager_class is None


def test_launch_failed_warns_once_and_forgets_the_kernel(tmp_path, monkeypatch, fallback):
    store = _store(_make_store(tmp_path))
    st = _register(monkeypatch, store)
    monkeypatch.setitem(compiled._states, 98, None)
    st.kernels[KEY] = (store, store.kernels[KEY])
    stem, name, text = KEY.split(":", 2)
    with _Warnings() as w:
        compiled.launch_failed(stem, name, text)
        compiled.launch_failed(stem, name, text)
        compiled.launch_failed("other", name, text)
    assert st.kernels == {} and len(w.ours) == 1 and "could not be launched" in str(w.ours[0].message)


# ------------------------------------------------------------------------------------------ building a store


class FakeSrc:
    def __init__(self, signature, constants, attrs):
        self.signature, self.constants, self.attrs = signature, constants, attrs


def _fake_compiled(cache, hex_hash, name, *, binary=True, constants=None):
    folder = cache / base32_key(hex_hash)
    folder.mkdir(parents=True)
    contents = {f"{name}.json": json.dumps({"name": name}).encode(), f"{name}.ptx": b"ptx", f"{name}.llir": b"ll",
                f"{name}.ttir": b"tt", f"__grp__{name}.json": b"{}"}
    if binary:
        contents[f"{name}.cubin"] = f"cubin of {name}".encode() * 7
    for fname, data in contents.items():
        (folder / fname).write_bytes(data)
    src = FakeSrc({"X": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                  {(2,): 128} if constants is None else constants, {(0,): [["tt.divisibility", 16]]})
    return types.SimpleNamespace(src=src, hash=hex_hash, metadata_group={f: str(folder / f) for f in contents})


@pytest.fixture
def triton_cache(tmp_path):
    cache = tmp_path / "triton-cache"
    so_dir = cache / SO_DIR
    so_dir.mkdir(parents=True)
    (so_dir / "cuda_utils.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF driver")
    (so_dir / "cuda_utils.c").write_bytes(b"int main;")
    (cache / "deep" / "er").mkdir(parents=True)
    (cache / "deep" / "er" / "nested.so").write_bytes(b"not one level down")
    return cache


def test_recorder_keeps_the_first_kernel_of_each_key(monkeypatch):
    monkeypatch.setattr(launch, "RECORDERS", [])
    first = types.SimpleNamespace(metadata_group={"a.json": "/a"})
    with compiled.Recorder() as rec:
        assert launch.RECORDERS == [rec]
        rec("stem", "k", "[]", first)
        rec("stem", "k", "[]", types.SimpleNamespace(metadata_group={"b.json": "/b"}))
        rec("stem", "k", "[1]", None)
        rec("stem", "k", "[2]", types.SimpleNamespace(metadata_group={}))
        rec("stem", "k", "[3]", object())
    assert launch.RECORDERS == []
    assert rec.kernels == {"stem:k:[]": first}


def test_kernel_record_lists_files_signature_constants_and_attrs(tmp_path):
    c = _fake_compiled(tmp_path, "12" * 32, "add_kernel")
    rec, files = compiled.kernel_record(c)
    assert rec == {"hash": "12" * 32, "dir": base32_key("12" * 32), "files": ["add_kernel.cubin", "add_kernel.json"],
                   "signature": [["X", "*fp32"], ["n", "i32"], ["BLOCK", "constexpr"]],
                   "constants": [[[2], 128]], "attrs": [[[0], [["tt.divisibility", 16]]]]}
    assert files == {n: c.metadata_group[n] for n in ("add_kernel.json", "add_kernel.cubin")}
    with pytest.raises(TypeError, match="no metadata or binary"):
        compiled.kernel_record(_fake_compiled(tmp_path, "34" * 32, "k", binary=False))
    with pytest.raises(TypeError, match="is not stored"):
        compiled.kernel_record(_fake_compiled(tmp_path, "56" * 32, "k", constants={(2,): object()}))


def _recorder(kernels):
    r = compiled.Recorder()
    r.kernels.update(kernels)
    return r


def test_write_store_writes_a_verifiable_manifest(tmp_path, triton_cache):
    import triton

    a = _fake_compiled(triton_cache, "12" * 32, "add_kernel")
    skipped = _fake_compiled(triton_cache, "34" * 32, "mul_kernel", binary=False)
    out = tmp_path / "tables"
    final = compiled.write_store(out, GPU, _recorder({"add:add_kernel:[]": a, "mul:mul_kernel:[]": skipped}),
                                 triton_cache, TARGET, built_for={"model": "tiny"})
    assert final == out / GPU / "compiled" / compiled.store_name(triton.__version__, "cuda", 90)
    assert final.name == f"triton-{triton.__version__}-cuda-sm90"
    manifest = compiled.read_manifest(final / compiled.MANIFEST)
    d = base32_key("12" * 32)
    so = f"{SO_DIR}/cuda_utils.cpython-311-x86_64-linux-gnu.so"
    assert set(manifest["files"]) == {f"{d}/add_kernel.json", f"{d}/add_kernel.cubin", so}
    for rel, info in manifest["files"].items():
        source = Path(a.metadata_group[rel.split("/")[1]]) if rel.startswith(d) else triton_cache / rel
        data = source.read_bytes()
        assert info == {"sha256": _sha(data), "size": len(data)} and (final / rel).read_bytes() == data
    assert set(manifest["kernels"]) == {"add:add_kernel:[]"}
    assert manifest["kernels"]["add:add_kernel:[]"]["signature"] == [["X", "*fp32"], ["n", "i32"],
                                                                      ["BLOCK", "constexpr"]]
    assert len(manifest["skipped"]) == 1 and manifest["skipped"][0].startswith("mul:mul_kernel:[]: ")
    assert manifest["schema"] == compiled.SCHEMA and manifest["triton"] == triton.__version__
    assert manifest["target"] == TARGET and manifest["env"] == compiled.cache_env() and manifest["gpu"] == GPU
    assert manifest["built_for"] == [{"model": "tiny"}]
    assert compiled.store_summary(final) == {
        "path": str(final), "triton": triton.__version__, "target": TARGET, "kernels": 1, "files": 3,
        "bytes": sum(i["size"] for i in manifest["files"].values())}
    # what was written is usable as a user store, every file verified
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temporary folder left
    usable, refused = compiled.find_stores(GPU, triton.__version__, TARGET, compiled.cache_env(),
                                           roots=[("user", out)])
    assert refused == [] and [s.path for s in usable] == [final]
    with _Warnings() as w:
        assert all(usable[0].check_file(rel) == final / rel for rel in manifest["files"])
    assert w.caught == []


def test_write_store_merges_or_replaces(tmp_path, triton_cache):
    import triton

    a = _fake_compiled(triton_cache, "12" * 32, "add_kernel")
    b = _fake_compiled(triton_cache, "34" * 32, "mul_kernel")
    out = tmp_path / "tables"
    final = compiled.write_store(out, GPU, _recorder({"add:add_kernel:[]": a}), triton_cache, TARGET,
                                 built_for={"model": "one"})
    first = compiled.read_manifest(final / compiled.MANIFEST)
    import shutil

    shutil.rmtree(triton_cache / base32_key("12" * 32))  # the merge copies a's files from the old store
    final2 = compiled.write_store(out, GPU, _recorder({"mul:mul_kernel:[]": b}), triton_cache, TARGET,
                                  built_for={"model": "two"}, merge=True)
    assert final2 == final
    merged = compiled.read_manifest(final / compiled.MANIFEST)
    assert set(merged["kernels"]) == {"add:add_kernel:[]", "mul:mul_kernel:[]"}
    assert merged["kernels"]["add:add_kernel:[]"] == first["kernels"]["add:add_kernel:[]"]
    assert set(first["files"]) < set(merged["files"]) and len(merged["files"]) == 5
    assert merged["built_for"] == [{"model": "one"}, {"model": "two"}]
    store = _store(final)
    with _Warnings() as w:
        assert all(store.check_file(rel) for rel in merged["files"])
    assert w.caught == []
    assert compiled.store_summary(final)["kernels"] == 2
    replaced = compiled.write_store(out, GPU, _recorder({"mul:mul_kernel:[]": b}), triton_cache, TARGET,
                                    merge=False)
    manifest = compiled.read_manifest(replaced / compiled.MANIFEST)
    assert set(manifest["kernels"]) == {"mul:mul_kernel:[]"} and manifest["built_for"] == []
    assert not (replaced / base32_key("12" * 32)).exists() and len(manifest["files"]) == 3
    assert compiled.store_summary(replaced)["files"] == 3
    assert sorted(p.name for p in replaced.parent.iterdir()) == [f"triton-{triton.__version__}-cuda-sm90"]


def test_write_store_does_not_merge_a_store_for_another_environment(tmp_path, triton_cache):
    a = _fake_compiled(triton_cache, "12" * 32, "add_kernel")
    b = _fake_compiled(triton_cache, "34" * 32, "mul_kernel")
    out = tmp_path / "tables"
    final = compiled.write_store(out, GPU, _recorder({"add:add_kernel:[]": a}), triton_cache, TARGET)
    path = final / compiled.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["env"] = {"TRITON_SOMETHING": "changed"}
    path.write_text(json.dumps(manifest))
    compiled.write_store(out, GPU, _recorder({"mul:mul_kernel:[]": b}), triton_cache, TARGET, merge=True)
    assert set(compiled.read_manifest(path)["kernels"]) == {"mul:mul_kernel:[]"}


# ------------------------------------------------------------------------------------------ disabled()


def test_disabled_by_environment(monkeypatch):
    for name in (compiled.ENV_DISABLE, "TRITON_ALWAYS_COMPILE", "TRITON_KERNEL_OVERRIDE", "TRITON_KERNEL_DUMP"):
        monkeypatch.delenv(name, raising=False)
    assert compiled.disabled() is False
    for value in ("0", "false", "No", " off "):
        monkeypatch.setenv(compiled.ENV_DISABLE, value)
        assert compiled.disabled() is True, value
    monkeypatch.setenv(compiled.ENV_DISABLE, "1")
    assert compiled.disabled() is False
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")
    assert compiled.disabled() is True


# ------------------------------------------------------------------------------------------ hostile stores


@pytest.mark.parametrize("change", ["tampered", "loose", "symlink"])
def test_a_rebuild_never_vouches_for_old_files_it_did_not_check(tmp_path, triton_cache, change):
    """Merging keeps the old store's entries only when the old store is private and every file matches: a
    tampered file, a folder others may write or a symlinked file start the new store afresh."""
    out = tmp_path / "out"
    first = _fake_compiled(triton_cache, "11" * 32, "add_kernel")
    final = compiled.write_store(out, GPU, _recorder({"add:add_kernel:[]": first}), triton_cache, TARGET)
    cubin = next(final.glob("*/add_kernel.cubin"))
    if change == "tampered":
        cubin.write_bytes(b"TAMPERED BINARY")
    elif change == "loose":
        os.chmod(cubin.parent, 0o777)
    else:
        elsewhere = tmp_path / "elsewhere.cubin"
        elsewhere.write_bytes(b"outside")
        cubin.unlink()
        cubin.symlink_to(elsewhere)
    second = _fake_compiled(triton_cache, "22" * 32, "mul_kernel")
    final = compiled.write_store(out, GPU, _recorder({"mul:mul_kernel:[]": second}), triton_cache, TARGET)
    manifest = compiled.read_manifest(final / compiled.MANIFEST)
    assert set(manifest["kernels"]) == {"mul:mul_kernel:[]"}  # the old entry was not carried over
    assert not any(rel.endswith("add_kernel.cubin") for rel in manifest["files"])
    store = _store(final)
    assert all(store.check_file(rel) is not None for rel in manifest["files"])


def test_concurrent_builds_into_one_store_keep_every_kernel(tmp_path, triton_cache):
    import threading

    out, errors = tmp_path / "out", []
    kernels = {f"op{i}:k{i}_kernel:[]": _fake_compiled(triton_cache, f"{i + 16:02x}" * 32, f"k{i}_kernel")
               for i in range(6)}

    def build(key):
        try:
            compiled.write_store(out, GPU, _recorder({key: kernels[key]}), triton_cache, TARGET)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(key,)) for key in kernels]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    folder = out / GPU / compiled.FOLDER
    final = folder / compiled.store_name(__import__("triton").__version__, "cuda", 90)
    assert set(compiled.read_manifest(final / compiled.MANIFEST)["kernels"]) == set(kernels)
    assert [p.name for p in folder.iterdir()] == [final.name]  # no temporary or retired folder left


@pytest.mark.parametrize("files_key", ["KEY/a\x00b", "KEY", "KEY/../x", "/abs/x", "KEY/sub/x", "KEY/\udcff"])
def test_a_manifest_with_an_unsafe_file_name_is_refused(tmp_path, files_key):
    folder = _make_store(tmp_path)
    manifest = json.loads((folder / compiled.MANIFEST).read_text())
    manifest["files"][files_key.replace("KEY", DIR)] = {"sha256": "0" * 64, "size": 1}
    (folder / compiled.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="file entry"):
        compiled.read_manifest(folder / compiled.MANIFEST)
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("packaged", tmp_path)])
    assert usable == [] and len(refused) == 1


@pytest.mark.parametrize("bad", [{"size": "big", "sha256": "0"}, {"size": None, "sha256": "0"}, [1, 2],
                                 {"size": -1, "sha256": "0"}, {"size": 3}])
def test_a_manifest_with_a_malformed_file_entry_is_refused(tmp_path, bad):
    folder = _make_store(tmp_path)
    manifest = json.loads((folder / compiled.MANIFEST).read_text())
    manifest["files"][f"{DIR}/add_kernel.cubin"] = bad
    (folder / compiled.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError):
        compiled.read_manifest(folder / compiled.MANIFEST)


def test_a_kernel_naming_files_the_manifest_does_not_list_is_refused(tmp_path):
    folder = _make_store(tmp_path)
    manifest = json.loads((folder / compiled.MANIFEST).read_text())
    manifest["kernels"][KEY]["files"].append("add_kernel.ptx")
    (folder / compiled.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="kernel"):
        compiled.read_manifest(folder / compiled.MANIFEST)


def test_deeply_nested_json_is_refused_not_raised(tmp_path):
    folder = _make_store(tmp_path)
    (folder / compiled.MANIFEST).write_text("[" * 200000)
    with pytest.raises(ValueError, match="cannot read"):
        compiled.read_manifest(folder / compiled.MANIFEST)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_in_a_store_is_refused_without_blocking(tmp_path):
    folder = _make_store(tmp_path)
    rel = f"{DIR}/add_kernel.cubin"
    (folder / rel).unlink()
    os.mkfifo(folder / rel, 0o644)
    assert "not a regular file" in compiled.untrusted_reason(folder)
    with _Warnings() as w:  # a packaged store is not permission-checked: the read itself must not hang
        assert _store(folder, "packaged").check_file(rel) is None
    assert len(w.ours) == 1


def test_a_group_writable_parent_folder_makes_a_user_store_untrusted(tmp_path):
    folder = _make_store(tmp_path)
    assert compiled.untrusted_reason(folder) is None
    os.chmod(folder.parent, 0o775)  # compiled/
    assert f"{folder.parent} is writable by group or others" in compiled.untrusted_reason(folder)
    os.chmod(folder.parent, 0o755)
    os.chmod(folder.parent.parent, 0o777)  # <gpu>/
    assert "writable by group or others" in compiled.untrusted_reason(folder)


def test_root_owned_stores_count_as_private(monkeypatch):
    from liger_gen.files import not_private

    monkeypatch.setattr(os, "getuid", lambda: 1000)  # an ordinary user in an image whose files root installed
    fake = types.SimpleNamespace(st_uid=0, st_mode=0o40755)

    assert not_private(fake) is not None and not_private(fake, allow_root=True) is None
    assert not_private(types.SimpleNamespace(st_uid=0, st_mode=0o40775), allow_root=True) is not None


def test_leftover_hidden_folders_are_not_stores(tmp_path):
    good = _make_store(tmp_path)
    leftover = _make_store(tmp_path, name=f".{good.name}.old.123")
    (leftover / DIR / "add_kernel.cubin").write_bytes(b"half deleted")
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", tmp_path)])
    assert [s.path for s in usable] == [good] and refused == []


def test_the_stores_are_switched_off_while_triton_instruments_kernels(monkeypatch):
    from triton import knobs

    from liger_gen.codegen.launch import _instrumented

    monkeypatch.delenv(compiled.ENV_DISABLE, raising=False)
    if not hasattr(knobs.compilation, "instrumentation_mode"):
        pytest.skip("this Triton has no instrumentation modes")
    assert not _instrumented(knobs) and not compiled.disabled()
    monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "gsan")
    assert _instrumented(knobs) and compiled.disabled()


def test_ints_beyond_uint64_have_no_launch_key():
    assert arg_key(2 ** 64 - 1) == ("i", False, False, "u64")
    for value in (2 ** 64, -(2 ** 63) - 1):
        with pytest.raises(TypeError):
            arg_key(value)


def test_the_cache_manager_is_installed_once_per_process(monkeypatch, knob_manager):
    class Other:  # another tool that wraps whatever manager is configured when it starts
        pass

    compiled.install_cache_manager()
    ours = knob_manager.cache.manager_class
    knob_manager.cache.manager_class = Other
    compiled.clear()
    compiled.install_cache_manager()  # a later discovery must not wrap the tool that wraps us
    assert knob_manager.cache.manager_class is Other and compiled._previous_manager == [None]
    assert ours is compiled._manager_class[0]


def test_a_recording_keeps_no_tensor_alive_after_its_block():
    """What ``launch.record()`` saw (every recorded launch's tensors) is freed as soon as the caller drops it,
    without waiting for the garbage collector: on the first training step a recording otherwise held the LM
    head's gradient (1 GB at Llama-3-8B's vocabulary) for a step."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        t = torch.empty(4096)
        alive = weakref.ref(t)
        with launch.record() as recording:
            recording.launches.append((None, None, (1,), (t,), None))  # what a lean launch appends
            torch.zeros(1).add_(1)  # a non-view op: noted as other work
        assert recording.other_work is not None
        del recording, t
        assert alive() is None
    finally:
        if enabled:
            gc.enable()


# ------------------------------------------------------------------------------------------ manifest schema

#: (field path in the manifest, a value of the wrong type): what a hand-edited or foreign manifest may hold
MISTYPED = [
    (("host",), "x"), (("host",), None), (("host",), ["ext_suffix"]), (("host", "ext_suffix"), 5),
    (("built_for",), 5), (("built_for",), None), (("built_for",), {"model": "x"}), (("built_for",), [5]),
    (("triton",), 5), (("triton",), None), (("env",), "x"), (("env",), {"TRITON_X": 1}),
    (("target", "backend"), 5), (("target", "arch"), [90]), (("target", "arch"), True),
    (("target", "warp_size"), "32"), (("gpu",), 5), (("created",), []), (("skipped",), 5),
    (("skipped",), [{}]), (("liger_gen",), 1), (("files", f"{DIR}/add_kernel.cubin", "sha256"), 5),
    (("kernels", KEY, "hash"), 5), (("kernels", KEY, "signature"), 5), (("kernels", KEY, "signature"), [["X"]]),
    (("kernels", KEY, "signature"), [["X", 1]]), (("kernels", KEY, "constants"), {"a": 1}),
    (("kernels", KEY, "constants"), [[0, 1]]), (("kernels", KEY, "constants"), [[["a"], 1]]),
    (("kernels", KEY, "attrs"), 5), (("kernels", KEY, "attrs"), [[[0], {"a": 1}]]),
    (("kernels", KEY, "dir"), None), (("kernels", KEY), [1]),
]


def _mistype(folder, where, value):
    """Set the manifest field at path ``where`` of the store at ``folder`` to ``value``."""
    manifest = json.loads((folder / compiled.MANIFEST).read_text())
    node = manifest
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = value
    (folder / compiled.MANIFEST).write_text(json.dumps(manifest))


def _case_id(case):
    return f"{'.'.join(k if len(k) < 20 else 'K' for k in case[0])}={json.dumps(case[1])}"


@pytest.mark.parametrize("where,value", MISTYPED, ids=[_case_id(c) for c in MISTYPED])
def test_read_manifest_checks_the_type_of_every_field(tmp_path, where, value):
    folder = _make_store(tmp_path)
    compiled.read_manifest(folder / compiled.MANIFEST)  # the store as written is a manifest
    _mistype(folder, where, value)
    with pytest.raises(ValueError) as exc:
        compiled.read_manifest(folder / compiled.MANIFEST)
    named = where[0] if where[0] not in ("kernels", "files") else where[-1] if len(where) == 3 and \
        where[0] == "kernels" else where[1]  # the field, or the kernel or file entry
    assert str(folder / compiled.MANIFEST) in str(exc.value) and f"'{named}'" in str(exc.value), exc.value


@pytest.mark.parametrize("where,value", [(("host",), "x"), (("built_for",), 5), (("kernels", KEY, "signature"), 5)])
def test_a_mistyped_manifest_is_refused_by_the_runtime_with_a_warning(tmp_path, monkeypatch, knob_manager, where,
                                                                       value):
    """The runtime loader refuses the store with one warning; a good store in another folder is still used."""
    from liger_gen.runtime import devices, tables

    monkeypatch.delenv(compiled.ENV_DISABLE, raising=False)
    triton_version = __import__("triton").__version__
    bad = _make_store(tmp_path / "bad", triton=triton_version, env=compiled.cache_env())
    _mistype(bad, where, value)
    monkeypatch.setattr(devices, "current_gpu", lambda d: (GPU, "NVIDIA H200"))
    monkeypatch.setattr(compiled, "device_target", lambda d: dict(TARGET))
    monkeypatch.setattr(tables, "table_roots", lambda: [("user", tmp_path / "bad")])
    with _Warnings() as w:
        assert compiled.state(11) is None
    assert len(w.ours) == 1 and str(bad) in str(w.ours[0].message) and f"'{where[-1]}'" in str(w.ours[0].message)
    good = _make_store(tmp_path / "good", triton=triton_version, env=compiled.cache_env())
    usable, refused = compiled.find_stores(GPU, triton_version, TARGET, compiled.cache_env(),
                                           roots=[("user", tmp_path / "bad"), ("user", tmp_path / "good")])
    assert [s.path for s in usable] == [good] and len(refused) == 1 and refused[0].startswith(f"{bad}: ")


def _verify_store(root):
    from click.testing import CliRunner

    from liger_gen.cli import main
    from liger_gen.runtime import tables

    return CliRunner().invoke(main, ["verify", "--gpu", GPU, "--model", "llama3-8b", "--ops", "rms_norm",
                                     "--allow-heuristic"], env={"COLUMNS": "200", tables.ENV_TUNED_DIR: str(root)})


@pytest.mark.parametrize("where,value", [(("host",), "x"), (("host",), None), (("host",), []), (("built_for",), 5),
                                         (("built_for",), None), (("triton",), 5), (("kernels", KEY, "attrs"), 5)])
def test_verify_reports_a_mistyped_manifest_as_an_unusable_store(tmp_path, where, value):
    """Exit 1 with one line naming the store and the field, as for every other store defect; no traceback."""
    folder = _make_store(tmp_path, triton=__import__("triton").__version__)
    assert _verify_store(tmp_path).exit_code == 0
    _mistype(folder, where, value)
    result = _verify_store(tmp_path)
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    problems = " ".join(result.output.split()).split("unusable: ")[1:]  # rich wraps long lines
    assert len(problems) == 1 and problems[0].startswith(f"compiled kernels {folder}: ")
    assert f"'{where[-1]}' must be" in problems[0]


# ------------------------------------------------------------------------------------------ trust: the real path


def test_a_tables_folder_that_is_a_symbolic_link_is_resolved_once_and_its_real_folders_checked(tmp_path):
    """An image's /opt/tuned -> /opt/tuned-v3: the store under the real folder is used (its path is the real one,
    so what was checked is what is read); links inside the tables folder are still refused, and a real folder
    that fails the rules is refused through the link too."""
    real = tmp_path / "tuned-v3"
    folder = _make_store(real)
    link = tmp_path / "tuned"
    link.symlink_to(real, target_is_directory=True)
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", link)])
    assert refused == [] and [s.path for s in usable] == [folder]
    mid = tmp_path / "images"  # a link further up the path
    mid.symlink_to(tmp_path, target_is_directory=True)
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", mid / "tuned")])
    assert refused == [] and [s.path for s in usable] == [folder]
    mode = tmp_path.stat().st_mode
    os.chmod(tmp_path, 0o777)  # the real folders' parent: others could swap tuned-v3
    try:
        usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", link)])
    finally:
        os.chmod(tmp_path, mode)
    assert usable == [] and f"{tmp_path} is writable by group or others" in refused[0]
    gpu_link = tmp_path / "other" / GPU
    gpu_link.parent.mkdir()
    gpu_link.symlink_to(real / GPU, target_is_directory=True)
    usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", tmp_path / "other")])
    assert usable == [] and "symbolic link" in refused[0]


def test_verify_uses_a_store_under_a_linked_tables_folder(tmp_path):
    real = tmp_path / "tuned-v3"
    folder = _make_store(real, triton=__import__("triton").__version__)
    link = tmp_path / "tuned"
    link.symlink_to(real, target_is_directory=True)
    result = _verify_store(link)
    assert result.exit_code == 0, result.output
    assert f"compiled kernels: {folder} (user)" in " ".join(result.output.split())


# ------------------------------------------------------------------------------------------ trust: every ancestor

needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="gives folders to another uid (os.chown)")


@pytest.mark.parametrize("level", [4, 5])
def test_a_writable_folder_anywhere_above_a_user_store_makes_it_untrusted(tmp_path, level):
    """Level 1 is compiled/, 2 <gpu>/, 3 the tables folder, 4 and up the folders above it, to the filesystem
    root: whoever may write any of them can swap the store after it was checked."""
    root = tmp_path / "a" / "b" / "tuned"
    folder = _make_store(root)
    above = folder.parents[level - 1]
    assert above in (root.parent, root.parent.parent)
    os.chmod(above, 0o775)
    try:
        reason = compiled.untrusted_reason(folder)
        usable, refused = compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", root)])
    finally:
        os.chmod(above, 0o755)
    assert reason == f"{above} is writable by group or others (mode 0o40775)"
    assert usable == [] and f"{above} is writable by group or others" in refused[0]
    assert compiled.untrusted_reason(folder) is None


@needs_root
def test_a_sticky_world_writable_folder_above_a_store_is_fine_when_it_and_its_child_are_trusted(tmp_path):
    """As /tmp (mode 1777, root's): nobody but the owner of an entry, the folder's owner or root may rename or
    remove the entry, so a trusted child cannot be swapped. A sticky folder owned by another user is refused
    (its owner may), and so is a child of it owned by another user."""
    shared = tmp_path / "shared"
    root = shared / "mine" / "tuned"
    folder = _make_store(root)
    os.chmod(shared, 0o1777)
    assert compiled.untrusted_reason(folder) is None
    os.chmod(root, 0o1777)  # the tables folder itself, as LIGER_GEN_TUNED_DIR=/tmp
    assert compiled.untrusted_reason(folder) is None
    assert compiled.find_stores(GPU, TRITON, TARGET, {}, roots=[("user", root)])[0][0].path == folder
    os.chmod(root, 0o755)
    os.chown(shared / "mine", 12345, -1)
    assert compiled.untrusted_reason(folder) == f"{shared / 'mine'} is owned by uid 12345, not by you (uid 0)"
    os.chown(shared / "mine", 0, -1)
    os.chown(shared, 12345, -1)
    assert f"{shared} is owned by uid 12345" in compiled.untrusted_reason(folder)
    os.chown(shared, 0, -1)
    os.chmod(folder, 0o1777)  # the store itself: nothing in it may be writable by others, sticky or not
    assert f"{folder} is writable by group or others" in compiled.untrusted_reason(folder)


@needs_root
def test_folders_above_a_store_may_be_yours_or_roots_but_no_one_elses(tmp_path, monkeypatch):
    root = tmp_path / "a" / "b" / "tuned"
    folder = _make_store(root)
    monkeypatch.setattr(os, "getuid", lambda: 1000)  # a user in an image whose folders root made
    assert compiled.untrusted_reason(folder) is None
    os.chown(tmp_path / "a", 1000, -1)  # yours
    assert compiled.untrusted_reason(folder) is None
    os.chown(tmp_path / "a", 12345, -1)  # level 5: someone else's
    assert compiled.untrusted_reason(folder) == f"{tmp_path / 'a'} is owned by uid 12345, not by you (uid 1000)"
    os.chown(tmp_path / "a", 0, -1)


def test_verify_reports_a_manifest_file_size_out_of_bounds_as_an_unusable_store(tmp_path):
    """A file size no file can have (10**400 bytes) is a manifest defect: one line, exit 1 (its MiB total once
    overflowed a float in verify)."""
    folder = _make_store(tmp_path, triton=__import__("triton").__version__)
    manifest = json.loads((folder / compiled.MANIFEST).read_text())
    rel = next(iter(manifest["files"]))
    manifest["files"][rel]["size"] = 10 ** 400
    (folder / compiled.MANIFEST).write_text(json.dumps(manifest))
    result = _verify_store(tmp_path)
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    problems = " ".join(result.output.split()).split("unusable: ")[1:]
    assert len(problems) == 1 and f"file entry {rel!r} must be" in problems[0] and "size from 0" in problems[0]


def test_verify_gives_a_notice_for_a_tables_folder_that_is_a_loop_of_links(tmp_path):
    from click.testing import CliRunner

    from liger_gen.cli import main
    from liger_gen.runtime import tables

    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    result = CliRunner().invoke(main, ["verify", "--gpu", GPU, "--model", "llama3-8b", "--ops", "rms_norm"],
                                env={"COLUMNS": "200", tables.ENV_TUNED_DIR: str(a)})
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert result.exit_code == 0, result.output  # the packaged tables serve rms_norm
    assert "notice:" in result.output and str(a) in " ".join(result.output.split())
