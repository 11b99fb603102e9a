"""PTX templates, `<kernel>.ptx`: literal `.target sm_20` PTX with `${NAME}` placeholders for
constants; beside a template, `<kernel>.py` declares its parameters (PARAMS: names, types,
allowed values). Rendered, validated and loaded by fermijit/jit (ptx.py, gpu.py), launched by
the ops' `gpu` functions. Imports nothing.
"""
