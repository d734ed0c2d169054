"""Triton's CPU interpreter without its repeated set-up and slow casts: the tests run every kernel through it.

The interpreter swaps ``triton.language``'s builtins for numpy-backed ones when a kernel launches (`_patch_lang`) and
puts them back when the launch ends, but it also calls `_patch_lang` again at every call of a nested ``@triton.jit``
function, which walks the language modules with ``inspect.getmembers`` (about a millisecond a call) only to find
them already swapped. The fused 8-bit update calls some 80 helpers a program, so the walks were half of its time in
the interpreter. `skip_repeated_patching` makes a nested call return an empty scope when every language module the
function sees is already swapped (its ``load`` is no longer the builtin): the same objects run, a kernel computes the
same bits (`tests/kernels/test_interpreter_patch.py`; and an 8-step GPT run in each state precision gave every loss
bit for bit), in about half the interpreter time. Where Triton has no such function (another version), nothing is
changed.

`remember_numpy_dtypes` answers the interpreter's ``_get_np_dtype`` (a Triton type's numpy dtype, asked at every
operation) from a cache: Triton's builds a dict of twenty Triton types at each call, and hashing them cost about a
twelfth of an fp32 update's interpreter time. The answer is the same function's, once per type; a block type (which
cannot be hashed) is answered as its element type, a pointer as every pointer, as Triton's function answers them.

`fast_bfloat16_casts` answers the interpreter's float32 <-> bfloat16 casts (``_convert_float``, which takes every
value apart into sign, exponent and significand in a dozen numpy passes: about a tenth of a bf16 trajectory's
interpreter time) with one shift where its answer is a shift: no subnormal among the inputs and no rounding mode
asked. Anything else (a subnormal, a rounding mode, other types) goes to Triton's function as before. Every answer is
Triton's, bit for bit (tests/kernels/test_interpreter_patch.py compares every bfloat16 pattern and a million float32
ones, subnormals, infinities and NaN payloads among them).

`share_tensor_shapes` gives every interpreted ``tl.tensor`` of one shape the same ``shape`` tuple and ``numel``
(Triton builds both afresh for each of the thousands of tensors a launch makes, a tenth of a trajectory's interpreter
time). Nothing changes those objects once made. It goes in only where ``tl.tensor.__init__`` is, to the letter, the
one it stands in for (`_TENSOR_INIT`): a Triton whose constructor differs keeps its own.

`index_size_one_blocks` is not a shortcut but a fix for older Triton: a scalar loaded through a pointer is a
one-element block in the interpreter, and Triton 3.6's ``__index__`` (``int(self.handle.data)``) fails on one under
numpy 2, so a loop bounded by a loaded count (``range(0, n, RBLOCK)`` in the norm's reduction) raised where the
compiled kernel runs. It answers as later Triton does (``int(self.handle.data.squeeze())``) and goes in only where
Triton's own line is, to the letter, the old one.

`install` puts them in, for the test session (tests/conftest.py) and for each rank process (tests/ranks.py).
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections.abc import Callable
from typing import Any


def _in_front(owner: Any, name: str, mark: str, stand_in_for: Callable[[Any], Any]) -> None:
    """Put ``stand_in_for(original)`` in place of ``owner.<name>``, once: the stand-in carries ``mark`` (True) and
    ``original``; nothing where ``owner`` has no such attribute or ``stand_in_for`` gives None."""
    original = getattr(owner, name, None)
    if original is None or getattr(original, mark, False):
        return
    stand_in = stand_in_for(original)
    if stand_in is None:
        return
    setattr(stand_in, mark, True)
    stand_in.original = original
    setattr(owner, name, stand_in)


def skip_repeated_patching() -> None:
    """Install the shortcut (once). Call it with TRITON_INTERPRET=1 set: it imports ``triton.language``, whose own
    jit functions (``tl.zeros``, ...) are interpreted only when the switch is on at that import."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton is a dependency
        return
    scope = getattr(interpreter, "_LangPatchScope", None)

    def stand_in_for(original: Any) -> Any:
        if scope is None:
            return None
        langs_of: dict[Any, list[Any]] = {}  # function -> the language modules among its globals (set at import)

        def patch_lang(fn: Any) -> Any:
            langs = langs_of.get(fn)
            if langs is None:
                langs = langs_of[fn] = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
            if langs and all(not tl.core.is_builtin(vars(lang).get("load")) for lang in langs):
                return scope()  # swapped by the launch around this call; the launch's scope puts them back
            return original(fn)

        return patch_lang

    _in_front(interpreter, "_patch_lang", "skips_repeats", stand_in_for)


