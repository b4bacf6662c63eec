"""SASS of a Triton kernel compiled for sm_90 without a GPU (Triton's bundled ptxas / nvdisasm), and the instruction
count and mix of its loops, on the CPU: the MX GEMM's decode K loop takes ~450-500 instructions per 128-column chunk
and warp with the per-row scale tiles and the PTX E2M1 decode, against 787-1379 for the gathered-scale path.

    python -m tests.support.sass_loop [mxfp4|nvfp4|mxfp8] [NAME=VALUE ...]

compiles `_mx_gemm_kernel` at the decode tile (BM 16, BN 64, 4 warps, 3 stages) with the launcher's default
constexprs on the GPU (overridden by NAME=VALUE, e.g. ROW_SCALES=False for the gathered-scale path) and prints each
loop's instruction count and top opcodes, the largest (the K loop) last."""

from __future__ import annotations

import ast
import collections
import os
import re
import subprocess
import sys
import tempfile

# integer arguments the runtime specializes as multiples of 16 (not in the kernel's do_not_specialize): the row
# strides and K, as in a call with 16-aligned shapes
_DIVISIBLE = ("stride_xm", "stride_wn", "K")


def triton_tool(name: str) -> str | None:
    """Path of a CUDA tool bundled with the Triton wheel (ptxas, nvdisasm), or None."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


def compile_sm90(fn, constexprs: dict, ptr_types: dict, num_warps: int = 4, num_stages: int = 3):
    """`fn` (a @triton.jit kernel) compiled for sm_90: constexprs by name (unnamed constexpr parameters take their
    defaults), pointer element types by name (others '*fp32'), the remaining arguments i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}

    sig = {a: "constexpr" if a in constexprs else ptr_types.get(a, "*fp32") if a.endswith("_ptr") else "i32"
           for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a.endswith("_ptr") or a in _DIVISIBLE}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                                 num_stages=num_stages))


def disassemble(kernel) -> str:
    """nvdisasm text of a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([triton_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """(start, end, instructions) of every backward branch's body, by size (largest last)."""
    ins, labels, pending = [], {}, None
    for line in sass.splitlines():
        lab = re.match(r"\s*(\.L_x_\d+):", line)
        if lab:
            pending = lab.group(1)
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            addr = int(m.group(1), 16)
            if pending:
                labels[pending], pending = addr, None
            ins.append((addr, m.group(2)))
    found = []
    for addr, text in ins:
        br = re.search(r"BRA\s.*?(\.L_x_\d+)", text)
        if br and labels.get(br.group(1), addr + 1) < addr:
            start = labels[br.group(1)]
            found.append((start, addr, [t for a, t in ins if start <= a <= addr]))
    return sorted(found, key=lambda lp: len(lp[2]))


def opcode(text: str) -> str:
    """The opcode of a SASS instruction without its predicate and modifiers."""
    return text.split()[1 if text.startswith("@") else 0].split(".")[0]


def mx_loop(kind: str, **overrides) -> list[str]:
    """The K loop's instructions of `_mx_gemm_kernel` for bf16 x MXFP4 / bf16 x NVFP4 / MXFP8 x MXFP8 at the decode
    tile, with `mx_linear`'s constexprs on a CUDA GPU unless overridden."""
    from engine.kernels import gemm_mx as GM
    from engine.kernels.decode_plan import DEFAULT_POLICY
    from engine.kernels.options import DEFAULT_OPTIONS

    consts = dict(BM=16, BN=64, X_SCALED=kind == "mxfp8", W_FP4=kind != "mxfp8", W_SB=16 if kind == "nvfp4" else 32,
                  W_E8M0=kind != "nvfp4", HAS_TS=kind == "nvfp4", USE_PART=True, HAS_BIAS=False,
                  ROW_SCALES=DEFAULT_OPTIONS.mx_row_scales,
                  FP4_PTX=DEFAULT_OPTIONS.mx_fp4_ptx,
                  FUSED_REDUCE=DEFAULT_POLICY.fused_reduce)
    consts.update(overrides)
    ptrs = {"x_ptr": "*fp8e4nv" if kind == "mxfp8" else "*bf16", "w_ptr": "*fp8e4nv" if kind == "mxfp8" else "*u8",
            "ws_ptr": "*fp8e4nv" if kind == "nvfp4" else "*u8", "out_ptr": "*bf16", "cnt_ptr": "*i32"}
    return loops(disassemble(compile_sm90(GM._mx_gemm_kernel, consts, ptrs)))[-1][2]


def main(argv: list[str]) -> int:
    kind = argv[0] if argv else "mxfp4"
    overrides = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in argv[1:])}  # True, 16, ...
    body = mx_loop(kind, **overrides)
    mix = collections.Counter(opcode(t) for t in body)
    print(f"_mx_gemm_kernel {kind} {overrides or ''}: K loop {len(body)} instructions per 128-column chunk and warp")
    print("  " + ", ".join(f"{op} {n}" for op, n in mix.most_common(16)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
