"""Triton's interpreter, made cheaper to run without changing what it computes.

Three costs of triton 3.7's interpreter dominate the suite's Triton cases on a slow CI host
(cProfile of `exact_mode_cases.default_chains_equal_ar`, ~40% of its time), none of them our
kernels' arithmetic:

- `_get_np_dtype` builds a 19-entry dict of hashed dtypes on every call (~750k calls a case);
  it is a pure function of the dtype, so it is memoised.
- every launch patches `triton.language` and runs `inspect.getmembers` over four modules to
  find the builtins; the builtins are the same at every launch (the patch is undone after
  each one), so they are listed once.
- a `tl.reduce` whose combine function is not one of Triton's own falls back to a Python loop
  over every element. The serial verifier sums three products in one reduction (`_sum3`, one
  cross-warp exchange on a GPU); it is handed to numpy's sum, which adds along the axis in the
  same order as that loop (`test_fast_interpreter.py` checks the kernel's outputs are
  bit-identical either way).

`install()` is idempotent; it does nothing where the interpreter's internals are not the ones
described (another Triton), so the cases run slower there but unchanged.
"""

from __future__ import annotations

import inspect

import numpy as np

ORIGINALS: dict = {}  # what install() replaced, by name (empty until it has): for the test that compares


def install() -> None:
    if ORIGINALS:
        return
    try:
        from triton.runtime import interpreter as it
        import triton.language as tl
        from specla.ops.gdn.serial import _sum3
        get_np_dtype, patch_builtin_orig, patch_attr, apply_impl = (
            it._get_np_dtype, it._patch_builtin, it._patch_attr, it.ReduceOps.apply_impl)
    except (ImportError, AttributeError):
        return

    dtypes = {}

    def cached_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            if key not in dtypes:
                dtypes[key] = get_np_dtype(key)
            return dtypes[key]
        except TypeError:  # an unhashable dtype: as before
            return get_np_dtype(tt_dtype)

    builtins = {}  # module or class -> its builtins, listed the first time, before any launch patched it

    def patch_builtin(pkg, builder, scope):
        if pkg not in builtins:
            builtins[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, member in builtins[pkg]:
            patch_attr(pkg, name, member, builder, scope)

    def reduce(self, input):
        if self.combine_fn is _sum3:
            return [self.to_tensor(np.sum(x.handle.data, axis=self.axis, keepdims=self.keep_dims), x.dtype)
                    for x in input]
        return apply_impl(self, input)

    ORIGINALS.update(_get_np_dtype=get_np_dtype, _patch_builtin=patch_builtin_orig, apply_impl=apply_impl)
    it._get_np_dtype = cached_np_dtype
    it._patch_builtin = patch_builtin
    it.ReduceOps.apply_impl = reduce
