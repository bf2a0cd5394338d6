"""Every op of the API, one module per op family.

Each module declares its ops with :func:`deepinfer.kernels.registry.op` and lists them in
``__all__``; this package imports every module found here, so adding an op family is adding a
file.
"""

import importlib
import pkgutil

__all__: list[str] = []

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _name in getattr(_module, "__all__", ()):
        globals()[_name] = getattr(_module, _name)
        __all__.append(_name)
