"""The shape of the house: jattn's import graph has no circle and no import up a floor,
and a call traces a user's mask_mod no more often than it must.

The import graph is read from the source (``ast``: every ``import`` of a jattn module,
lazy ones inside functions included), so it needs no import of jattn itself.
"""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest
from _counting import counted_mask_mod

import jattn

PACKAGE = pathlib.Path(jattn.__file__).parent

# The floors of the house (docs/development.md): data flows down, never back up. A module
# may import modules of its own floor (the graph has no circle) or of a lower one. The
# first name that a module's dotted name starts with decides its floor.
FLOORS = [
    ("jattn._util", "jattn._call", "jattn._prng", "jattn._checks", "jattn.book",
     "jattn.causality", "jattn.viz", "jattn.rope", "jattn.convert"),
    ("jattn.masks", "jattn.mods", "jattn.block_masks"),
    ("jattn.dense", "jattn.blockwise", "jattn.kernels", "jattn.ring", "jattn._per_device"),
    ("jattn._routing",),
    ("jattn.functional",),
    ("jattn._fused_cache", "jattn.kvcache", "jattn.paged", "jattn.packing", "jattn.generate"),
    ("jattn._module_utils", "jattn.linen", "jattn.nnx"),
    ("jattn.models", "jattn.toy"),
    ("jattn",),
]  # fmt: skip


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: the jattn modules it imports}`` (a package's ``__init__`` is the package)."""
    modules = _modules()

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names if a.name.startswith("jattn")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, level - 1 floors up
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                if base.startswith("jattn"):
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        targets.add(full if full in modules else known(base))
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor(module: str) -> int:
    best, level = -1, None
    for number, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), number
    assert level is not None, f"{module} is on no floor: add it to FLOORS"
    return level


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if floor(b) > floor(a))


def test_the_graph_sees_the_known_edges():
    """The reader finds plain, aliased, relative and lazy imports (so an empty answer below
    means something)."""
    graph = import_graph()
    assert "jattn.blockwise" in graph["jattn._routing"]
    assert "jattn.blockwise._passes" in graph["jattn.blockwise._layout"]
    assert "jattn.kernels.cudnn" in graph["jattn.kernels"]  # lazy, inside adapter()
    assert "jattn._util" in graph["jattn.dense"]


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_no_import_up_a_floor():
    graph = import_graph()
    assert [floor(m) for m in graph]  # every module has a floor
    assert upward_imports(graph) == []


def test_a_circle_and_an_upward_import_are_found():
    graph = {"jattn._checks": {"jattn.block_masks"}, "jattn.block_masks": {"jattn._checks"}}
    assert cycles(graph) == [["jattn._checks", "jattn.block_masks"]]
    assert upward_imports(graph) == [("jattn._checks", "jattn.block_masks")]


# ----------------------------------------------------------------------------------------
# How often one call traces a user's mask_mod
# ----------------------------------------------------------------------------------------


def _traces(implementation: str, grad: bool, **kwargs) -> int:
    mask_mod, traced = counted_mask_mod()
    q = jnp.ones((1, 300, 2, 8), jnp.float32)

    def f(q):
        out = jattn.dot_product_attention(
            q, q, q, mask_mod=mask_mod, implementation=implementation, **kwargs
        )
        return out.sum()

    jax.block_until_ready(jax.jit(jax.grad(f) if grad else f)(q))
    return len(traced)


@pytest.mark.parametrize("grad", [False, True])
def test_blockwise_traces_the_mask_mod_as_often_as_dense(grad):
    """The entry checks the mask_mod (abstract traces), then a path needs it once: dense to
    evaluate it, blockwise to hoist it (its tile states and tiles, forward and backward,
    reuse that trace). Before issue 24 one jitted blockwise call traced it 6 times."""
    dense = _traces("dense", grad)
    assert _traces("blockwise", grad) == dense
    assert dense == 3  # the entry's two checks (the call's shape, a one-pair tile) + one


def _block_mask_call_traces(implementation: str) -> int:
    """Traces of the mask_mod in one jitted call given a block mask (not in building it)."""
    mask_mod, traced = counted_mask_mod()
    # 64 divides every tile the rule picks at 300 tokens: the block mask's states fit.
    block = jattn.block_mask(mask_mod, q_len=300, block_q=64, block_k=64)
    built = len(traced)
    q = jnp.ones((1, 300, 2, 8), jnp.float32)

    def call(q):
        return jattn.dot_product_attention(q, q, q, block_mask=block, implementation=implementation)

    jax.block_until_ready(jax.jit(call)(q))
    return len(traced) - built


def test_a_block_mask_spares_the_blockwise_call_its_evaluation():
    """Given a block mask that fits its tiles, the blockwise call only hoists the mask_mod
    (its tile states are the block mask's); the dense path evaluates it."""
    assert _block_mask_call_traces("blockwise") + 1 == _block_mask_call_traces("dense")


# ----------------------------------------------------------------------------------------
# A BlockMask checks itself where it is built
# ----------------------------------------------------------------------------------------


def test_a_block_mask_checks_itself_when_built():
    mod = jattn.mods.causal()
    good = jattn.block_mask(mod, q_len=20, block_q=8, block_k=8)  # 3 x 3 tiles
    assert good.state.shape == (1, 1, 3, 3)
    with pytest.raises(ValueError, match=r"state must be \[B\|1, H\|1, 3, 3\]"):
        jattn.BlockMask(good.state[..., :2], mod, 20, 20, 8, 8)
    with pytest.raises(TypeError, match="state must be int8"):
        jattn.BlockMask(good.state.astype(jnp.int32), mod, 20, 20, 8, 8)
    with pytest.raises(ValueError, match="block_q"):
        jattn.BlockMask(good.state, mod, 20, 20, 0, 8)
    with pytest.raises(TypeError, match="mask_mod must be the mask_mod"):
        jattn.BlockMask(good.state, None, 20, 20, 8, 8)
    # A pytree round trip (jit, tree_map with placeholders) rebuilds it without checks.
    leaves, tree = jax.tree.flatten(good)
    assert jax.tree.unflatten(tree, [None] * len(leaves)).state is None
    assert jax.jit(lambda bm: bm)(good).state.shape == (1, 1, 3, 3)
