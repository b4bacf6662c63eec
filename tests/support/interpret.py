"""Running the GPU tests' Triton kernels on the CPU: the Triton interpreter (TRITON_INTERPRET=1) with the sm_90 GPU's
float semantics.

Under TRITON_INTERPRET=1 the kernel tests put their tensors on the CPU (`GPU_TEST_DEVICE`) and pick their small
interpreter shapes (`by_device`); tests/conftest.py applies `patch_interpreter` once per process, before any kernel
runs, runs the tests marked `interpreter` and skips the other GPU tests (marker `gpu`). The interpreter is chosen
when a kernel is decorated, so the variable must be set before pytest starts:

    TRITON_INTERPRET=1 python3 -m pytest -q -m interpreter
"""

from __future__ import annotations

import os
from typing import TypeVar

# A CPU run of the kernels under the Triton interpreter: the GPU test modules then put their tensors on the CPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GPU_TEST_DEVICE = "cpu" if INTERPRET else "cuda"

T = TypeVar("T")


def by_device(gpu: T, interpreter: T) -> T:
    """`interpreter` under TRITON_INTERPRET=1, else `gpu`: a parametrization whose GPU cases stay as measured on the
    H200 while the CPU interpreter (seconds per launch) runs the fewest cases that reach the same kernel paths."""
    return interpreter if INTERPRET else gpu


def allow_tensor_loop_bounds() -> bool:
    """Make the interpreter's tensor.__index__ accept one-element arrays (False if its hook is missing). Numpy >= 2
    refuses int() of a one-element 1-d array, which is how the interpreter turns a loop bound computed in the kernel
    (`range(g0, g1)` with tensor bounds) into a Python int."""
    import numpy as np
    import triton.runtime.interpreter as interp

    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None:
        return False
    if getattr(patch, "_loop_bounds", False):  # applied already (idempotent)
        return True

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._loop_bounds = True
    interp._patch_lang_tensor = patched
    return True


def _bf16_bits_to_f32(bits):
    """bf16 bit patterns (uint16 array) -> their exact fp32 values."""
    import numpy as np

    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(x):
    """fp32 values -> bf16 bit patterns, rounded to nearest even as the GPU's cvt.rn.bf16.f32 (overflow to inf,
    NaN stays a quiet NaN of the same sign)."""
    import numpy as np

    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((b >> 16) | 0x40).astype(np.uint16), r)


def _fp8_types():
    """Triton FP8 type -> (torch dtype, largest finite value)."""
    import torch
    import triton.language as tl

    return {tl.float8e4nv: (torch.float8_e4m3fn, 448.0), tl.float8e5: (torch.float8_e5m2, 57344.0)}