def remember_numpy_dtypes() -> None:
    """Install the cache in front of ``interpreter._get_np_dtype`` (once); nothing where Triton has none."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton is a dependency
        return

    def stand_in_for(original: Any) -> Any:
        cache: dict[Any, Any] = {}
        address = original(tl.pointer_type(tl.float32))  # every pointer's, alone or in a block

        def get_np_dtype(tt_dtype: Any) -> Any:
            if isinstance(tt_dtype, tl.block_type):  # (not hashable) Triton's answer for a block: its element type's
                tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, tl.pointer_type):  # (not hashable either)
                return address
            try:
                return cache[tt_dtype]
            except KeyError:
                found = cache[tt_dtype] = original(tt_dtype)
                return found
            except TypeError:  # a type that cannot be hashed: asked each time
                return original(tt_dtype)

        return get_np_dtype

    _in_front(interpreter, "_get_np_dtype", "remembers", stand_in_for)


def fast_bfloat16_casts() -> None:
    """Install the shift in front of ``interpreter._convert_float`` (once); nothing where Triton has none."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton is a dependency
        return

    def stand_in_for(original: Any) -> Any:
        def convert_float(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
            if rounding_mode is None and isinstance(input, np.ndarray):
                if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and input.dtype == np.float32:
                    bits = np.ascontiguousarray(input).view(np.uint32)  # as Triton's, the values in C order
                    if not np.any(((bits & 0x7F800000) == 0) & ((bits & 0x007FFFFF) != 0)):
                        return (bits >> 16).astype(np.uint16).reshape(input.shape)  # the upper half: truncation
                elif input_dtype == tl.bfloat16 and output_dtype == tl.float32 and input.dtype == np.uint16:
                    bits = np.ascontiguousarray(input)
                    if not np.any(((bits & 0x7F80) == 0) & ((bits & 0x007F) != 0)):
                        return (bits.astype(np.uint32) << 16).reshape(input.shape)
            return original(input, input_dtype, output_dtype, rounding_mode)

        return convert_float

    _in_front(interpreter, "_convert_float", "shifts", stand_in_for)


_TENSOR_INIT = '''def __init__(self, handle, type: dtype):
    """Not called by user code."""
    super().__init__()
    # IR handle
    self.handle = handle
    # Block shape
    self.shape = type.shape if type.is_block() else ()
    self.numel = constexpr(math.prod(self.shape))
    self.type = type  # Tensor type (can be block_type)
    # Following the practice in pytorch, dtype is scalar type
    self.dtype = type.scalar
    self.shape = tuple([constexpr(s) for s in self.shape])
'''
"""``tl.tensor.__init__`` as `share_tensor_shapes` stands in for it (Triton 3.9's)."""


def share_tensor_shapes() -> None:
    """Install the shared shapes (once), where ``tl.tensor.__init__`` is `_TENSOR_INIT`."""
    try:
        import triton.language as tl
    except ImportError:  # pragma: no cover - triton is a dependency
        return
    core = tl.core

    def stand_in_for(original: Any) -> Any:
        try:
            if textwrap.dedent(inspect.getsource(original)) != _TENSOR_INIT:
                return None
        except (OSError, TypeError):
            return None
        made: dict[Any, tuple[Any, Any]] = {}  # a block's shape (ints) -> its numel and shape as Triton makes them

        def tensor_init(self: Any, handle: Any, type: Any) -> None:  # (Triton's argument names)
            self.handle = handle
            shape = type.shape if type.is_block() else ()
            try:
                self.numel, self.shape = made[shape]
            except KeyError:
                self.numel, self.shape = made[shape] = (
                    core.constexpr(math.prod(shape)),
                    core.tuple([core.constexpr(s) for s in shape]),
                )
            except TypeError:  # a shape that cannot be hashed: made for this tensor alone
                self.numel = core.constexpr(math.prod(shape))
                self.shape = core.tuple([core.constexpr(s) for s in shape])
            self.type = type
            self.dtype = type.scalar

        return tensor_init

    _in_front(core.tensor, "__init__", "shares_shapes", stand_in_for)


_OLD_INDEX = 'scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))'
"""Triton 3.6's ``__index__`` of an interpreted tensor, which `index_size_one_blocks` stands in for."""


def index_size_one_blocks() -> None:
    """Install later Triton's ``__index__`` after ``interpreter._patch_lang_tensor`` (once), where that function sets
    `_OLD_INDEX`; nothing elsewhere."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton is a dependency
        return

    def stand_in_for(original: Any) -> Any:
        try:
            if _OLD_INDEX not in inspect.getsource(original):
                return None
        except (OSError, TypeError):
            return None

        def patch_lang_tensor(tensor: Any, scope: Any) -> None:
            original(tensor, scope)
            # the scope puts attributes back last set first, so Triton's own is restored after the launch
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        return patch_lang_tensor

    _in_front(interpreter, "_patch_lang_tensor", "indexes_blocks", stand_in_for)


def install() -> None:
    """The shortcuts and the fix (each once), with TRITON_INTERPRET=1 set."""
    index_size_one_blocks()
    skip_repeated_patching()
    remember_numpy_dtypes()
    fast_bfloat16_casts()
    share_tensor_shapes()
