"""The shadow-only AST rewrite that keeps lazy values lazy.

Python computes f-strings with ``format()`` and ``%`` with ``str.__mod__``: both must return
real strings, so a lazy value inside would be forced on the spot, and ``g(f"refine: {a}")`` in a
loop would wait for ``a`` before every launch. In shadow mode only, this rewrite routes the
operations that can be deferred through the ``_lz_*_`` helpers of :mod:`.lazy`:

* f-strings                    -> ``_lz_fstring_(literal, (value, conversion, spec), ...)``
* ``a <op> b``                 -> ``_lz_binop_("<op>", a, b)``
* ``-a``, ``+a``, ``~a``       -> ``_lz_unary_("<op>", a)`` (``not a`` is a truth test: kept)
* ``a < b``                    -> ``_lz_compare_(a, "<", b)``
* ``a < b < c``                -> ``_lz_compare_chain_(a, "<", lambda: b, "<", lambda: c)``
* calls of a few pure builtins and methods (``len``, ``str``, ``sorted``, ``json.dumps``,
  ``sep.join``, ...)           -> ``_lz_call_(function, *args, **kwargs)``

Without lazy values every helper computes exactly what the original expression computes.

The rewrite runs *after* RestrictedPython's own transformer, on the tree it produced, so the
helper names (which start with ``_`` and would be rejected in user code) are never checked, and
user code still cannot name them. Use :func:`shadow_policy` to get a RestrictedPython policy
class, or :func:`compile_shadow` to compile in one step.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

from RestrictedPython import (
    RestrictingNodeTransformer,
    compile_restricted_eval,
    compile_restricted_exec,
    compile_restricted_single,
)
from RestrictedPython.compile import CompileResult

from .lazy import PURE_METHOD_NAMES

__all__ = [
    "HELPER_NAMES",
    "PURE_FUNCTION_NAMES",
    "LazyDeferralTransformer",
    "compile_shadow",
    "shadow_policy",
    "transform_tree",
]

HELPER_NAMES = (
    "_lz_binop_", "_lz_unary_", "_lz_compare_", "_lz_compare_chain_", "_lz_fstring_", "_lz_call_",
)

_BINOP_SYMBOLS: dict[type[ast.operator], str] = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.MatMult: "@", ast.Div: "/",
    ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>",
    ast.BitAnd: "&", ast.BitXor: "^", ast.BitOr: "|",
}
_UNARY_SYMBOLS: dict[type[ast.unaryop], str] = {ast.USub: "-", ast.UAdd: "+", ast.Invert: "~"}
_COMPARE_SYMBOLS: dict[type[ast.cmpop], str] = {
    ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
    ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in",
}

# Calls by plain name that are deferred when an argument is lazy (the helper re-checks at run
# time that the name still means the builtin).
PURE_FUNCTION_NAMES = frozenset({
    "len", "str", "int", "float", "sorted", "sum", "min", "max", "round", "abs", "repr",
    "list", "tuple", "dict", "set", "frozenset", "bool", "divmod", "pow",
})
# Chain operands that a ``lambda`` cannot hold without changing meaning.
_NOT_IN_LAMBDA = (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)


def _helper_call(name: str, args: list[ast.expr], like: ast.AST,
                 keywords: list[ast.keyword] | None = None) -> ast.Call:
    call = ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=args, keywords=keywords or [])
    return ast.copy_location(call, like)


def _thunk(expr: ast.expr) -> ast.Lambda:
    empty = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[],
                          kwarg=None, defaults=[])
    return ast.copy_location(ast.Lambda(args=empty, body=expr), expr)


class LazyDeferralTransformer(ast.NodeTransformer):
    """Rewrites deferrable expressions into ``_lz_*_`` helper calls (see the module docstring).

    Annotations are left alone (they are not values the program computes with).
    """

    def __init__(self) -> None:
        self._scopes: list[str] = ["module"]

    # -- scopes: a lambda in a class body cannot see the class's names -------------------------
    def _visit_in_scope(self, node: ast.AST, kind: str, fields: tuple[str, ...]) -> ast.AST:
        self._scopes.append(kind)
        try:
            for field in fields:
                value = getattr(node, field, None)
                if isinstance(value, list):
                    setattr(node, field, self._visit_list(value))
                elif isinstance(value, ast.AST):
                    setattr(node, field, self.visit(value))
        finally:
            self._scopes.pop()
        return node

    def _visit_list(self, items: list[Any]) -> list[Any]:
        result: list[Any] = []
        for item in items:
            if not isinstance(item, ast.AST):
                result.append(item)
                continue
            new = self.visit(item)
            if new is None:
                continue
            result.extend(new if isinstance(new, list) else [new])
        return result

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        node.decorator_list = self._visit_list(node.decorator_list)
        node.args = self._visit_arguments(node.args)
        return self._visit_in_scope(node, "function", ("body",))

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def _visit_arguments(self, args: ast.arguments) -> ast.arguments:
        args.defaults = self._visit_list(args.defaults)
        args.kw_defaults = [None if d is None else self.visit(d) for d in args.kw_defaults]
        return args

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        node.args = self._visit_arguments(node.args)
        return self._visit_in_scope(node, "function", ("body",))

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        node.decorator_list = self._visit_list(node.decorator_list)
        node.bases = self._visit_list(node.bases)
        node.keywords = self._visit_list(node.keywords)
        return self._visit_in_scope(node, "class", ("body",))

    def _visit_comprehension(
        self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp
    ) -> ast.AST:
        # The first iterable is evaluated in the enclosing scope, the rest in the comprehension's.
        first = node.generators[0]
        first.iter = self.visit(first.iter)
        self._scopes.append("function")
        try:
            first.target = self.visit(first.target)
            first.ifs = self._visit_list(first.ifs)
            for generator in node.generators[1:]:
                self.generic_visit(generator)
            for field in ("elt", "key", "value"):
                if hasattr(node, field):
                    setattr(node, field, self.visit(getattr(node, field)))
        finally:
            self._scopes.pop()
        return node

    visit_ListComp = _visit_comprehension
    visit_SetComp = _visit_comprehension
    visit_DictComp = _visit_comprehension
    visit_GeneratorExp = _visit_comprehension

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        node.target = self.visit(node.target)
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def visit_match_case(self, node: ast.match_case) -> ast.AST:
        # Patterns must stay literal (``case -1:`` is not an expression to rewrite).
        if node.guard is not None:
            node.guard = self.visit(node.guard)
        node.body = self._visit_list(node.body)
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return node

    # -- the rewrites ---------------------------------------------------------------------------
    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        symbol = _BINOP_SYMBOLS[type(node.op)]
        return _helper_call("_lz_binop_", [ast.Constant(symbol), node.left, node.right], node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        symbol = _UNARY_SYMBOLS.get(type(node.op))
        if symbol is None:  # ``not``: a truth test, forcing is right
            return node
        if isinstance(node.operand, ast.Constant):  # ``-0.5``: a literal, never lazy
            return node
        return _helper_call("_lz_unary_", [ast.Constant(symbol), node.operand], node)

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        symbols = [_COMPARE_SYMBOLS[type(op)] for op in node.ops]
        if len(symbols) == 1:
            return _helper_call("_lz_compare_", [node.left, ast.Constant(symbols[0]),
                                                 node.comparators[0]], node)
        if self._scopes[-1] == "class" or any(
            _cannot_move_into_lambda(inner)
            for operand in node.comparators for inner in ast.walk(operand)
        ):
            return node
        args: list[ast.expr] = [node.left]
        for symbol, operand in zip(symbols, node.comparators):
            args.extend([ast.Constant(symbol), _thunk(operand)])
        return _helper_call("_lz_compare_chain_", args, node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        parts: list[ast.expr] = []
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                spec: ast.expr = ast.Constant(None)
                if value.format_spec is not None:
                    spec = self.visit(value.format_spec)
                elements = [self.visit(value.value), ast.Constant(value.conversion), spec]
                field = ast.Tuple(elts=elements, ctx=ast.Load())
                parts.append(ast.copy_location(field, value))
            else:
                parts.append(value)
        return _helper_call("_lz_fstring_", parts, node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        has_star = any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords)
        if has_star or not _is_pure_call_target(node.func):
            return node
        return _helper_call("_lz_call_", [node.func, *node.args], node, node.keywords)


def _cannot_move_into_lambda(node: ast.AST) -> bool:
    """Expressions whose meaning changes inside a ``lambda`` (binding, suspending, ``super()``)."""
    return isinstance(node, _NOT_IN_LAMBDA) or (isinstance(node, ast.Name) and node.id == "super")


def _is_pure_call_target(func: ast.expr) -> bool:
    """``len(...)``, ``x.join(...)`` or RestrictedPython's ``_getattr_(x, "join")(...)``."""
    if isinstance(func, ast.Name):
        return func.id in PURE_FUNCTION_NAMES
    if isinstance(func, ast.Attribute):
        return func.attr in PURE_METHOD_NAMES
    if (isinstance(func, ast.Call) and isinstance(func.func, ast.Name)
            and func.func.id == "_getattr_" and len(func.args) == 2 and not func.keywords):
        name = func.args[1]
        return isinstance(name, ast.Constant) and name.value in PURE_METHOD_NAMES
    return False