def _fp8_bits_to_f32(bits, ty):
    """FP8 bit patterns (uint8 array) of Triton type ty -> their exact fp32 values (NaN codes to NaN)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits)).view(_fp8_types()[ty][0]).float().numpy()


def _f32_to_fp8_bits(x, ty):
    """fp32 values -> FP8 bit patterns as the GPU's cvt.rn.satfinite.{e4m3,e5m2}x2.f32: nearest even, finite values
    and infinities beyond the format's range saturate to its largest finite value, NaN of either sign becomes the
    code 0x7F."""
    import numpy as np
    import torch

    dtype, top = _fp8_types()[ty]
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    bits = t.clamp(-top, top).to(dtype).view(torch.uint8)
    return torch.where(torch.isnan(t), 0x7F, bits).to(torch.uint8).numpy()  # the GPU's NaN: 0x7F, either sign


def _widen(t, handle):
    """A bf16 / FP8 interpreter tensor as its exact fp32 values (others as they are)."""
    import triton.language as tl

    ty = t.dtype.scalar
    if ty == tl.bfloat16:
        return handle(_bf16_bits_to_f32(t.data), tl.float32)
    if ty in _fp8_types():
        return handle(_fp8_bits_to_f32(t.data, ty), tl.float32)
    return t


def faithful_floats() -> bool:
    """Make the interpreter's bf16 and FP8 arithmetic the sm_90 GPU's (False if its builder hooks are missing).
    Triton 3.6's interpreter stores bf16 / FP8 as uint16 / uint8 bit patterns and
      (1) multiplies bf16 `tl.dot` operands as those integers (outputs ~1e11);
      (2) rounds fp32 -> bf16 by truncation;
      (3) converts to and from FP8 through a generic float converter: no saturation, no carry of a rounded-up
          mantissa into the exponent, E4M3's NaN code read as 480.
    Here dot operands are widened exactly to fp32 (the tensor core's products are exact, its accumulation fp32),
    fp32 -> bf16 rounds to nearest even (cvt.rn.bf16.f32), and fp32 <-> E4M3 / E5M2 is the GPU's
    cvt.rn.satfinite conversion, through torch's exact casts (tests/support/test_triton_float_semantics.py checks
    all three against torch on adversarial values, on the GPU and here)."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    builder = getattr(interp, "InterpreterBuilder", None)
    handle = getattr(interp, "TensorHandle", None)
    hooks = ("create_dot", "cast_impl", "create_fp_to_fp")
    if builder is None or handle is None or not all(hasattr(builder, h) for h in hooks):
        return False
    if getattr(builder, "_faithful_floats", False):
        return True
    dot, cast, fp_to_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp
    narrow = (tl.float32, tl.float16, tl.bfloat16)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if {a.dtype.scalar, b.dtype.scalar} & {tl.bfloat16, *_fp8_types()}:
            a, b = _widen(a, handle), _widen(b, handle)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == tl.float32 and dst_ty == tl.bfloat16:
            return handle(_f32_to_bf16_bits(src.data), tl.bfloat16)
        if src_ty == tl.bfloat16 and dst_ty == tl.float32:
            return handle(_bf16_bits_to_f32(src.data), tl.float32)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        import numpy as np

        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if dst_ty in _fp8_types() and src_ty in narrow and rounding_mode in (None, interp._ir.ROUNDING_MODE.RTNE):
            wide = _widen(src, handle).data.astype(np.float32)
            return handle(_f32_to_fp8_bits(wide, dst_ty), dst_ty)
        if src_ty in _fp8_types() and dst_ty in narrow:
            wide = handle(_fp8_bits_to_f32(src.data, src_ty), tl.float32)  # exact in each narrow type
            return wide if dst_ty == tl.float32 else self.cast_impl(wide, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot, builder.cast_impl, builder.create_fp_to_fp = create_dot, cast_impl, create_fp_to_fp
    builder._faithful_floats = True
    return True


def patch_language_once() -> bool:
    """Patch triton.language for the interpreter once per launch, not on every device-function call (False if the
    hooks are missing; only a speed-up). Triton 3.6's interpreter re-applies `_patch_lang` -- every builtin of
    triton.language rebound to the interpreter's semantics, through inspect.getmembers -- at each call of a
    @triton.jit helper inside a kernel, although the launch (`GridExecutor.__call__`) has patched the same modules
    and restores them only when it ends (the modules a helper's call patches beyond those, it never restores): a
    fifth of the CPU time of a paged-decode launch. A call whose function sees no language module that is not patched
    already in the running launch skips it; the patched attributes are the same objects either way, so no kernel
    computes anything else."""
    import inspect

    import triton.language as tl
    import triton.runtime.interpreter as interp

    grid_cls, fn_cls = getattr(interp, "GridExecutor", None), getattr(interp, "InterpretedFunction", None)
    if grid_cls is None or fn_cls is None or not hasattr(interp, "_patch_lang"):
        return False
    if getattr(fn_cls, "_patch_once", False):
        return True
    launch, device_call = grid_cls.__call__, fn_cls.__call__
    running: list[set] = []  # the language modules patched so far in each launch in progress
    seen: dict = {}

    def langs(fn) -> frozenset:  # the modules `_patch_lang` would patch for fn
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and (v is tl or v is tl.core))
        return seen[key]

    def patched_launch(self, *args, **kwargs):
        running.append(set(langs(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.pop()

    def patched_device_call(self, *args, **kwargs):
        if not running:
            return device_call(self, *args, **kwargs)
        if not langs(self.fn) <= running[-1]:  # e.g. tl.sum (triton.language.standard sees tl.core): patched
            running[-1] |= langs(self.fn)  # here and left so by the interpreter until the launch ends (or longer)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    grid_cls.__call__, fn_cls.__call__ = patched_launch, patched_device_call
    fn_cls._patch_once = True
    return True


def patch_interpreter(loop_bounds: bool = True) -> str | None:
    """`allow_tensor_loop_bounds` (unless loop_bounds is False), `faithful_floats` and, where its hooks exist,
    `patch_language_once`; None, or why one of the first two could not be applied."""
    if loop_bounds and not allow_tensor_loop_bounds():
        return "triton.runtime.interpreter has no _patch_lang_tensor"
    if not faithful_floats():
        return "triton.runtime.interpreter's InterpreterBuilder has no create_dot / cast_impl / create_fp_to_fp"
    patch_language_once()
    return None
