"""Every tensor handed to a collective lives on the group's device, control tensors too (issue 33 item 1).

A tensor made without ``device=`` is on the CPU; on a group whose backend is NCCL alone, a collective on it
fails ("No backend type associated with device type cpu"), and on gloo every tensor is on the CPU, so a
multi-rank test on CPU never sees it. Two checks find such a tensor here:

- statically, over zerorun/: in each function, a tensor constructor without ``device=`` whose value reaches
  the arguments of a collective call (through assignments in that function; ``.to(...)`` moves it);
- dynamically, in the spawned runs of tests/test_program_order.py (collective_devices.py's ``DeviceCheck``).
"""

from __future__ import annotations

import ast
import os
import textwrap

import pytest

import zerorun

CONSTRUCTORS = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
                "eye", "linspace"}
COLLECTIVES = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all_single", "all_to_all",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single",
               "_all_gather", "_reduce_scatter", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv"}


def _is_host_constructor(node: ast.AST) -> bool:
    """``torch.zeros(...)`` and its kin called without ``device=`` (or with ``device=None``)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CONSTRUCTORS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
        return False
    device = next((k.value for k in node.keywords if k.arg == "device"), None)
    return device is None or (isinstance(device, ast.Constant) and device.value is None)


def _reaches(node: ast.AST, host: set[str]) -> bool:
    """Whether ``node``'s value may be a host tensor: it contains a host constructor or a name in ``host``,
    outside a ``.to(...)`` / ``.cuda(...)`` call (which moves its operand)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "cuda") \
            and (node.args or node.keywords):
        return False
    if _is_host_constructor(node) or (isinstance(node, ast.Name) and node.id in host):
        return True
    return any(_reaches(child, host) for child in ast.iter_child_nodes(node))


def _targets(node: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]


def _collective_name(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name if name in COLLECTIVES else None


def host_tensors_in_collectives(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: collective(...)`` for each collective call of ``source`` whose arguments may be a tensor
    made without ``device=`` in the same function."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        host: set[str] = set()
        assigns = [n for n in ast.walk(func) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                   and n.value is not None]
        for _ in range(3):  # names assigned from host tensors, to a fixed point (loops assign out of line order)
            for a in assigns:
                if _reaches(a.value, host):
                    for t in (a.targets if isinstance(a, ast.Assign) else [a.target]):
                        host.update(_targets(t))
        for call in ast.walk(func):
            if isinstance(call, ast.Call) and _collective_name(call):
                if any(_reaches(arg, host) for arg in call.args + [k.value for k in call.keywords]):
                    found.append(f"{filename}:{call.lineno}: {_collective_name(call)}(...) in {func.name}()")
    return sorted(set(found))


def test_no_tensor_without_a_device_reaches_a_collective():
    root = os.path.dirname(os.path.abspath(zerorun.__file__))
    found = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    found += host_tensors_in_collectives(f.read(), os.path.relpath(path, os.path.dirname(root)))
    assert not found, "tensors made without device= reach collectives:\n" + "\n".join(found)


# stage3_checks.py's check_backward_units before b9c6282: the unit marks of item 1, made on the CPU
OLD_MARKS = '''
def check_backward_units(engine, loss):
    marks = torch.tensor([any(n in found for n in nodes) for nodes in recorded], dtype=torch.int32)
    if engine.world_size > 1:
        engine.comm.wait([engine.comm.all_reduce(marks, control=True)])
'''


@pytest.mark.parametrize("source,expected", [
    (OLD_MARKS, ["<source>:5: all_reduce(...) in check_backward_units()"]),
    # through an expression and a second name, passed by keyword
    ("def f(c, sq):\n    v = torch.cat([sq, torch.zeros(2)])\n    w = v * 2\n    c.broadcast(tensor=w)\n",
     ["<source>:4: broadcast(...) in f()"]),
    ("def f(g):\n    dist.all_reduce(torch.ones(3, device=None), group=g)\n", ["<source>:2: all_reduce(...) in f()"]),
    # on a device, or moved there, or not a collective: nothing to find
    ("def f(c, d):\n    m = torch.tensor([1], device=d)\n    c.all_reduce(m)\n", []),
    ("def f(c, d):\n    m = torch.tensor([1]).to(d)\n    c.all_reduce(m)\n", []),
    ("def f(c, x):\n    m = torch.zeros(3)\n    c.all_reduce(x)\n    return m\n", []),
])
def test_the_static_check_finds_host_tensors(source, expected):
    assert host_tensors_in_collectives(textwrap.dedent(source)) == expected
