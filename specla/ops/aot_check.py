"""Compile every Triton kernel variant for an NVIDIA target without a GPU, and report spills.

The CPU test suite runs the kernels under Triton's interpreter, which checks their semantics
but not that they compile: this runs the real compiler (TTIR -> PTX -> ptxas cubin) for sm_90
at the paper shape, with the 16-byte pointer alignment the JIT specialises on at run time, and
reports each variant's registers and spill bytes from `ptxas -v` (any spill fails), and for the
GEMV whether every weight load is 16 bytes wide (a narrower one fails).

    python -m specla.ops.aot_check          (TRITON_INTERPRET must be unset)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

POINTERS = {
    "parents": "*i64", "chain_nodes": "*i32", "chain_len": "*i32", "light": "*i32", "n_chains": "*i32",
    "flags": "*i32", "counters": "*i32", "table": "*i32", "path_len": "*i32", "n_leaves": "*i32", "cand_i": "*i32", "tok": "*i64", "beams": "*i64",
    "next_tok": "*i64", "next_src": "*i64", "prev_rows": "*u8", "next_rows": "*u8",
    "plen": "*i64", "valid": "*i64", "path": "*i64", "length": "*i64", "tokens": "*i64", "target": "*i64",
    "last": "*i64", "root": "*i64", "depth": "*i64", "out_tok": "*i64", "out_par": "*i64", "slots": "*i32",
    "allowed": "*u8", "x": "*bf16", "norm_w": "*bf16", "res": "*bf16", "emb_table": "*bf16", "h": "*bf16", "src": "*i64",
    "norm_emb": "*bf16", "norm_feat": "*bf16", "conv_state": "*bf16", "weight": "*bf16", "y": "*bf16", "a": "*bf16", "bb": "*bf16", "z": "*bf16",
}
ALIGNED = ("n_in",)
SCALARS = {"scale": "fp32", "n": "i32", "P": "i32", "C": "i32", "n_tiles": "i32", "n_out": "i32", "n_in": "i32",
           "n_rows": "i32", "eps": "fp32", "V": "i32", "NC": "i32", "s_row": "i32", "nb": "i32", "W": "i32", "NS": "i32",
           "M": "i32", "s_depth": "i32", "tau": "fp32", "D": "i32", "E": "i32", "start": "i32", "s_rb": "i32"}


def variants(H=8, HV=8, K=256, V=256):
    """(name, kernel, constexprs, num_warps[, extra]) for every variant the dispatch and benchmarks
    use; extra: {"types": argument types overriding `_gdn_type`'s, "options": compile options}."""
    from specla.ops.accept import triton as accept
    from specla.ops.attention import triton as attention
    from specla.ops.beam import triton as beam
    from specla.ops.conv import triton as conv
    from specla.ops.gdn import closure, commit, parallel, serial
    from specla.ops.linear import triton as linear
    from specla.ops.norm import triton as norm
    from specla.ops.tree import triton as tree_ops

    for BV, warps in ((8, 1), (8, 2), (8, 4), (16, 4), (16, 8), (32, 8)):
        for tree, hybrid, paths, pending, final in (
                (False, False, False, False, False), (False, False, False, True, False), (False, False, False, False, True),
                (True, False, False, True, False), (True, True, False, True, False), (True, True, False, False, False),
                (False, False, True, True, False)):
            kind = "paths" if paths else "hybrid" if hybrid else "tree" if tree else "sequence" if final else "chain"
            # pending rows unrolled: an 8-draft chain's or tree's buffer (9), and 16
            for PP in (9, 16) if pending else (1,):
                yield (f"verify[{kind}{f'+pending{PP}' if pending else ''}] BV={BV} w={warps}", serial.tree_verify_kernel,
                       dict(H=H, HV=HV, K=K, V=V, BK=K, BV=BV, NV=V // BV, NP=64, PP=PP, TREE=tree, HYBRID=hybrid,
                            PATHS=paths, HAS_PENDING=pending, STORE_U=not final, WRITE_FINAL=final,
                            HAS_VALID=paths or not tree and not hybrid and not final, PDL=not hybrid,
                            EARLY=8), warps)
    for NT, (BV, KW, BKC, warps, solve_warps) in list(parallel.TILINGS.items()) + list(parallel.SWEEP):
        tiling = f"NT={NT} BV={BV} KW={KW} BK={BKC}"
        for pending in (False, True):
            yield (f"parallel products{'+pending' if pending else ''} {tiling} w={warps}", parallel._products_kernel,
                   dict(H=H, HV=HV, K=K, V=V, BKC=BKC, KW=KW, BV=BV, NV=V // BV, NKS=K // KW, NT=NT, PD=16,
                        HAS_PENDING=pending, PREC="tf32x3"), warps)
        yield (f"parallel solve {tiling} w={solve_warps}", parallel._solve_kernel,
               dict(H=H, HV=HV, V=V, BV=BV, NV=V // BV, NKS=K // KW, NT=NT, HAS_VALID=True), solve_warps)
    for BV in (16, 32):
        yield (f"commit BV={BV}", commit._commit_kernel,
               dict(H=H, HV=HV, K=K, V=V, BK=K, BV=BV, NV=V // BV, PP=16), 4)
    for NP in (16, 64):
        yield f"tree_conv NP={NP}", conv._tree_conv_kernel, dict(W=4, NP=NP, BC=2048 // NP, HAS_BIAS=False), 4
    yield "conv_commit", conv._conv_commit_kernel, dict(W=4, WP=4, BC=128), 4
    yield "step_conv", conv._step_conv_kernel, dict(W=4, WP=4, BC=128, HAS_BIAS=False), 4
    yield ("step_prelude", conv._step_prelude_kernel,
           dict(H=H, HV=HV, K=K, V=V, W=4, WP=4, BK=K, BV=V, HAS_BIAS=False, NEG=False), 4)
    NB, warps = conv.TREE_PRELUDE_TILING
    yield (f"tree_prelude NB={NB}", conv._tree_prelude_kernel,
           dict(H=H, HV=HV, K=K, V=V, W=4, NB=NB, BK=K, BV=V, HAS_BIAS=False, NEG=False), warps)
    yield ("gated_rms_norm", norm._gated_rms_norm_kernel, dict(HV=HV, V=V, BV=V, HAS_Z=True, SIGMOID=False), 4)
    # a rollout depth of 4 beams over a 32k vocabulary (the 1.3B shape's), top-4
    yield "ancestor closure", closure._closure_kernel, dict(NP=32, STEPS=4), 4
    yield "path tables", closure._paths_kernel, dict(NP=32, TS=32, STEPS=5, HAS_VALID=True), 4
    yield "greedy walk", accept._walk_kernel, dict(NP=32, HAS_VALID=True), 1
    yield "tree build (top-4, depth 8)", tree_ops._build_kernel, dict(NP=128, HAS_TAU=True), 4
    yield "beam_expand chunk", beam._chunk_kernel, dict(K=4, BLOCK=beam.CHUNK), 4
    yield ("beam_expand merge", beam._merge_kernel,
           dict(K=4, KP=4, NB=4, NCP=32, NCK=128, NEXT=False, HAS_BS=True, ROWS=False, HAS_ROWS=False, EP=16), 4)
    # a tree depth from the demo drafter's hidden states (256 wide): norm, head, chunk reductions
    for fp32 in (True, False):
        yield (f"head_expand chunk D=256 fp32_dot={fp32}", beam._head_chunk_kernel,
               dict(K=4, NB=16, BLOCK=beam.HEAD_CHUNK, BD=256, PREC="tf32", FP32_DOT=fp32), beam.HEAD_WARPS)
    for nb in (1, 4):  # the root's depth (no beam scores) and a later one
        yield (f"head_expand merge V=8192 nb={nb}", beam._merge_kernel,
               dict(K=4, KP=4, NB=nb, NCP=128, NCK=512, NEXT=True, HAS_BS=nb > 1, ROWS=True, HAS_ROWS=nb > 1, EP=32),
               beam.merge_warps(nb, 128, 4))
    for V, warps in ((8192, 8), (beam.ROW_MAX, 16)):  # one beam's whole row: the demo's and the largest vocabulary
        yield f"beam_expand row V={V}", beam._row_kernel, dict(K=4, BLOCK=V), warps
    # a draft step's attention at the demo drafter's heads (64 dims) and the 1.3B stand-in's (128)
    for D in (64, 128):
        BW = attention.block_slots(D)
        for final in (True, False):
            yield (f"masked_attention D={D}{'' if final else ' (split)'}", attention._partial_kernel,
                   dict(H=16, D=D, BD=D, SPLIT=BW, BW=BW, FINAL=final), attention.block_warps(BW))
    yield "masked_attention combine", attention._combine_kernel, dict(H=16, D=128, BD=128, NSP=16), 4
    # the draft step's whole attention (RoPE, cache writes, the mask from the entries' rows) at
    # the demo drafter's heads (4 x 64) and the 1.3B stand-in's (16 x 128), bf16 and fp32 caches
    for dt in ("bf16", "fp32"):
        types = {**{a: f"*{dt}" for a in ("q", "k", "v", "keys", "values", "o")},
                 "rows": "*u8", "depth": "i32", "start": "i32"}
        for H, D in ((4, 64), (16, 128)):
            BW = attention.block_slots(D)
            for final in (True, False):
                for chain in (True, False):
                    yield (f"draft_attention {dt} D={D}{' chain' if chain else ' tree'}{'' if final else ' (split)'}",
                           attention._draft_kernel, dict(H=H, D=D, BD=D, R=D // 2, SPLIT=BW, BW=BW, FINAL=final,
                                                         CHAIN=chain), attention.block_warps(BW),
                           dict(types=types, options=dict(enable_fp_fusion=False)))
    for BN, BK, warps in linear.TILINGS:
        yield f"gemv BN={BN} BK={BK} w={warps}", linear._gemv_kernel, dict(BN=BN, BK=BK), warps
    # a draft step's fused matmuls at the demo drafter's shapes (1 row: chains, 4: tree beams)
    for M in (1, 4):
        for name, N, K, flags in (("norm+qkv", 768, 256, dict(NORM=True)), ("o_proj+res", 256, 256, dict(RES=True)),
                                  ("norm+gate|up+glu", 768, 256, dict(NORM=True, GLU=True)),
                                  ("down+res", 256, 768, dict(RES=True)), ("norm+lm_head", 8192, 256, dict(NORM=True))):
            BM, BN, BK, warps = linear.fused_tiling(M, N, K, flags.get("GLU", False))
            yield (f"fused {name} M={M}", linear._fused_kernel,
                   dict(BM=BM, BN=BN, BK=BK, **{"NORM": False, "GLU": False, "RES": False, **flags}), warps)
        BM, BN, BK, warps = linear.fused_tiling(M, 256, 512)
        yield f"draft_inputs M={M}", linear._draft_inputs_kernel, dict(BM=BM, BN=BN, BD=BK // 2), warps
    for BM, BN, BK, warps in linear.SKINNY_TILINGS:
        yield (f"gemv-skinny BM={BM} BN={BN} BK={BK} w={warps}", linear._skinny_kernel,
               dict(BM=BM, BN=BN, BK=BK, PREC="tf32"), warps)


def _gdn_type(arg: str) -> str:
    return "i32" if arg.startswith("s_") else SCALARS.get(arg, POINTERS.get(arg, "*fp32"))


def compile_variant(kernel, consts, num_warps, arch=90, type_of=_gdn_type, options=None):
    """Compile one variant for sm_`arch` (TTIR -> PTX -> ptxas); returns (compiled kernel,
    ptxas -v summary dict). type_of(arg) gives each non-constexpr argument's Triton type;
    options: compile options beside num_warps (as the launch passes them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    names = kernel.arg_names
    if "PDL" in names:  # the form a Hopper launches (ops.pdl), unless the variant says
        consts = {"PDL": True, **consts}
        options = {"launch_pdl": consts["PDL"], **(options or {})}
    sig = {a: "constexpr" if a in consts else type_of(a) for a in names}
    # pointers, and the sizes the JIT specialises on (a multiple of 16 at the paper shape)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if sig[a].startswith("*") or a in ALIGNED}
    compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, **(options or {})})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        fmad = [] if (options or {}).get("enable_fp_fusion", True) else ["--fmad=false"]  # as Triton calls ptxas
        log = subprocess.run([get_ptxas(arch).path, "-v", *fmad, f"-arch=sm_{arch}a", ptx, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return compiled, {"registers": regs, "spill_bytes": spills}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    failed = False
    for name, kernel, consts, warps, *extra in variants():
        extra = extra[0] if extra else {}
        types = extra.get("types", {})
        compiled, info = compile_variant(kernel, consts, warps, type_of=lambda a: types.get(a) or _gdn_type(a),
                                         options=extra.get("options"))
        note = ""
        if name.startswith("gemv"):  # a streaming kernel: its weight loads must be 16 bytes wide
            ptx = compiled.asm["ptx"]
            narrow = [ld for ld in re.findall(r"ld\.global\S*evict_first\S*", ptx) if ".v4." not in ld]
            narrow += [n for n in re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx)
                       if int(n, 0) != 16]
            note = f"  narrow weight loads {len(narrow)}"
            failed |= bool(narrow)
        print(f"{name:48s} registers {info['registers']:3d}  spill bytes {info['spill_bytes']}{note}")
        failed |= info["spill_bytes"] > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
