"""The doors: a rewrite of a cell's tree, after RestrictedPython's, that sends every value cell
code can bind through admission (admission.py).

What RestrictedPython already routes through a guard, the guards admit: attribute reads
(``_getattr_``), subscripts (``_getitem_``), iteration and unpacking (``_getiter_``), calls with
``*``/``**`` (``_apply_``), ``x op= y`` (``_inplacevar_``). This rewrite adds the rest:

* the result of every other call, and of every operator (``a + b``, ``-a``, ``a < b``):
  ``_admit_(...)`` around it (not around a value a statement drops, nor around ``in``,
  ``is`` and ``not``, which are bools);
* what a generator is sent (``yield``, ``yield from``): ``_admit_(...)`` around it;
* the parameters of every function and lambda the cell defines, whoever calls it (a stdlib
  callback, a comparison, ``__set_name__``...): admitted on entry (``*args`` item by item,
  ``**kwargs`` value by value);
* what ``with ... as target`` binds: ``with _enter_(manager) as target``, whose
  ``__enter__`` admits the manager's before anything is bound;
* what a decorator returns: ``@_decorate_(d)`` admits ``d(f)``;
* what ``except ... as name`` binds: ``name = _admit_exception_(name)`` first thing in the
  handler (stdlib code raises exceptions of classes no facade shows, ``io.UnsupportedOperation``
  for one: the cell holds one of the nearest class it may hold instead).

Names the cell binds otherwise come from what it already holds (displays, comprehensions over
admitted iterations) or from the sandbox itself (imports give module facades, class statements
the vetted class builder).
"""

from __future__ import annotations

import ast

ADMIT = "_admit_"
ADMIT_ALL = "_admit_all_"
ADMIT_KEYWORDS = "_admit_keywords_"
DECORATE = "_decorate_"
ENTER = "_enter_"
ADMIT_EXCEPTION = "_admit_exception_"

_BOOL_COMPARISONS = (ast.In, ast.NotIn, ast.Is, ast.IsNot)

HOOKS = frozenset({
    "_getattr_", "_getitem_", "_write_", "_getiter_", "_inplacevar_", "_apply_", "_print_",
    "_unpack_sequence_", "_iter_unpack_sequence_", ADMIT, ADMIT_ALL, ADMIT_KEYWORDS, DECORATE,
    ENTER, ADMIT_EXCEPTION,
})
"""Functions of the sandbox the compiled code calls: they admit what they return themselves."""


def _call(name: str, value: ast.expr) -> ast.Call:
    return ast.copy_location(
        ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=[value], keywords=[]), value)


def _is_hook_call(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in HOOKS
    # RestrictedPython's print rewrite: ``_print._call_print(...)`` (returns None)
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
        and func.value.id == "_print"


def _parameter_names(args: ast.arguments) -> tuple[list[str], str | None, str | None]:
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return (names, args.vararg.arg if args.vararg else None,
            args.kwarg.arg if args.kwarg else None)


def _admit_statement(target: str, helper: str, like: ast.AST) -> ast.Assign:
    statement = ast.Assign(
        targets=[ast.Name(id=target, ctx=ast.Store())],
        value=ast.Call(func=ast.Name(id=helper, ctx=ast.Load()),
                       args=[ast.Name(id=target, ctx=ast.Load())], keywords=[]))
    return ast.copy_location(statement, like)


class DoorRewrite(ast.NodeTransformer):
    """The rewrite (see the module docstring); apply it to a whole module tree."""

    # -- values ------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> ast.AST:
        func = node.func
        self.generic_visit(node)
        if isinstance(func, ast.Attribute):  # a method called at once, not bound to a name
            node.func = func
        return node if _is_hook_call(node) else _call(ADMIT, node)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        """What RestrictedPython leaves as a plain attribute load is its own (``print`` is
        ``_print._call_print``): bound to a name, it is admitted too."""
        self.generic_visit(node)
        return _call(ADMIT, node) if isinstance(node.ctx, ast.Load) else node

    def _admitted(self, node: ast.expr) -> ast.AST:
        self.generic_visit(node)
        return _call(ADMIT, node)

    visit_BinOp = visit_Yield = visit_YieldFrom = _admitted

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        return node if isinstance(node.op, ast.Not) else _call(ADMIT, node)

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if all(isinstance(op, _BOOL_COMPARISONS) for op in node.ops):
            return node  # Python makes these a bool whatever the operands answer
        return _call(ADMIT, node)

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        """A value computed as a statement is dropped, never bound: not admitted (what it is
        computed from still is)."""
        node.value = self._unwrapped(node.value)
        return node

    def _unwrapped(self, value: ast.expr) -> ast.expr:
        visited = self.visit(value)
        if isinstance(visited, ast.Call) and isinstance(visited.func, ast.Name) \
                and visited.func.id == ADMIT and visited is not value:
            return visited.args[0]
        return visited

    # -- parameters ----------------------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        self.generic_visit(node)
        names, vararg, kwarg = _parameter_names(node.args)
        entry = [_admit_statement(name, ADMIT, node) for name in names]
        if vararg:
            entry.append(_admit_statement(vararg, ADMIT_ALL, node))
        if kwarg:
            entry.append(_admit_statement(kwarg, ADMIT_KEYWORDS, node))
        body = node.body
        docstring = body[:1] if body and isinstance(body[0], ast.Expr) \
            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str) \
            else []
        node.body = [*docstring, *entry, *body[len(docstring):]]
        node.decorator_list = [_call(DECORATE, d) for d in node.decorator_list]
        return node

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        """``lambda a, *b: body`` -> ``lambda a, *b: (lambda a=_admit_(a),
        b=_admit_all_(b): body)()`` (an assignment expression cannot be used: lambdas may sit
        in a comprehension's iterable)."""
        self.generic_visit(node)
        names, vararg, kwarg = _parameter_names(node.args)
        pairs = [*((n, ADMIT) for n in names), *([(vararg, ADMIT_ALL)] if vararg else []),
                 *([(kwarg, ADMIT_KEYWORDS)] if kwarg else [])]
        if not pairs:
            return node
        inner = ast.Lambda(
            args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=name) for name, _ in pairs],
                               vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None,
                               defaults=[ast.Call(func=ast.Name(id=helper, ctx=ast.Load()),
                                                  args=[ast.Name(id=name, ctx=ast.Load())],
                                                  keywords=[]) for name, helper in pairs]),
            body=node.body)
        node.body = ast.copy_location(ast.Call(func=inner, args=[], keywords=[]), node.body)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        self.generic_visit(node)
        node.decorator_list = [_call(DECORATE, d) for d in node.decorator_list]
        return node

    # -- except ... as target ----------------------------------------------------------------
    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> ast.AST:
        self.generic_visit(node)
        if node.name is not None:
            node.body.insert(0, _admit_statement(node.name, ADMIT_EXCEPTION, node))
        return node

    # -- with ... as target ------------------------------------------------------------------
    def visit_withitem(self, node: ast.withitem) -> ast.AST:
        self.generic_visit(node)
        if node.optional_vars is not None:
            node.context_expr = _call(ENTER, node.context_expr)
        return node


def open_doors(tree: ast.Module) -> ast.Module:
    """``tree`` with every door admitting (see the module docstring)."""
    tree = DoorRewrite().visit(tree)
    return ast.fix_missing_locations(tree)


__all__ = ["ADMIT", "ADMIT_ALL", "ADMIT_EXCEPTION", "ADMIT_KEYWORDS", "DECORATE", "ENTER",
           "HOOKS", "DoorRewrite", "open_doors"]