def transform_tree(tree: ast.AST) -> ast.AST:
    """Apply the shadow rewrite to ``tree`` in place (and return it), filling in locations.

    Meant for a tree RestrictedPython has already transformed (or plain, unrestricted code).
    """
    LazyDeferralTransformer().visit(tree)
    ast.fix_missing_locations(tree)
    return tree


class _ShadowPolicyMixin:
    """Runs RestrictedPython's checks and rewrites first, then the shadow rewrite."""

    errors: list[str]

    def visit(self, node: ast.AST) -> Any:
        result = super().visit(node)  # type: ignore[misc]
        if isinstance(node, (ast.Module, ast.Expression, ast.Interactive)) and not self.errors:
            transform_tree(node)
        return result


@functools.cache
def shadow_policy(base: type[RestrictingNodeTransformer] = RestrictingNodeTransformer
                  ) -> type[RestrictingNodeTransformer]:
    """A RestrictedPython policy class: ``base``'s checks and rewrites, then the shadow rewrite.

    Pass it as ``policy=`` to ``compile_restricted*``; the result needs the helpers from
    :func:`agentrt.interpreter.lazy.shadow_helpers` in the globals it runs with.
    """
    return type(f"Shadow{base.__name__}", (_ShadowPolicyMixin, base), {})


def compile_shadow(source: str | ast.Module, filename: str = "<shadow>", mode: str = "exec",
                   policy: type[RestrictingNodeTransformer] = RestrictingNodeTransformer
                   ) -> CompileResult:
    """Compile ``source`` like ``compile_restricted_*`` with ``policy``, plus the shadow rewrite.

    Returns RestrictedPython's ``CompileResult`` (``code`` is None when ``errors`` is not empty).
    """
    compilers = {"exec": compile_restricted_exec, "eval": compile_restricted_eval,
                 "single": compile_restricted_single}
    if mode not in compilers:
        raise ValueError(f"mode must be 'exec', 'eval' or 'single', not {mode!r}")
    return compilers[mode](source, filename=filename, policy=shadow_policy(policy))
