"""MaxText 0.2.5 on the lent v5e's Python 3.11 and JAX 0.10.2 (its package asks for Python
>= 3.12 and JAX >= 0.11.1): two shims loaded before MaxText by a process that has this folder
first on PYTHONPATH; no MaxText file is changed. Found by training MaxText 0.2.5 on a CPU
host with the chip's versions (2026-12-06): these are the only two things its training path
met that the older stack lacks.

- `jax.experimental.xla_metadata.must_fuse_call` (first in JAX 0.11.0), imported by
  maxtext/kernels/attention/jax_flash_attention.py:21 on every training path: a decorator
  that asks XLA to fuse a call; here it leaves the function as it is (a hint only).
- PEP 695 `type X = ...` statements (Python 3.12) in maxtext/kernels/mhc/api.py:21 and
  common.py:58, imported by every training path (train.py -> ... -> layers/mhc.py): read as
  plain assignments when the module is loaded.
"""

import importlib.abc
import importlib.machinery
import re
import sys

import jax.experimental.xla_metadata as _metadata

if not hasattr(_metadata, "must_fuse_call"):

    def must_fuse_call(name):
        def decorate(function):
            return function

        return decorate

    _metadata.must_fuse_call = must_fuse_call

_TYPE_ALIAS = re.compile(rb"^type\s+(\w+)\s*=", re.M)


class _AliasesAsAssignments(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data, path, *, _optimize=-1):
        return compile(_TYPE_ALIAS.sub(rb"\1 =", data), path, "exec", dont_inherit=True,
                       optimize=_optimize)  # fmt: skip

    def get_code(self, fullname):  # from the source every time: no cached bytecode of it
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _MaxTextAliases(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("maxtext."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, "rb") as source:
                if _TYPE_ALIAS.search(source.read()):
                    spec.loader = _AliasesAsAssignments(fullname, spec.origin)
        return spec


sys.meta_path.insert(0, _MaxTextAliases())
