"""An inert stand-in for torchvision, installed as `torchvision/__init__.py` in the SGLang
test venv (scripts/sglang-venv.sh).

torchvision's wheels on PyPI are built against CUDA torch and fail to load beside the CPU
build; SGLang imports it only from multimodal image helpers at module level. Any
`torchvision.X.Y` imports as a module whose attributes are a class that refuses to be used,
so an image path that really runs fails loudly instead of doing something wrong.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+inert"


class _InertType(type):
    # Enum-like lookups at import time (InterpolationMode.BICUBIC as a default argument).
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Inert(metaclass=_InertType):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is an inert stand-in in this venv")

    def __class_getitem__(cls, item):
        return cls


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
