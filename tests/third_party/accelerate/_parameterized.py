"""A stand-in for ``parameterized.parameterized_class``, installed as the ``parameterized`` module by
conftest.py only when the real package is missing (the copied test file imports it; it is not one of
fastckpt's test dependencies). It does what parameterized 0.9 does for the one call the file makes:
``parameterized_class(attrs, values, class_name_func=...)`` makes one subclass per row, with the
attributes set and the name ``class_name_func(cls, index, params)``, in the decorated class's module,
and takes the test methods off the base class so that it is not collected itself."""
import inspect


def parameterized_class(attrs, input_values=None, class_name_func=None):
    if isinstance(attrs, str):
        attrs = (attrs,)
    rows = [dict(zip(attrs, row if isinstance(row, (list, tuple)) else (row,))) for row in input_values]

    def decorator(base):
        module = inspect.getmodule(base) or __import__(base.__module__)
        for i, params in enumerate(rows):
            name = class_name_func(base, i, params) if class_name_func else f"{base.__name__}_{i}"
            setattr(module, name, type(name, (base,), {**vars(base), **params}))  # the methods copied, as parameterized does
        for key in list(vars(base)):
            if key.startswith("test"):
                setattr(base, key, None)
        return base
    return decorator
